"""GPU index tests: file bytes, export rule, activation statistics, reuse, gen-gpuidx e2e."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from powerpy import cli
from powerpy.commands.solve_gpuidx import main as solver_main
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys, Names
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.gguf_writer import patch_magic, write_gguf
from powerpy.formats.gpuidx import GpuIndex, default_gpuidx_path
from powerpy.formats.stats import (
    lexicographic_pairing,
    load_activation_stats,
    save_activation_stats,
)
from powerpy.placement.budget import capacity_upstream
from powerpy.placement.lifecycle import resolve_gpuidx
from powerpy.placement.placement import Placement
from powerpy.placement.solve import index_from_counts, topk_bucket
from solver import solve_hot_counts

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30


# --- reference bytes (docs/formats.md#reference-file) ---------------------------------------------
def reference_index() -> GpuIndex:
    """2 layers, n_ff 512, counts (256, 0), split.vram_capacity 1 GiB
    (docs/formats.md#reference-file)."""
    stats = [np.arange(512, 0, -1, dtype=np.float64), np.ones(512)]
    return index_from_counts(stats, [256, 0], vram_capacity=GIB)


def kv_record_sizes(data: bytes, n_kv: int) -> list[int]:
    sizes, pos = [], 24
    for _ in range(n_kv):
        start = pos
        (klen,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + klen
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if vtype == GGUFValueType.STRING:
            (slen,) = struct.unpack_from("<Q", data, pos)
            pos += 8 + slen
        else:
            pos += {GGUFValueType.UINT32: 4, GGUFValueType.UINT64: 8}[GGUFValueType(vtype)]
        sizes.append(pos - start)
    return sizes


def test_reference_bytes(tmp_path: Path) -> None:
    path = reference_index().write(tmp_path / "ref.gpuidx")
    data = path.read_bytes()
    assert len(data) == 5472
    assert data[:24].hex() == "505752490300000004000000000000000300000000000000"
    assert kv_record_sizes(data, 3) == [57, 45, 39]
    with read_gguf(path) as f:
        assert list(f.kv) == [Keys.ARCHITECTURE, Keys.GPUIDX_BLOCK_COUNT, Keys.SPLIT_VRAM_CAPACITY]
        assert f.kv[Keys.ARCHITECTURE] == "generic.gpu_index"
        assert f.kv_types[Keys.GPUIDX_BLOCK_COUNT] is GGUFValueType.UINT32
        assert f.kv_types[Keys.SPLIT_VRAM_CAPACITY] is GGUFValueType.UINT64
        assert list(f.tensors) == [
            "blk.0.gpu_idx",
            "blk.0.gpu_bucket",
            "blk.1.gpu_idx",
            "blk.1.gpu_bucket",
        ]
        assert [32 + len(n) for n in f.tensors] == [45, 48, 45, 48]
        assert f.data_offset == 352
        assert [t.offset - f.data_offset for t in f.tensors.values()] == [0, 2048, 3072, 5120]
        assert {t.file_type_id for t in f.tensors.values()} == {18}
        np.testing.assert_array_equal(f.array("blk.0.gpu_bucket"), np.arange(256))


def test_reference_bytes_match_gguf_writer_oracle(tmp_path: Path) -> None:
    """What upstream's exporter does: gguf-py writer, raw type 18, then patch PWRI + version."""
    import gguf

    idx = reference_index()
    oracle = tmp_path / "oracle.gpuidx"
    w = gguf.GGUFWriter(str(oracle), "generic.gpu_index")
    w.add_block_count(2)
    w.add_uint64(Keys.SPLIT_VRAM_CAPACITY, GIB)
    i32 = gguf.GGMLQuantizationType(18)
    for layer in range(2):
        for name, arr in (
            (f"blk.{layer}.gpu_idx", idx.gpu_idx[layer]),
            (f"blk.{layer}.gpu_bucket", idx.gpu_bucket[layer]),
        ):
            w.add_tensor(name, arr, raw_dtype=i32, raw_shape=arr.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expected = bytearray(oracle.read_bytes())
    expected[:8] = b"PWRI" + struct.pack("<I", 3)
    assert idx.write(tmp_path / "mine.gpuidx").read_bytes() == bytes(expected)


def test_write_read_write_is_byte_identical(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n_ff = 1024
    buckets = [
        rng.choice(n_ff, 300, replace=False),
        [],
        np.arange(n_ff),
        [5],
        rng.choice(n_ff, 32, replace=False),
    ]
    idx = GpuIndex.from_buckets(buckets, n_ff, vram_capacity=123_456_789_012, block_count=5)
    first = idx.write(tmp_path / "a.gpuidx")
    back = GpuIndex.read(first, n_layer=5, n_ff=n_ff)
    assert back == idx
    assert back.counts.tolist() == [300, 0, 1024, 1, 32]
    second = back.write(tmp_path / "b.gpuidx")
    assert first.read_bytes() == second.read_bytes()


# --- validation of bad files ----------------------------------------------------------------------
def write_raw_index(
    path: Path,
    layers: list[tuple[np.ndarray, np.ndarray]],
    *,
    kv: dict | None = None,
    magic: bytes = b"PWRI",
    names: list[str] | None = None,
) -> Path:
    kv = (
        kv
        if kv is not None
        else {
            Keys.ARCHITECTURE: ("generic.gpu_index", GGUFValueType.STRING),
            Keys.GPUIDX_BLOCK_COUNT: (len(layers), GGUFValueType.UINT32),
            Keys.SPLIT_VRAM_CAPACITY: (GIB, GGUFValueType.UINT64),
        }
    )
    tensors = []
    for layer, (mask, bucket) in enumerate(layers):
        tensors.append((Names.GPU_IDX.format(l=layer), np.asarray(mask, np.int32), GGMLType.I32))
        tensors.append(
            (Names.GPU_BUCKET.format(l=layer), np.asarray(bucket, np.int32), GGMLType.I32)
        )
    if names is not None:
        tensors = [(n, *t[1:]) for n, t in zip(names, tensors, strict=True)]
    return write_gguf(path, kv, tensors, magic=magic)


def mask_of(ones: list[int], n_ff: int = 64) -> np.ndarray:
    m = np.zeros(n_ff, np.int32)
    m[ones] = 1
    return m


GOOD = (mask_of([1, 5]), np.array([1, 5]))


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ([GOOD, (mask_of([1, 5]), np.array([5, 1]))], "not strictly increasing"),
        ([GOOD, (mask_of([0, 1]), np.array([0, 2]))], r"lists neuron 2 but gpu_idx\[2\] = 0"),
        ([GOOD, (mask_of([0, 1, 2]), np.array([0, 1]))], "marks 3 neurons but gpu_bucket lists 2"),
        ([GOOD, (np.full(64, 2, np.int32), np.array([], np.int32))], "expected 0 or 1"),
        ([GOOD, (mask_of([1]), np.array([64]))], r"outside \[0, 64\)"),
        ([GOOD, (mask_of([1], 32), np.array([1]))], "n_ff = 64"),
    ],
)
def test_read_rejects_inconsistent_layers(tmp_path: Path, layers: list, match: str) -> None:
    path = write_raw_index(tmp_path / "bad.gpuidx", layers)
    with pytest.raises(ValueError, match=match) as e:
        GpuIndex.read(path)
    assert str(path) in str(e.value)


def test_read_rejects_wrong_layer_count(tmp_path: Path) -> None:
    path = write_raw_index(tmp_path / "x.gpuidx", [GOOD, GOOD])
    with pytest.raises(ValueError, match="holds 4 tensors but a 3-layer model needs 6"):
        GpuIndex.read(path, n_layer=3)
    with pytest.raises(ValueError, match="n_ff = 128"):
        GpuIndex.read(path, n_layer=2, n_ff=128)
    idx = GpuIndex.read(path, n_layer=2, n_ff=64)
    with pytest.raises(ValueError, match="the index holds 4 tensors but a 32-layer model needs 64"):
        idx.validate(32, 64)


def test_read_rejects_upstream_i32_type_id_26(tmp_path: Path) -> None:
    # a GGUF-magic file stores I32 as 26 (upstream ggml); patched to PWRI, 26 means nothing
    path = write_raw_index(tmp_path / "x.gpuidx", [GOOD], magic=b"GGUF")
    with pytest.raises(ValueError, match="a GPU index is a PWRI file"):
        GpuIndex.read(path)
    patch_magic(path, b"PWRI")
    with pytest.raises(ValueError, match="26"):
        GpuIndex.read(path)


def test_read_checks_names_by_position(tmp_path: Path, caplog) -> None:
    swapped = ["blk.1.gpu_idx", "blk.1.gpu_bucket", "blk.0.gpu_idx", "blk.0.gpu_bucket"]
    other = (mask_of([7]), np.array([7]))
    path = write_raw_index(tmp_path / "x.gpuidx", [GOOD, other], names=swapped)
    with pytest.raises(ValueError, match="engine reads position 0 as 'blk.0.gpu_idx'"):
        GpuIndex.read(path)
    with caplog.at_level(logging.WARNING):
        idx = GpuIndex.read(path, strict_names=False)
    assert "loading by position" in caplog.text
    assert idx.gpu_bucket[0].tolist() == [1, 5]  # position 0/1, whatever the names say

    reordered = ["blk.0.gpu_bucket", "blk.0.gpu_idx", "blk.1.gpu_idx", "blk.1.gpu_bucket"]
    layers = [(np.array([1, 5]), mask_of([1, 5])), other]
    path = write_raw_index(tmp_path / "y.gpuidx", layers, names=reordered)
    with pytest.raises(ValueError, match="tensor 0 is 'blk.0.gpu_bucket'"):
        GpuIndex.read(path)


@pytest.mark.parametrize(
    ("kv", "match"),
    [
        ({Keys.ARCHITECTURE: ("generic.gpu_index", GGUFValueType.STRING)}, "is missing"),
        ({Keys.SPLIT_VRAM_CAPACITY: (1, GGUFValueType.UINT32)}, "UINT32, the engine reads"),
    ],
)
def test_read_requires_uint64_vram_capacity(tmp_path: Path, kv: dict, match: str) -> None:
    path = write_raw_index(tmp_path / "x.gpuidx", [GOOD], kv=kv)
    with pytest.raises(ValueError, match=match):
        GpuIndex.read(path)


def test_odd_tensor_count_is_rejected(tmp_path: Path) -> None:
    kv = {Keys.SPLIT_VRAM_CAPACITY: (1, GGUFValueType.UINT64)}
    path = write_gguf(
        tmp_path / "x.gpuidx", kv, [("blk.0.gpu_idx", GOOD[0], GGMLType.I32)], magic=b"PWRI"
    )
    with pytest.raises(ValueError, match="1 tensors"):
        GpuIndex.read(path)


# --- export rule (docs/architecture.md#export-rule) -----------------------------------------------
def test_export_is_topk_of_raw_stats() -> None:
    rng = np.random.default_rng(3)
    stats = [rng.random(1024) for _ in range(3)]
    counts = [256, 0, 1024]
    idx = index_from_counts(stats, counts, vram_capacity=0)
    for s, k, mask, bucket in zip(stats, counts, idx.gpu_idx, idx.gpu_bucket, strict=True):
        assert bucket.dtype == np.int32 and mask.dtype == np.int32
        assert int(mask.sum()) == len(bucket) == k
        assert np.all(np.diff(bucket) > 0)
        np.testing.assert_array_equal(bucket, np.sort(np.argsort(-s)[:k]))
        np.testing.assert_array_equal(np.flatnonzero(mask), bucket)


def test_tie_break_stable_and_torch() -> None:
    rng = np.random.default_rng(5)
    stats = rng.integers(0, 3, 2048).astype(np.float32)  # many ties at the cut
    k = 700
    stable = topk_bucket(stats, k)
    order = sorted(range(len(stats)), key=lambda j: (-stats[j], j))
    np.testing.assert_array_equal(stable, np.sort(order[:k]))
    via_torch = topk_bucket(stats, k, tie_break="torch")
    expected = np.sort(torch.topk(torch.from_numpy(stats), k).indices.numpy())
    np.testing.assert_array_equal(via_torch, expected)
    # the selected values agree either way; only which tied neurons differs
    assert np.sort(stats[stable]).tolist() == np.sort(stats[via_torch]).tolist()
    with pytest.raises(ValueError, match="cannot select"):
        topk_bucket(stats, 4096)


def test_from_buckets_errors() -> None:
    with pytest.raises(ValueError, match="repeated"):
        GpuIndex.from_buckets([[1, 1]], 8, vram_capacity=0)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        GpuIndex.from_buckets([[8]], 8, vram_capacity=0)
    with pytest.raises(ValueError, match="UINT64"):
        GpuIndex.from_buckets([[1]], 8, vram_capacity=-1)


# --- activation statistics ------------------------------------------------------------------------
def distinct_stats(n_layer: int, n_ff: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random(n_ff).astype(np.float32) + layer for layer in range(n_layer)]


def test_numeric_vs_lexicographic_order(tmp_path: Path) -> None:
    saved = distinct_stats(12, 64)
    save_activation_stats(tmp_path, saved)
    assert lexicographic_pairing(12) == [0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
    numeric = load_activation_stats(tmp_path, 12, 64)
    compat = load_activation_stats(tmp_path, 12, 64, compat_lexicographic=True)
    np.testing.assert_array_equal(numeric[2], saved[2])  # layer 2 -> activation_2
    np.testing.assert_array_equal(compat[2], saved[10])  # layer 2 -> activation_10 (bug #247)
    assert lexicographic_pairing(32)[:14] == [0, 1, *range(10, 20), 2, 20]


def test_save_is_atomic_and_round_trips(tmp_path: Path) -> None:
    counts = [np.arange(8, dtype=np.int64) * 3, torch.tensor([1.5, 0.0, 2.0, 3.0] * 2)]
    paths = save_activation_stats(tmp_path / "act", counts)
    assert [p.name for p in paths] == ["activation_0.pt", "activation_1.pt"]
    assert sorted(os.listdir(tmp_path / "act")) == ["activation_0.pt", "activation_1.pt"]
    back = load_activation_stats(tmp_path / "act", 2, 8)
    assert back[0].dtype == np.int64
    np.testing.assert_array_equal(back[0], counts[0])
    np.testing.assert_array_equal(back[1], counts[1].numpy())


def test_missing_extra_and_duplicate_files(tmp_path: Path) -> None:
    save_activation_stats(tmp_path, distinct_stats(4, 16))
    (tmp_path / "activation_3.pt.bak").write_bytes(b"ignored")  # not a full match
    assert len(load_activation_stats(tmp_path, 4, 16)) == 4
    with pytest.raises(ValueError, match=r"missing activation_4\.pt, activation_5\.pt") as e:
        load_activation_stats(tmp_path, 6, 16)
    assert str(tmp_path) in str(e.value)
    with pytest.raises(ValueError, match=r"unexpected activation_3\.pt"):
        load_activation_stats(tmp_path, 3, 16)
    (tmp_path / "activation_01.pt").write_bytes((tmp_path / "activation_1.pt").read_bytes())
    with pytest.raises(ValueError, match="activation_01.pt, activation_1.pt"):
        load_activation_stats(tmp_path, 4, 16)


def test_missing_directory_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        load_activation_stats(tmp_path / "nowhere", 2, 16)


class _Marker:
    """Unpickling this would create a file: the loader must refuse before that."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (torch.ones(10), r"holds 10 values but the model's n_ff is 16"),
        (torch.ones(4, 4), r"got shape \(4, 4\)"),
        (torch.tensor([1.0] * 15 + [float("nan")]), "value nan at neuron 15 is not finite"),
        (torch.tensor([1.0] * 3 + [-2.0] * 13), "value -2.0 at neuron 3 is negative"),
        ({"counts": torch.ones(16)}, "got dict"),
    ],
)
def test_malformed_file_errors_name_the_file(tmp_path: Path, content, match: str) -> None:
    save_activation_stats(tmp_path, distinct_stats(2, 16))
    torch.save(content, tmp_path / "activation_1.pt")
    with pytest.raises(ValueError, match=match) as e:
        load_activation_stats(tmp_path, 2, 16)
    assert "activation_1.pt" in str(e.value)


def test_unsafe_pickle_is_refused(tmp_path: Path) -> None:
    save_activation_stats(tmp_path, distinct_stats(2, 16))
    marker = tmp_path / "pwned"
    torch.save(_Marker(marker), tmp_path / "activation_0.pt")
    with pytest.raises(ValueError, match="refused to load") as e:
        load_activation_stats(tmp_path, 2, 16)
    assert "activation_0.pt" in str(e.value)
    assert not marker.exists()
    (tmp_path / "activation_0.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="activation_0.pt"):
        load_activation_stats(tmp_path, 2, 16)


# --- reuse rule (docs/architecture.md#index-lifecycle) --------------------------------------------
def test_resolve_gpuidx(tmp_path: Path, caplog) -> None:
    model = tmp_path / "m.powerinfer.gguf"
    path = default_gpuidx_path(model)
    assert path.name == "m.powerinfer.gguf.generated.gpuidx"
    assert resolve_gpuidx(model, 10, n_layer=2).action == "regenerate"
    GpuIndex.from_buckets([[1], []], 64, vram_capacity=1000).write(path)

    same = resolve_gpuidx(model, 1000, n_layer=2, n_ff=64)
    assert same.action == "reuse" and same.index is not None
    assert same.index.counts.tolist() == [1, 0]
    with caplog.at_level(logging.INFO):
        larger = resolve_gpuidx(model, 5000, n_layer=2)
    assert larger.action == "reuse"
    assert "--reset-gpu-index" in caplog.text
    smaller = resolve_gpuidx(model, 999, n_layer=2)
    assert smaller.action == "regenerate" and "1000" in smaller.reason
    assert resolve_gpuidx(model, 5000, n_layer=3).action == "regenerate"
    assert resolve_gpuidx(model, 5000, n_layer=2, reset=True).action == "regenerate"


def test_resolve_reads_layer_count_from_model(pwri_test_model) -> None:
    model = pwri_test_model(n_layer=3)
    GpuIndex.empty(2, 512, vram_capacity=0).write(default_gpuidx_path(model))
    decision = resolve_gpuidx(model, 10**9)
    assert decision.action == "regenerate"
    assert "holds 4 tensors but a 3-layer model needs 6" in decision.reason


# --- gen-gpuidx end to end ------------------------------------------------------------------------
def dense_and_kv_bytes(model: Path, n_ctx: int = 2048) -> tuple[int, int]:
    """Bytes of the dense tensors and KV cache, and of one neuron's rows (layer 0)."""
    with read_gguf(model) as f:
        p = Placement.for_model(f, 1 << 40, n_ctx=n_ctx)
        return p.plan.used, p.layers[0].neuron_bytes


def budget_arg(nbytes: int) -> str:
    return repr(nbytes / GIB)  # exact: dividing by a power of two


def solver_argv(act: Path, neuron: int, layer: int, capacity: int, vram: int, out: Path) -> list:
    """PowerInfer's solver arguments, as `python -m solver` takes them."""
    return [
        "--activation",
        str(act),
        "--neuron",
        str(neuron),
        "--layer",
        str(layer),
        "--capacity",
        str(capacity),
        "--vram-capacity",
        str(vram),
        "--output",
        str(out),
    ]


def test_gen_gpuidx_end_to_end(pwri_test_model, tmp_path: Path, capsys) -> None:
    model = pwri_test_model(n_layer=2, n_ff=512)
    stats = distinct_stats(2, 512, seed=11)
    save_activation_stats(tmp_path / "activation", stats)
    fixed, neuron = dense_and_kv_bytes(model)
    assert neuron == 3 * 64 * 2
    budget = fixed + 3 * 256 * neuron + 100  # room for 3 groups of 256

    assert cli.main(["gen-gpuidx", "-m", str(model), "--vram-budget", budget_arg(budget)]) == 0
    out = capsys.readouterr().out
    for word in ("layer", "coverage", "total", "remaining budget", "exact mode", "solver"):
        assert word in out
    idx = GpuIndex.read(default_gpuidx_path(model), n_layer=2, n_ff=512)
    assert idx.vram_capacity == budget - fixed
    assert idx.counts.sum() == 768
    np.testing.assert_array_equal(idx.counts, solve_hot_counts(stats, 768))
    for s, bucket in zip(stats, idx.gpu_bucket, strict=True):
        np.testing.assert_array_equal(bucket, np.sort(np.argsort(-s)[: len(bucket)]))
    assert f"remaining budget {100} bytes" in out

    # the same inputs through `python -m solver` give the same bytes
    other = tmp_path / "solver.gpuidx"
    args = solver_argv(tmp_path / "activation", 512, 2, 3 * 256, budget - fixed, other)
    subprocess.run([sys.executable, "-m", "solver", *args], cwd=REPO, check=True)
    assert other.read_bytes() == default_gpuidx_path(model).read_bytes()


def test_gen_gpuidx_and_solver_cli_agree_on_ties_with_torch_tie_break(
    pwri_test_model, tmp_path: Path, capsys
) -> None:
    model = pwri_test_model(n_layer=2, n_ff=512)
    rng = np.random.default_rng(2)
    stats = [rng.integers(0, 3, 512).astype(np.float32) for _ in range(2)]  # ties everywhere
    save_activation_stats(tmp_path / "activation", stats)
    fixed, neuron = dense_and_kv_bytes(model)
    budget = fixed + 2 * 256 * neuron
    out = tmp_path / "gen.gpuidx"
    argv = ["gen-gpuidx", "-m", str(model), "--vram-budget", budget_arg(budget), "-o", str(out)]
    assert cli.main([*argv, "--tie-break", "torch"]) == 0
    other = tmp_path / "solver.gpuidx"
    code = solver_main(solver_argv(tmp_path / "activation", 512, 2, 512, budget - fixed, other))
    assert code == 0
    assert other.read_bytes() == out.read_bytes()
    capsys.readouterr()


def test_gen_gpuidx_budget_too_small_gives_empty_placement(
    pwri_test_model, tmp_path: Path, capsys
) -> None:
    model = pwri_test_model()
    save_activation_stats(tmp_path / "activation", distinct_stats(2, 512))
    fixed, neuron = dense_and_kv_bytes(model)

    # dense part does not fit: the split is skipped
    assert cli.main(["gen-gpuidx", "-m", str(model), "--vram-budget", budget_arg(5000)]) == 0
    out = capsys.readouterr().out
    assert "empty placement: the dense tensors do not all fit" in out
    assert "stopped at" in out
    idx = GpuIndex.read(default_gpuidx_path(model), n_layer=2)
    assert idx.counts.tolist() == [0, 0] and idx.vram_capacity == 0

    # dense part and KV fit, but not one group of 256 neurons
    budget = fixed + 255 * neuron
    assert cli.main(["gen-gpuidx", "-m", str(model), "--vram-budget", budget_arg(budget)]) == 0
    out = capsys.readouterr().out
    assert "fewer than one group of 256" in out
    idx = GpuIndex.read(default_gpuidx_path(model), n_layer=2)
    assert idx.counts.tolist() == [0, 0] and idx.vram_capacity == 255 * neuron


def test_gen_gpuidx_missing_activation_dir(pwri_test_model, tmp_path: Path, capsys) -> None:
    model = pwri_test_model()
    assert cli.main(["gen-gpuidx", "-m", str(model), "--vram-budget", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(tmp_path / "activation") in err
    assert not default_gpuidx_path(model).exists()


def test_gen_gpuidx_never_overwrites_the_model(pwri_test_model, tmp_path: Path, capsys) -> None:
    model = pwri_test_model()
    save_activation_stats(tmp_path / "activation", distinct_stats(2, 512))
    before = model.read_bytes()
    argv = ["gen-gpuidx", "-m", str(model), "--vram-budget", "1", "--output", str(model)]
    assert cli.main(argv) == 1
    assert "refusing to overwrite" in capsys.readouterr().err
    assert model.read_bytes() == before


def test_gen_gpuidx_powerinfer_capacity_mode(pwri_test_model, tmp_path: Path, capsys) -> None:
    model = pwri_test_model()
    save_activation_stats(tmp_path / "activation", distinct_stats(2, 512))
    fixed, neuron = dense_and_kv_bytes(model)
    budget = fixed + 400_000
    argv = ["gen-gpuidx", "-m", str(model), "--vram-budget", budget_arg(budget)]
    assert cli.main([*argv, "--capacity-model", "powerinfer"]) == 0
    expected = capacity_upstream(400_000, 512, GGMLType.F16, has_gate=True)
    assert f"capacity   {expected} neurons (powerinfer mode" in capsys.readouterr().out


def test_gen_gpuidx_compat_lexicographic(pwri_test_model, tmp_path: Path, capsys) -> None:
    n_layer, n_ff = 12, 512
    model = pwri_test_model(n_layer=n_layer, n_ff=n_ff)
    rng = np.random.default_rng(4)
    stats = []
    for layer in range(n_layer):  # each file has its own hot half, clearly ahead of the rest
        s = rng.random(n_ff).astype(np.float32)
        s[rng.permutation(n_ff)[:256]] += 10 + layer
        stats.append(s)
    save_activation_stats(tmp_path / "activation", stats)
    fixed, neuron = dense_and_kv_bytes(model)
    budget = budget_arg(fixed + n_layer * 256 * neuron)
    out_num, out_lex = tmp_path / "num.gpuidx", tmp_path / "lex.gpuidx"
    assert (
        cli.main(["gen-gpuidx", "-m", str(model), "--vram-budget", budget, "-o", str(out_num)]) == 0
    )
    argv = ["gen-gpuidx", "-m", str(model), "--vram-budget", budget, "-o", str(out_lex)]
    assert cli.main([*argv, "--compat-lexicographic"]) == 0
    num = GpuIndex.read(out_num, n_layer=n_layer)
    lex = GpuIndex.read(out_lex, n_layer=n_layer)
    assert num.counts.tolist() == lex.counts.tolist() == [256] * n_layer
    np.testing.assert_array_equal(num.gpu_bucket[2], topk_bucket(stats[2], 256))
    np.testing.assert_array_equal(lex.gpu_bucket[2], topk_bucket(stats[10], 256))
    capsys.readouterr()


def test_solver_cli_errors(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "x.gpuidx")
    argv = ["--activation", str(tmp_path / "none"), "--layer", "2", "--neuron", "512"]
    assert solver_main([*argv, "--vram-capacity", "1", "--output", out]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path / "none") in err
    with pytest.raises(SystemExit) as e:
        solver_main([*argv, "--output", out])
    assert e.value.code == 2
    assert "--vram-capacity is required" in capsys.readouterr().err


def test_gen_gpuidx_rejects_dense_model(pwri_test_model, tmp_path: Path, capsys) -> None:
    model = pwri_test_model("dense.gguf")
    patch_magic(model, b"GGUF")
    save_activation_stats(tmp_path / "activation", distinct_stats(2, 512))
    assert cli.main(["gen-gpuidx", "-m", str(model), "--vram-budget", "1"]) == 1
    assert "dense GGUF" in capsys.readouterr().err
