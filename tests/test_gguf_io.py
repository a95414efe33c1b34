"""GGUF reader and writer: the reader agrees with gguf.GGUFReader, PWRI/id-18 handling, byte-exact
round trips, the 5472-byte .gpuidx reference (docs/formats.md#reference-file), the writer
contract and `powerpy dump`."""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from quant_fixtures import random_blocks

from powerpy import _fs, cli
from powerpy.commands import dump as dump_cmd
from powerpy.formats import quants
from powerpy.formats.constants import GGUF_TYPE_IDS, PWRI_TYPE_IDS, GGMLType, GGUFValueType
from powerpy.formats.gguf_reader import (
    GGUFFile,
    GGUFFormatError,
    TensorInfo,
    mapped_by,
    read_gguf,
    tensor_nbytes,
)
from powerpy.formats.gguf_writer import patch_magic, write_gguf

REPO = Path(__file__).resolve().parent.parent
V = GGUFValueType
GQ = gguf.GGMLQuantizationType


# --- fixtures: files written by the upstream gguf.GGUFWriter -------------------------------------
def write_oracle_file(
    path: Path, *, int_types: bool = True, seed: int = 0
) -> dict[str, np.ndarray]:
    """Write a GGUF with every KV value type and many tensor types using gguf.GGUFWriter.

    Returns the source arrays of the unquantized tensors by name.
    """
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 3.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo ✓ wörld")
    w.add_key_value("t.empty_str", "", gguf.GGUFValueType.STRING)
    w.add_array("t.arr_str", ["a", "", "ü", "long" * 50])
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_bool", [True, False, True])
    w.add_array("t.arr_f32", [0.5, -1.25, 1e-7])
    w.add_key_value(
        "t.arr_u64", [1, 2**64 - 1], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64
    )
    w.add_key_value("t.arr_i64", [-(2**63), 7], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT64)
    w.add_key_value("t.arr_f64", [0.1, -2.5], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT64)
    w.add_key_value("t.arr_u8", [0, 255], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8)
    w.add_key_value("t.arr_i8", [-128, 127], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT8)
    w.add_key_value("t.arr_u16", [65535], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT16)
    w.add_key_value("t.arr_i16", [-32768, 1], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT16)
    w.add_key_value("t.arr_u32", [2**32 - 1], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)

    src: dict[str, np.ndarray] = {}
    src["f32.2d"] = rng.standard_normal((3, 64)).astype(np.float32)
    src["f32.1d_odd"] = rng.standard_normal(7).astype(np.float32)  # 28 bytes: needs padding
    src["f16.3d"] = rng.standard_normal((2, 3, 32)).astype(np.float16)
    src["f32.empty"] = np.zeros(0, dtype=np.float32)
    for name, arr in src.items():
        w.add_tensor(name, arr)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    for qt in (GQ.Q8_0, GQ.Q4_0, GQ.Q4_1, GQ.Q5_0):
        w.add_tensor(f"{qt.name.lower()}.w", gguf.quants.quantize(x, qt), raw_dtype=qt)
    w.add_tensor("q6_k.w", random_blocks(rng, GGMLType.Q6_K, 4, 1), raw_dtype=GQ.Q6_K)
    w.add_tensor("q4_k.w", random_blocks(rng, GGMLType.Q4_K, 2, 1), raw_dtype=GQ.Q4_K)
    if int_types:
        src["i8.w"] = rng.integers(-128, 128, (2, 5), dtype=np.int8)
        src["i16.w"] = rng.integers(-(2**15), 2**15, 9, dtype=np.int16)
        src["i32.w"] = rng.integers(-(2**31), 2**31, (3, 4), dtype=np.int32)
        for name in ("i8.w", "i16.w", "i32.w"):
            w.add_tensor(name, src[name])
        bf = gguf.quants.quantize(rng.standard_normal((2, 8)).astype(np.float32), GQ.BF16)
        w.add_tensor("bf16.w", bf, raw_dtype=GQ.BF16)
        src["bf16.w"] = bf.view(np.uint16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return src


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("oracle") / "oracle.gguf"
    return path, write_oracle_file(path)


@pytest.fixture(scope="module")
def oracle_shared_types(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An oracle file with only the type ids 0..15 that GGUF and PWRI share."""
    path = tmp_path_factory.mktemp("oracle") / "shared.gguf"
    write_oracle_file(path, int_types=False, seed=1)
    return path


def assert_agrees_with_reader(mine: GGUFFile, ref: gguf.GGUFReader) -> None:
    """Every KV (value and types) and every tensor (name, ne, type, offset, bytes) agree."""
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(mine.kv) == list(fields)
    assert list(mine.kv_types) == list(fields)
    for key, field in fields.items():
        assert int(mine.kv_types[key]) == int(field.types[0]), key
        got, expected = mine.kv[key], field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert int(mine.kv_array_types[key]) == int(field.types[-1]), key
            if field.types[-1] == gguf.GGUFValueType.STRING:
                assert isinstance(got, list) and got == expected, key
            else:
                assert isinstance(got, np.ndarray) and got.tolist() == expected, key
                if field.types[-1] == gguf.GGUFValueType.BOOL:
                    assert got.dtype == np.bool_
        else:
            assert got == expected and type(got) is type(expected), key
    assert list(mine.tensors) == [t.name for t in ref.tensors]
    assert mine.data_offset == ref.data_offset
    assert mine.alignment == ref.alignment
    for t in ref.tensors:
        info = mine.tensors[t.name]
        assert info.ne == tuple(int(d) for d in t.shape)
        assert info.shape == tuple(reversed(info.ne))
        assert info.n_elements == t.n_elements
        assert info.file_type_id == int(t.tensor_type)
        table = PWRI_TYPE_IDS if mine.sparse else GGUF_TYPE_IDS
        assert info.ggml_type is table[info.file_type_id]
        assert info.offset == t.data_offset
        assert info.nbytes == t.n_bytes
        expected_bytes = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
        assert np.array_equal(mine.raw(t.name).reshape(-1), expected_bytes), t.name


# --- reader vs gguf.GGUFReader --------------------------------------------------------------------
def test_reader_agrees_with_gguf_reader(oracle):
    path, _ = oracle
    with read_gguf(path) as f:
        assert f.magic == b"GGUF" and f.version == 3 and not f.sparse
        assert_agrees_with_reader(f, gguf.GGUFReader(path))
        # the KV types cover all 12 value kinds (ARRAY included) and the array items all 11 scalars
        assert set(f.kv_types.values()) == set(GGUFValueType)
        assert set(f.kv_array_types.values()) == set(GGUFValueType) - {V.ARRAY}


def test_pwri_magic_reads_same_content(oracle_shared_types, tmp_path):
    pwri = tmp_path / "shared.pwri.gguf"
    shutil.copy(oracle_shared_types, pwri)
    patch_magic(pwri, b"PWRI")
    assert pwri.read_bytes()[:4] == b"PWRI"
    ref = gguf.GGUFReader(oracle_shared_types)
    with read_gguf(pwri) as f, read_gguf(oracle_shared_types) as g:
        assert f.sparse and f.magic == b"PWRI" and not g.sparse
        assert_agrees_with_reader(f, ref)
        for name in f.tensors:
            assert np.array_equal(f.dequantize(name), g.dequantize(name))


def test_typed_views_and_dequantize(oracle):
    path, src = oracle
    with read_gguf(path) as f:
        for name in ("f32.2d", "f32.1d_odd", "f16.3d", "f32.empty", "i8.w", "i16.w", "i32.w"):
            arr = f.array(name)
            assert arr.dtype == src[name].dtype and arr.shape == src[name].shape
            assert np.array_equal(arr, src[name])
            assert np.array_equal(f.dequantize(name), src[name].astype(np.float32))
        bf = f.array("bf16.w")  # BF16: raw uint16 bits
        assert bf.dtype == np.uint16 and np.array_equal(bf, src["bf16.w"])
        expected = gguf.quants.dequantize(f.raw("bf16.w"), GQ.BF16).reshape(2, 8)
        assert np.array_equal(f.dequantize("bf16.w"), expected)
        for name in ("q8_0.w", "q4_0.w", "q4_1.w", "q5_0.w", "q6_k.w", "q4_k.w"):
            t = f.tensors[name]
            with pytest.raises(ValueError, match="dequantize"):
                f.array(name)
            ref = gguf.quants.dequantize(f.raw(name), GQ(t.file_type_id))
            got = f.dequantize(name)
            assert got.shape == t.shape and got.dtype == np.float32
            assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), name


def test_raw_views_are_zero_copy_row_tables(oracle):
    path, _ = oracle
    with read_gguf(path) as f:
        assert f.raw("f16.3d").shape == (6, 64)  # (n_rows = 2*3, row_bytes = 32*2)
        assert f.raw("f32.1d_odd").shape == (1, 28)
        assert f.raw("q8_0.w").shape == (4, 68)
        assert f.raw("q6_k.w").shape == (4, 210)
        assert f.raw("f32.empty").shape == (1, 0)
        raw = f.raw("q4_0.w")
        assert raw.dtype == np.uint8 and not raw.flags.owndata and not raw.flags.writeable
        assert np.shares_memory(raw, f.raw("q4_0.w"))


def test_smollm2_agrees_with_gguf_reader(smollm2_path):
    with read_gguf(smollm2_path) as f:
        assert not f.sparse and len(f.tensors) == 272
        assert {t.ggml_type for t in f.tensors.values()} == {
            GGMLType.Q4_1,
            GGMLType.Q8_0,
            GGMLType.F32,
        }
        assert len(f.kv["tokenizer.ggml.tokens"]) == 49152
        assert f.kv_array_types["tokenizer.ggml.token_type"] is V.INT32
        assert_agrees_with_reader(f, gguf.GGUFReader(smollm2_path))


def test_smollm2_as_pwri(smollm2_path, tmp_path):
    """The same model patched to PWRI reads identically (its type ids are all shared)."""
    pwri = tmp_path / "smollm2.pwri.gguf"
    shutil.copy(smollm2_path, pwri)
    patch_magic(pwri, b"PWRI")
    with read_gguf(pwri) as f, read_gguf(smollm2_path) as g:
        assert f.sparse and not g.sparse
        assert f.kv_types == g.kv_types and list(f.kv) == list(g.kv)
        assert f.tensors == g.tensors
        assert np.array_equal(f.raw("blk.3.ffn_up.weight"), g.raw("blk.3.ffn_up.weight"))


# --- round trips ----------------------------------------------------------------------------------
def _round_trip(src: Path, dst: Path) -> None:
    with read_gguf(src) as f:
        write_gguf(
            dst,
            f.typed_kv(),
            f.tensor_specs(),
            magic=f.magic,
            alignment=f.alignment,
            version=f.version,
        )


def test_round_trip_gguf_writer_files_byte_identical(oracle, oracle_shared_types, tmp_path):
    for src in (oracle[0], oracle_shared_types):
        out = tmp_path / src.name
        _round_trip(src, out)
        assert out.read_bytes() == src.read_bytes()


def test_round_trip_smollm2_byte_identical(smollm2_path, tmp_path):
    # gguf-py wrote it: no general.alignment, 32-byte padding everywhere, so nothing changes
    out = tmp_path / "smollm2.gguf"
    _round_trip(smollm2_path, out)
    assert out.stat().st_size == smollm2_path.stat().st_size
    assert out.read_bytes() == smollm2_path.read_bytes()


def _pwri_model_like(path: Path, seed: int = 0) -> None:
    """A tiny PowerInfer-layout model: PWRI, F16/Q4_0 FFN with ffn_down_t, predictors, threshold."""
    rng = np.random.default_rng(seed)
    n_embd, n_ff, h = 64, 96, 32
    kv = [
        ("general.architecture", "llama"),
        ("general.name", "tiny"),
        ("llama.context_length", (128, V.UINT32)),
        ("llama.embedding_length", (n_embd, V.UINT32)),
        ("llama.block_count", (1, V.UINT32)),
        ("llama.feed_forward_length", (n_ff, V.UINT32)),
        ("llama.attention.layer_norm_rms_epsilon", (1e-6, V.FLOAT32)),
        ("powerinfer.sparse_threshold", (0.0, V.FLOAT32)),
        ("tokenizer.ggml.tokens", ["<s>", "</s>", "a", "b"]),
        ("tokenizer.ggml.scores", np.zeros(4, np.float32)),
        ("tokenizer.ggml.token_type", np.array([3, 3, 1, 1], np.int32)),
    ]

    def q4(shape):
        return quants.quantize_q4_0(rng.standard_normal(shape).astype(np.float32))

    tensors = [
        ("token_embd.weight", rng.standard_normal((4, n_embd)).astype(np.float16), GGMLType.F16),
        ("blk.0.attn_norm.weight", np.ones(n_embd, np.float32), GGMLType.F32),
        ("blk.0.ffn_gate.weight", q4((n_ff, n_embd)), GGMLType.Q4_0, (n_ff, n_embd)),
        ("blk.0.ffn_up.weight", q4((n_ff, n_embd)), GGMLType.Q4_0, (n_ff, n_embd)),
        ("blk.0.ffn_down_t.weight", q4((n_ff, n_embd)), GGMLType.Q4_0, (n_ff, n_embd)),
        ("blk.0.fc1.weight", rng.standard_normal((h, n_embd)).astype(np.float16), GGMLType.F16),
        ("blk.0.fc2.weight", rng.standard_normal((n_ff, h)).astype(np.float16), GGMLType.F16),
        ("output_norm.weight", np.ones(n_embd - 1, np.float32), GGMLType.F32),  # unpadded size
    ]
    write_gguf(path, kv, tensors, magic=b"PWRI")


def test_round_trip_pwri_model_byte_identical(tmp_path):
    src, out = tmp_path / "tiny.powerinfer.gguf", tmp_path / "copy.powerinfer.gguf"
    _pwri_model_like(src)
    _round_trip(src, out)
    data = src.read_bytes()
    assert out.read_bytes() == data and data[:8] == b"PWRI" + struct.pack("<I", 3)
    with read_gguf(src) as f:
        assert f.sparse
        assert f.kv_types["powerinfer.sparse_threshold"] is V.FLOAT32
        assert f.tensors["blk.0.ffn_down_t.weight"].shape == (96, 64)
        assert f.tensors["blk.0.ffn_down_t.weight"].ggml_type is GGMLType.Q4_0
        # trailing padding of the last tensor (63 floats = 252 bytes, padded to 256)
        last = f.tensors["output_norm.weight"]
        assert len(data) == last.offset + 256


# --- .gpuidx: the reference file and the id-18 clash --------------------------------------------
def _write_gpuidx(path: Path, magic: bytes = b"PWRI") -> dict[str, np.ndarray]:
    idx0 = np.zeros(512, np.int32)
    idx0[::2] = 1  # 256 neurons on the GPU
    arrays = {
        "blk.0.gpu_idx": idx0,
        "blk.0.gpu_bucket": np.flatnonzero(idx0).astype(np.int32),
        "blk.1.gpu_idx": np.zeros(512, np.int32),
        "blk.1.gpu_bucket": np.zeros(0, np.int32),
    }
    kv = {
        "general.architecture": "generic.gpu_index",
        "generic.gpu_index.block_count": (2, V.UINT32),
        "split.vram_capacity": (1073741824, V.UINT64),
    }
    write_gguf(path, kv, [(n, a, GGMLType.I32) for n, a in arrays.items()], magic=magic)
    return arrays


def test_gpuidx_reference_5472_bytes(tmp_path):
    path = tmp_path / "model.generated.gpuidx"
    arrays = _write_gpuidx(path)
    data = path.read_bytes()
    assert len(data) == 5472
    assert data[:24].hex() == "505752490300000004000000000000000300000000000000"
    # KV records of 57, 45 and 39 bytes end at 165, where the first tensor-info record starts
    assert data[24:32] == struct.pack("<Q", len("general.architecture"))
    assert data[24 + 57 : 24 + 57 + 8] == struct.pack("<Q", len("generic.gpu_index.block_count"))
    assert data[126:134] == struct.pack("<Q", len("split.vram_capacity"))
    assert data[165:186] == struct.pack("<Q", 13) + b"blk.0.gpu_idx"
    # last tensor info ends at 351: type id 18 then relative offset 5120
    assert data[339:351] == struct.pack("<IQ", 18, 5120)
    assert data[351] == 0
    with read_gguf(path) as f:
        assert f.sparse and f.data_offset == 352
        assert list(f.kv) == [
            "general.architecture",
            "generic.gpu_index.block_count",
            "split.vram_capacity",
        ]
        assert [f.kv_types[k] for k in f.kv] == [V.STRING, V.UINT32, V.UINT64]
        assert f.kv["split.vram_capacity"] == 1073741824
        rel = [t.offset - f.data_offset for t in f.tensors.values()]
        assert rel == [0, 2048, 3072, 5120]
        assert [t.nbytes for t in f.tensors.values()] == [2048, 1024, 2048, 0]
        for name, arr in arrays.items():
            t = f.tensors[name]
            assert t.ggml_type is GGMLType.I32 and t.file_type_id == 18
            assert np.array_equal(f.array(name), arr)
    out = tmp_path / "copy.gpuidx"
    _round_trip(path, out)
    assert out.read_bytes() == data


def test_gguf_magic_uses_upstream_ids(tmp_path):
    path = tmp_path / "idx.gguf"
    _write_gpuidx(path, magic=b"GGUF")
    with read_gguf(path) as f:
        assert all(t.file_type_id == 26 and t.ggml_type is GGMLType.I32 for t in f.tensors.values())
    assert [int(t.tensor_type) for t in gguf.GGUFReader(path).tensors] == [26] * 4


def test_id_18_in_gguf_file_is_rejected_as_iq(tmp_path):
    path = tmp_path / "idx.gpuidx"
    _write_gpuidx(path)
    patch_magic(path, b"GGUF")
    with pytest.raises(GGUFFormatError, match="IQ quant") as e:
        read_gguf(path)
    assert "idx.gpuidx" in str(e.value) and "offset" in str(e.value) and " 18" in str(e.value)
    assert e.value.offset == 24 + 57 + 45 + 39 + 8 + 13 + 4 + 8  # the type field of tensor 0


def test_id_26_in_pwri_file_is_rejected(oracle, tmp_path):
    path = tmp_path / "oracle.pwri"
    shutil.copy(oracle[0], path)
    patch_magic(path, b"PWRI")
    with pytest.raises(GGUFFormatError, match="type id 2[456], unknown to PowerInfer"):
        read_gguf(path)


def test_bf16_has_no_pwri_id(tmp_path):
    bf = np.zeros((2, 4), np.uint16)
    with pytest.raises(ValueError, match="BF16"):
        write_gguf(tmp_path / "x.gguf", {}, [("w", bf, GGMLType.BF16)], magic=b"PWRI")
    write_gguf(tmp_path / "x.gguf", {}, [("w", bf, GGMLType.BF16)])
    with read_gguf(tmp_path / "x.gguf") as f:
        assert f.tensors["w"].file_type_id == 30 and f.tensors["w"].ggml_type is GGMLType.BF16


# --- the writer contract -------------------------------------------------------------------------
def test_kv_order_and_inferred_types(tmp_path):
    path = tmp_path / "kv.gguf"
    kv = [
        ("z.last_alphabetically", "first"),
        ("a.uint", 7),
        ("m.neg", -3),
        ("b.big", 2**40),
        ("c.bigneg", -(2**40)),
        ("d.float", 1.5),
        ("e.bool", True),
        ("f.ints", [1, -2]),
        ("g.bigints", [2**40]),
        ("h.strs", ["x", "y"]),
        ("i.u16", np.arange(3, dtype=np.uint16)),
        ("j.bools", [True, False]),
        ("k.floats", [1, 2.5]),
        ("l.empty_u32", ([], V.ARRAY, V.UINT32)),
        ("n.empty_strs", ([], V.ARRAY, V.STRING)),
        ("o.empty_str", ""),
        ("p.f64", (0.1, V.FLOAT64)),
        ("q.i8", (-1, V.INT8)),
    ]
    write_gguf(path, kv, [])
    with read_gguf(path) as f:
        assert list(f.kv) == [k for k, _ in kv]
        types = {k: f.kv_types[k] for k in f.kv}
        assert types == {
            "z.last_alphabetically": V.STRING,
            "a.uint": V.UINT32,
            "m.neg": V.INT32,
            "b.big": V.UINT64,
            "c.bigneg": V.INT64,
            "d.float": V.FLOAT32,
            "e.bool": V.BOOL,
            "f.ints": V.ARRAY,
            "g.bigints": V.ARRAY,
            "h.strs": V.ARRAY,
            "i.u16": V.ARRAY,
            "j.bools": V.ARRAY,
            "k.floats": V.ARRAY,
            "l.empty_u32": V.ARRAY,
            "n.empty_strs": V.ARRAY,
            "o.empty_str": V.STRING,
            "p.f64": V.FLOAT64,
            "q.i8": V.INT8,
        }
        items = f.kv_array_types
        assert [
            items[k] for k in ("f.ints", "g.bigints", "h.strs", "i.u16", "j.bools", "k.floats")
        ] == [
            V.INT32,
            V.INT64,
            V.STRING,
            V.UINT16,
            V.BOOL,
            V.FLOAT32,
        ]
        assert f.kv["l.empty_u32"].shape == (0,) and f.kv["l.empty_u32"].dtype == np.dtype("<u4")
        assert f.kv["n.empty_strs"] == [] and f.kv["o.empty_str"] == ""
        assert f.kv["p.f64"] == 0.1 and f.kv["q.i8"] == -1
        assert f.kv["j.bools"].tolist() == [True, False]
        assert f.data_offset == f.path.stat().st_size  # no tensors: header padded to 32
    # the upstream reader agrees on everything except the empty arrays, which it cannot type
    ref = gguf.GGUFReader(path)
    assert [k for k in ref.fields if not k.startswith("GGUF.")] == [k for k, _ in kv]


def test_non_utf8_string_values_round_trip(tmp_path):
    path, out = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(
        path, {"s": (b"\xff\xfeok", V.STRING), "arr": ([b"\x80", "ü"], V.ARRAY, V.STRING)}, []
    )
    with read_gguf(path) as f:
        assert f.kv["s"].encode("utf-8", "surrogateescape") == b"\xff\xfeok"
    _round_trip(path, out)
    assert out.read_bytes() == path.read_bytes()


def test_custom_alignment(tmp_path):
    path = tmp_path / "a64.gguf"
    tensors = [(f"t{i}", np.full(i + 3, i, np.float32), GGMLType.F32) for i in range(4)]
    write_gguf(path, {"general.architecture": "x"}, tensors, alignment=64)
    with read_gguf(path) as f:
        assert f.alignment == 64 and f.kv["general.alignment"] == 64
        assert f.kv_types["general.alignment"] is V.UINT32
        assert list(f.kv) == ["general.architecture", "general.alignment"]  # appended last
        assert f.data_offset % 64 == 0
        assert all(t.offset % 64 == 0 for t in f.tensors.values())
        assert f.path.stat().st_size == f.data_offset + 4 * 64
        assert_agrees_with_reader(f, gguf.GGUFReader(path))
    with pytest.raises(ValueError, match="contradicts"):
        write_gguf(path, {"general.alignment": (64, V.UINT32)}, [], alignment=32)
    with pytest.raises(ValueError, match="power of two"):
        write_gguf(tmp_path / "bad.gguf", {}, [], alignment=48)


def test_raw_quantized_data_and_shapes(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    raw = quants.quantize_q8_0(x)  # (2, 3, 68)
    path = tmp_path / "q.gguf"
    write_gguf(
        path, {}, [("a", raw, GGMLType.Q8_0), ("b", raw.reshape(6, 68), GGMLType.Q8_0, (6, 64))]
    )
    with read_gguf(path) as f:
        assert f.tensors["a"].shape == (2, 3, 64) and f.tensors["a"].ne == (64, 3, 2)
        assert f.tensors["b"].shape == (6, 64)
        assert np.array_equal(f.dequantize("a").reshape(6, 64), f.dequantize("b"))
        assert np.allclose(f.dequantize("a"), x, atol=0.05)


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (("w", np.zeros(4, np.float64), GGMLType.F32), "must be float32"),
        (("w", np.zeros(4, np.float32), GGMLType.F16), "must be float16"),
        (("w", np.zeros((2, 34), np.uint8), GGMLType.Q8_0, (2, 64)), "needs 136 bytes"),
        (("w", np.zeros((1, 18), np.uint8), GGMLType.Q4_0, (1, 31)), "multiple of the block"),
        (("x" * 64, np.zeros(1, np.float32), GGMLType.F32), "63 bytes"),
        (("w", np.zeros((1, 1, 1, 1, 1), np.float32), GGMLType.F32), "dims"),
    ],
)
def test_writer_rejects_bad_tensors(tmp_path, tensor, match):
    with pytest.raises(ValueError, match=match):
        write_gguf(tmp_path / "bad.gguf", {}, [tensor])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kv", "match"),
    [
        ([("a", 1), ("a", 2)], "duplicate key"),
        ({"a": (256, V.UINT8)}, "out of range"),
        ({"a": (1.5, V.INT32)}, "not an integer"),
        ({"a": ([1, 300], V.ARRAY, V.UINT8)}, "do not fit"),
        ({"a": ([]), "b": 1}, "empty array"),
        ({"a": ([[1], [2]], V.ARRAY, V.ARRAY)}, "arrays of arrays"),
        ({"a": object()}, "cannot infer"),
        ({"a": (1e39, V.FLOAT32)}, "out of range for FLOAT32"),
        ({"general.alignment": (32, V.UINT64)}, "must be UINT32"),
    ],
)
def test_writer_rejects_bad_kv(tmp_path, kv, match):
    with pytest.raises(ValueError, match=match):
        write_gguf(tmp_path / "bad.gguf", kv, [])
    assert list(tmp_path.iterdir()) == []


def test_writer_needs_an_existing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_gguf(tmp_path / "no" / "x.gguf", {}, [])


def test_writer_rejects_duplicate_tensor_names(tmp_path):
    a = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="duplicate tensor name 'w'"):
        write_gguf(tmp_path / "x.gguf", {}, [("w", a, GGMLType.F32), ("w", a, GGMLType.F32)])


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "idx.gpuidx"
    _write_gpuidx(path)
    before = path.read_bytes()

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(_fs.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_gguf(path, {"a": 1}, [("w", np.zeros(3, np.float32), GGMLType.F32)])
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["idx.gpuidx"]  # no temp file left


def test_refuses_to_replace_a_mapped_file(tmp_path):
    path = tmp_path / "idx.gpuidx"
    arrays = _write_gpuidx(path)
    f = read_gguf(path)
    view = f.array("blk.0.gpu_idx")
    with pytest.raises(ValueError, match="memory-mapped"):
        write_gguf(path, {}, [])
    write_gguf(path, {"a": 1}, [], overwrite_mapped=True)
    assert np.array_equal(view, arrays["blk.0.gpu_idx"])  # the old mapping stays valid (POSIX)
    f.close()
    with read_gguf(path) as g:
        assert g.kv == {"a": 1} and g.tensors == {}


def test_version_2_and_patch_magic_checks(tmp_path):
    path = tmp_path / "v2.gguf"
    write_gguf(path, {"a": 1}, [("w", np.ones(2, np.float32), GGMLType.F32)], version=2)
    with read_gguf(path) as f:
        assert f.version == 2 and f.array("w").tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="magic"):
        patch_magic(path, b"GGML")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(GGUFFormatError, match="bad magic"):
        patch_magic(junk, b"PWRI")


# --- reader API ---------------------------------------------------------------------------------
def test_missing_file_and_directory(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(missing)
    with pytest.raises(IsADirectoryError, match="directory"):
        read_gguf(tmp_path)


def test_close_context_manager_and_repr(tmp_path):
    path = tmp_path / "idx.gpuidx"
    arrays = _write_gpuidx(path)
    with read_gguf(path) as f:
        view = f.array("blk.0.gpu_bucket")
        assert len(repr(f)) < 100 and "PWRI" in repr(f) and "4 tensors" in repr(f)
    assert f.closed and "closed" in repr(f)
    with pytest.raises(ValueError, match="closed"):
        f.raw("blk.0.gpu_bucket")
    assert np.array_equal(view, arrays["blk.0.gpu_bucket"])  # still valid after close
    with read_gguf(path) as g, pytest.raises(KeyError, match="no tensor named"):
        g.raw("blk.9.gpu_idx")


def test_writable_maps_copy_on_write(tmp_path):
    path = tmp_path / "idx.gpuidx"
    _write_gpuidx(path)
    before = path.read_bytes()
    with read_gguf(path, writable=True) as f:
        arr = f.array("blk.1.gpu_idx")
        assert arr.flags.writeable
        arr[:] = 7
        assert f.array("blk.1.gpu_idx")[0] == 7
    assert path.read_bytes() == before


def test_in_memory_equals_the_mapping(tmp_path, monkeypatch):
    """in_memory reads the file into anonymous memory: the same bytes, read-only views, no
    mapping of the file (so the writer may replace it); a file too large for the available
    memory stays mapped, with a warning."""
    from powerpy.formats import gguf_reader

    path = tmp_path / "idx.gpuidx"
    arrays = _write_gpuidx(path)
    with read_gguf(path, in_memory=True) as f:
        assert f.in_memory and not f.mapped and mapped_by(path) is None
        for name, want in arrays.items():
            assert np.array_equal(f.array(name), want)
        assert not f.array("blk.0.gpu_idx").flags.writeable
        write_gguf(path, f.typed_kv(), f.tensor_specs())  # not mapped: replacing it is safe
        assert np.array_equal(f.array("blk.1.gpu_idx"), arrays["blk.1.gpu_idx"])
    with read_gguf(path, in_memory=True, writable=True) as f:
        assert f.array("blk.1.gpu_idx").flags.writeable
    monkeypatch.setattr(gguf_reader, "_available_memory", lambda: 100)
    with read_gguf(path, in_memory=True) as f:
        assert f.mapped and not f.in_memory and mapped_by(path) is f
        assert np.array_equal(f.array("blk.0.gpu_bucket"), arrays["blk.0.gpu_bucket"])


def test_tensor_info_and_nbytes():
    t = TensorInfo("w", (64, 3, 2), GGMLType.Q8_0, 8, 96, 408)
    assert t.shape == (2, 3, 64) and t.n_elements == 384 and t.n_rows == 6 and t.row_bytes == 68
    assert tensor_nbytes((64, 3, 2), GGMLType.Q8_0) == 408
    assert tensor_nbytes((256, 2), GGMLType.Q6_K) == 420
    assert tensor_nbytes((0,), GGMLType.I32) == 0
    with pytest.raises(ValueError, match="block size"):
        tensor_nbytes((48,), GGMLType.Q4_0)


# --- powerpy dump ---------------------------------------------------------------------------------
def test_dump_gpuidx(tmp_path, capsys):
    path = tmp_path / "m.generated.gpuidx"
    _write_gpuidx(path)
    assert cli.main(["dump", str(path)]) == 0
    out = capsys.readouterr().out
    for text in ("PWRI", "sparse:      True", "version:     3", "split.vram_capacity", "UINT64"):
        assert text in out
    assert "I32 (18)" in out and "blk.1.gpu_bucket" in out and "[512]" in out and "(512,)" in out
    assert "5472" in out and "352" in out


def test_dump_options_and_errors(tmp_path, capsys):
    path = tmp_path / "tiny.powerinfer.gguf"
    _pwri_model_like(path)
    parser = argparse.ArgumentParser()
    dump_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["dump", str(path), "--kv-only", "--max-items", "2"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "tokenizer.ggml.tokens" in out and "['<s>', '</s>', ...]" in out
    assert "blk.0.fc1.weight" not in out
    assert cli.main(["dump", str(path), "--tensors-only"]) == 0
    out = capsys.readouterr().out
    assert "Q4_0 (2)" in out and "F16 (1)" in out and "(96, 64)" in out and "general." not in out
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<I", 1) + bytes(16))
    assert cli.main(["dump", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "version 1" in err and "bad.gguf" in err


def test_dump_from_a_checkout(tmp_path):
    path = tmp_path / "m.gpuidx"
    _write_gpuidx(path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "powerpy", "dump", str(path), "--tensors-only"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "I32 (18)" in proc.stdout and "blk.0.gpu_idx" in proc.stdout
