"""Hybrid runtime: split/merge equals CPU-only (docs/architecture.md#tests), budgets, the index
lifecycle via the CLI.

Everything runs on the emulated accelerator (``device="cpu"``): the same placement, hot-row
copies, split and merge code as on CUDA. Tests marked ``cuda`` need a GPU.

Tolerance of the CPU comparisons: the tiny model is f32 end to end (the weights' f32 kernels
return f32, so a float64 run is not available), and a hybrid run differs from the CPU-only one
only in how each FFN sum is split and ordered (dense GEMV over hot rows + sparse cold rows vs
one sparse pass). That is f32 rounding, about 1e-6 on logits of magnitude ~3 here, so
``atol = rtol = 1e-4`` leaves a 100x margin while a missing or doubled neuron moves logits by
more than 1e-3 (``test_tolerance_catches_a_broken_merge``). The FFN alone is also checked
against a float64 numpy oracle.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from powerpy.api import load
from powerpy.cli import main
from powerpy.formats.constants import GGMLType
from powerpy.formats.gpuidx import GpuIndex, default_gpuidx_path
from powerpy.formats.stats import save_activation_stats
from powerpy.model import device as device_mod
from powerpy.model import split as split_mod
from powerpy.model.device import Accelerator
from powerpy.model.ffn import ffn_masked
from powerpy.model.gpu_kernels import DeviceQuantWeight
from powerpy.model.split import split_ffn
from powerpy.placement.placement import Placement
from powerpy.placement.runtime import build_hybrid
from powerpy.testing import TinySpec, write_tiny_model

SPEC = TinySpec(n_embd=64, n_layer=2, n_ff=256, n_head=4, n_head_kv=2)
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]  # prefill (T > 1)
DECODE = [119, 111, 114, 108]  # then one token at a time
N_CTX = 32
TOL = {"atol": 1e-4, "rtol": 1e-4}
BUCKETS = ("empty", "full", "random", "single", "interleaved")
HOT_MODES = ("dense", "gated")  # dense: the CUDA default; gated: the emulated device's default

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("hybrid") / "tiny.powerinfer.gguf"
    return path, write_tiny_model(path, SPEC, sparse=True, seed=5)


def run_logits(llm) -> torch.Tensor:
    """Logits of the prefill (all positions) and of each decode step: (12, n_vocab)."""
    cache = llm.model.new_cache(N_CTX, dtype=torch.float32)  # the placements' KV type
    rows = [llm.model.forward(torch.tensor(PROMPT), cache, llm.options, all_logits=True)]
    rows += [llm.model.forward(torch.tensor([t]), cache, llm.options) for t in DECODE]
    return torch.cat(rows)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = load(tiny[0])
    return run_logits(llm), llm.sparsity.active.copy()


def make_buckets(kind: str, n_ff: int = SPEC.n_ff, n_layer: int = SPEC.n_layer):
    rng = np.random.default_rng(7)
    if kind == "empty":
        return [np.zeros(0, np.int64)] * n_layer
    if kind == "full":
        return [np.arange(n_ff)] * n_layer
    if kind == "random":  # a different size per layer; few cold rows left in layer 1
        return [rng.choice(n_ff, size, replace=False) for size in (n_ff // 3, n_ff - 40)]
    if kind == "single":
        return [np.array([3]), np.array([n_ff - 1])]
    if kind == "interleaved":
        return [np.arange(0, n_ff, 2), np.arange(1, n_ff, 2)]
    raise AssertionError(kind)


def index_of(kind: str) -> GpuIndex:
    return GpuIndex.from_buckets(make_buckets(kind), SPEC.n_ff, vram_capacity=0)


def hybrid(
    path, index, budget=1 << 30, *, device="cpu", kv_elem_bytes=4, hot_mode="auto", **load_kw
):
    llm = load(path, **load_kw)
    placement = Placement.for_model(
        llm.file, budget, index, n_ctx=N_CTX, kv_elem_bytes=kv_elem_bytes
    )
    gather = None if hot_mode == "auto" else hot_mode == "gated"
    rt = build_hybrid(llm.model, placement, Accelerator(device, gather_hot=gather), file=llm.file)
    llm.model, llm.runtime = rt.model, rt
    return llm, rt


def dense_bytes(path) -> int:
    """Bytes of every tensor the dense offload pass can place (attention ... output)."""
    by_cat = Placement.for_model(load(path).file, 1 << 40).bytes_by_category
    return sum(nb for cat, nb in by_cat.items() if cat not in ("kv", "hot_ffn"))


# ---------------------------------------------------------------------- hybrid = CPU-only
@pytest.mark.parametrize("hot_mode", HOT_MODES)
@pytest.mark.parametrize("kind", BUCKETS)
def test_hybrid_equals_cpu_only(tiny, reference, kind, hot_mode):
    llm, rt = hybrid(tiny[0], index_of(kind), hot_mode=hot_mode)
    assert rt.accel.gather_hot == (hot_mode == "gated")
    assert llm.model.accel is rt.accel
    assert rt.placement.n_hot == sum(len(b) for b in make_buckets(kind))
    assert rt.placement.kv_on_gpu and llm.model.new_cache(N_CTX).k.dtype == torch.float32
    torch.testing.assert_close(run_logits(llm), reference[0], **TOL)
    assert np.array_equal(llm.sparsity.active, reference[1])  # the same neurons were gated


@pytest.mark.parametrize("hot_mode", HOT_MODES)
def test_hybrid_q4_0_raw_rows(tmp_path, hot_mode):
    """Q4_0 matrices: hot copies are raw quantized rows (QuantWeight.take_rows), not re-encoded.
    The device multiplies them by f32 activations (as a GPU does), so both runs keep exact
    activations (llama.cpp's int8 rounding is a CPU numerics)."""
    from powerpy.model.matrices import QuantWeight

    path = tmp_path / "q4.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=GGMLType.Q4_0)
    ref = load(path, weight_format="raw", exact_activations=True)  # raw blocks, no kernels too
    llm, rt = hybrid(
        path, index_of("random"), hot_mode=hot_mode, weight_format="raw", exact_activations=True
    )
    hot = llm.model.weights.blk[1].hot
    assert isinstance(hot.up, QuantWeight | DeviceQuantWeight)  # the file's blocks either way
    assert hot.up.ggml_type == GGMLType.Q4_0
    src = ref.model.weights.blk[1].ffn_up.raw  # (n_ff, row_bytes) uint8
    assert torch.equal(hot.up.raw, src[torch.from_numpy(np.sort(make_buckets("random")[1]))])
    torch.testing.assert_close(run_logits(llm), run_logits(ref), **TOL)


def test_hybrid_dense_mode_equals_cpu_dense(tiny):
    ref = load(tiny[0], dense=True)
    llm, _ = hybrid(tiny[0], index_of("random"), dense=True)
    torch.testing.assert_close(run_logits(llm), run_logits(ref), **TOL)


def test_tolerance_catches_a_broken_merge(tiny, reference, monkeypatch):
    llm, _ = hybrid(tiny[0], index_of("single"), hot_mode="dense")
    monkeypatch.setattr(
        split_mod, "_hot", lambda hot, x, act, variant, gather, tau: torch.zeros_like(x)
    )
    diff = (run_logits(llm) - reference[0]).abs().max()
    assert diff > 1e-3  # dropping one hot neuron is far outside TOL


@pytest.mark.parametrize("hot_mode", HOT_MODES)
@pytest.mark.parametrize("kind", BUCKETS)
@pytest.mark.parametrize("T", [1, 5])
def test_split_ffn_matches_float64_oracle(tiny, kind, T, hot_mode):
    path, t = tiny
    llm, rt = hybrid(path, index_of(kind), hot_mode=hot_mode)
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, SPEC.n_embd)).astype(np.float32)
    act = rng.random((T, SPEC.n_ff)) < 0.3
    f64 = {k: t[f"blk.0.{k}.weight"].astype(np.float64) for k in ("ffn_gate", "ffn_up")}
    down_t = t["blk.0.ffn_down_t.weight"].astype(np.float64)
    h = np.maximum(x @ f64["ffn_gate"].T, 0) * (x @ f64["ffn_up"].T) * act  # ReGLU (T, n_ff)
    want = h @ down_t
    blk = llm.model.weights.blk[0]
    got = split_ffn(blk, torch.from_numpy(x), torch.from_numpy(act), "reglu", rt.accel)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------- budgets
def budget_cases(path, esize: int, kv_esize: int) -> dict[str, int]:
    """Budgets of 0, inside the dense pass, inside the hot rows (300 neurons), above all."""
    dense = dense_bytes(path)
    kv = 2 * SPEC.n_layer * N_CTX * (SPEC.n_embd // SPEC.n_head * SPEC.n_head_kv) * kv_esize
    neuron = 3 * SPEC.n_embd * esize
    model_bytes = dense + SPEC.n_layer * SPEC.n_ff * neuron
    return {
        "zero": 0,
        "mid-dense": dense // 2,  # the offload pass stops inside the attention level
        "mid-hot": dense + kv + 300 * neuron,  # the full index is truncated to 300 neurons
        "more-than-model": 2 * (model_bytes + kv),
    }


def test_hybrid_budgets(tiny, reference):
    for what, budget in budget_cases(tiny[0], 4, 4).items():
        llm, rt = hybrid(tiny[0], index_of("full"), budget)
        p = rt.placement
        assert rt.device_bytes <= budget and p.used <= budget, what
        assert p.n_hot == {"zero": 0, "mid-dense": 0, "mid-hot": 300}.get(what, 512), what
        assert p.kv_on_gpu == (what in ("mid-hot", "more-than-model")), what
        torch.testing.assert_close(run_logits(llm), reference[0], **TOL, msg=what)


def test_loaded_bigger_than_file(tmp_path):
    """An F16 file loaded as f32: dense tensors stay on the host, hot rows are refused."""
    path = tmp_path / "f16.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, dtype=GGMLType.F16)
    with pytest.raises(ValueError, match="weight_format"):
        hybrid(path, index_of("full"), weight_format="f32")
    llm, rt = hybrid(path, None, weight_format="f32")
    assert rt.skipped and not any("norm" in name for name in rt.skipped)
    assert rt.dense_bytes == (2 * SPEC.n_layer + 1) * SPEC.n_embd * 4  # only the f32 norms moved
    assert "left on the host" in rt.summary()


def test_build_twice_is_refused(tiny):
    llm, rt = hybrid(tiny[0], index_of("single"))
    with pytest.raises(ValueError, match="already hybrid"):
        build_hybrid(llm.model, rt.placement, "cpu")


def test_summary_reports_device_and_host_bytes(tiny):
    _, rt = hybrid(tiny[0], index_of("interleaved"))
    text = rt.summary()
    assert "emulated accelerator" in text and "hot_ffn" in text and "file data" in text
    # f32 file: dense matrices stay mapped; the emulated hot copies are anonymous host bytes
    assert rt.host_anon_bytes >= rt.hot_bytes == rt.placement.hot_bytes > 0


def test_load_api_greedy_text_matches(tiny):
    ref = load(tiny[0]).generate(PROMPT, max_tokens=6, temperature=0)
    llm = load(tiny[0], vram_budget=1.0, device="cpu")  # no activation/: dense parts only
    assert llm.runtime is not None and llm.runtime.placement.n_hot == 0
    assert llm.generate(PROMPT, max_tokens=6, temperature=0) == ref


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_no_cuda_runs_cpu_only(tiny, monkeypatch, caplog):
    monkeypatch.setattr(device_mod, "_said_no_cuda", False)
    with caplog.at_level(logging.WARNING):
        llm = load(tiny[0], vram_budget=1.0)
        assert Accelerator.choose(None) is None  # said once only
    assert llm.runtime is None and caplog.text.count(device_mod.NO_CUDA_MESSAGE) == 1


# ------------------------------------------------------------------ CLI index lifecycle
CLI_SPEC = TinySpec(n_embd=64, n_layer=2, n_ff=512, n_head=4, n_head_kv=2)
NEURON = 3 * CLI_SPEC.n_embd * 4  # f32 rows


@pytest.fixture
def cli_model(tmp_path) -> Path:
    path = tmp_path / "m.powerinfer.gguf"
    write_tiny_model(path, CLI_SPEC, sparse=True, seed=2)
    rng = np.random.default_rng(0)
    stats = [rng.pareto(1.0, CLI_SPEC.n_ff).astype(np.float32) for _ in range(CLI_SPEC.n_layer)]
    save_activation_stats(tmp_path / "activation", stats)
    return path


def infer(path: Path, budget_bytes: int, *extra: str) -> int:
    args = ["infer", "-m", str(path), "--vram-budget", repr(budget_bytes / (1 << 30))]
    args += ["--accel-device", "cpu", "-n", "2", "--temp", "0", "-p", "Hi", "-c", "64", *extra]
    return main(args)


def cli_budget(path: Path, neurons: int) -> int:
    """A budget leaving room for ``neurons`` hot neurons after the dense parts and KV."""
    llm = load(path)
    p = Placement.for_model(llm.file, 1 << 30, n_ctx=64)
    return p.used + neurons * NEURON + NEURON // 2


def test_cli_index_lifecycle(cli_model, caplog, capsys):
    idx = default_gpuidx_path(cli_model)
    small, big = cli_budget(cli_model, 300), cli_budget(cli_model, 700)
    with caplog.at_level(logging.INFO):
        assert infer(cli_model, small) == 0
    err = capsys.readouterr().err
    assert "placement on cpu (emulated accelerator)" in err and "GPU % of neurons" in err
    assert "256/1024 neurons" in err  # one group of 256 fits in 300
    first = idx.read_bytes()
    cap_small = GpuIndex.read(idx).vram_capacity

    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert infer(cli_model, small) == 0  # same budget: reused
        assert infer(cli_model, big) == 0  # bigger budget: still reused, with a hint
    assert idx.read_bytes() == first and "--reset-gpu-index" in caplog.text

    assert infer(cli_model, big, "--reset-gpu-index") == 0  # regenerated for the bigger R
    assert GpuIndex.read(idx).vram_capacity > cap_small
    assert "512/1024 neurons" in capsys.readouterr().err

    assert infer(cli_model, small) == 0  # the index is now too big for R: regenerated
    assert GpuIndex.read(idx).vram_capacity == cap_small and idx.read_bytes() == first


def test_cli_disable_and_missing_activation(cli_model, caplog, capsys):
    idx = default_gpuidx_path(cli_model)
    assert infer(cli_model, cli_budget(cli_model, 600), "--disable-gpu-index") == 0
    assert not idx.exists() and "0/1024 neurons" in capsys.readouterr().err
    for f in (cli_model.parent / "activation").iterdir():
        f.unlink()
    (cli_model.parent / "activation").rmdir()
    with caplog.at_level(logging.INFO):
        assert infer(cli_model, cli_budget(cli_model, 600)) == 0  # logged, not fatal
    assert "activation directory" in caplog.text and not idx.exists()
    assert "0/1024 neurons" in capsys.readouterr().err


def test_cli_ngl_refused_for_pwri(cli_model, capsys):
    assert main(["infer", "-m", str(cli_model), "-ngl", "1", "-n", "1"]) == 1
    assert "--vram-budget" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@cuda
def test_cuda_matches_cpu_within_fp16_tolerance(tmp_path):
    """F16 weights; threshold -1e30 so fp16 rounding cannot flip a predictor decision."""
    path = tmp_path / "f16.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=GGMLType.F16)
    ref = load(path, threshold=-1e30)
    llm, rt = hybrid(path, index_of("random"), device="cuda", kv_elem_bytes=2, threshold=-1e30)
    assert rt.device.type == "cuda" and rt.placement.kv_on_gpu
    want, got = run_logits(ref), run_logits(llm)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.cuda
@cuda
def test_cuda_budgets_cross_device(tmp_path):
    """Partial placements move activations between devices (attention half on the GPU, KV on
    the host, ...): each budget must still match the CPU within fp16 tolerance."""
    path = tmp_path / "f16.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=GGMLType.F16)
    want = run_logits(load(path, threshold=-1e30))
    for what, budget in budget_cases(path, 2, 2).items():
        llm, rt = hybrid(
            path, index_of("full"), budget, device="cuda", kv_elem_bytes=2, threshold=-1e30
        )
        assert rt.device_bytes <= budget, what
        torch.testing.assert_close(run_logits(llm), want, atol=3e-2, rtol=3e-2, msg=what)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("hot_mode", HOT_MODES)
@pytest.mark.parametrize("kind", ["random", "interleaved"])
def test_cuda_split_ffn_with_fixed_mask(tmp_path, kind, hot_mode):
    path = tmp_path / "f16.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=GGMLType.F16)
    ref = load(path)
    llm, rt = hybrid(path, index_of(kind), device="cuda", hot_mode=hot_mode)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((3, SPEC.n_embd)).astype(np.float32))
    act = torch.from_numpy(rng.random((3, SPEC.n_ff)) < 0.3)
    blk = ref.model.weights.blk[0]
    want = ffn_masked(x, blk.ffn_gate, blk.ffn_up, blk.ffn_down_t, "reglu", act)
    got = split_ffn(llm.model.weights.blk[0], x.cuda(), act.cuda(), "reglu", rt.accel)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.cuda
@cuda
def test_cuda_memory_within_budget(tmp_path):
    """Peak allocation <= budget + the row indexes (16 B per hot neuron, outside the budget
    like upstream's gpu_bucket) + 8 MiB for activations and caching-allocator rounding of this
    tiny model. cuBLAS allocates its workspace per stream on first use: both streams use it
    before the baseline is read (``DeviceReserve`` budgets it in real placements)."""
    path = tmp_path / "f16.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=GGMLType.F16)
    accel = Accelerator.choose("cuda")
    a = torch.ones(64, 64, device=accel.device)
    a @ a
    with accel.side_stream():
        a @ a
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    dense = dense_bytes(path)
    budget = dense + 2 * SPEC.n_layer * N_CTX * 32 * 2 + 200 * 3 * SPEC.n_embd * 2
    llm, rt = hybrid(path, index_of("full"), budget, device="cuda", kv_elem_bytes=2)
    assert rt.placement.n_hot == 200 and rt.placement.kv_on_gpu
    cache = llm.model.new_cache(N_CTX)  # the placement's f16 cache
    llm.model.forward(torch.tensor(PROMPT), cache, llm.options)
    for t in DECODE:
        llm.model.forward(torch.tensor([t]), cache, llm.options)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= budget + rt.index_bytes + (8 << 20), (peak, budget)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [GGMLType.Q4_0, GGMLType.Q8_0])
def test_cuda_quantized_hybrid_agrees_with_the_cpu(tmp_path, dtype):
    """Quantized placed rows run in the fused kernels (f32 activations): compared with the CPU
    run with exact activations, the logits agree closely and pick the same top token."""
    path = tmp_path / f"{dtype.name}.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=dtype)
    want = run_logits(load(path, threshold=-1e30, exact_activations=True))
    llm, rt = hybrid(
        path, index_of("random"), device="cuda", threshold=-1e30, exact_activations=True
    )
    assert rt.accel.fused and rt.model.weights.blk[0].hot.gate_up is not None
    got = run_logits(llm)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("defer", [False, True])
def test_cuda_hybrid_step_served_replay_equals_eager(tmp_path, defer):
    """The hybrid decode step on CUDA: replayed as a graph, its cold tasks served by the
    calling thread (``pp_worker_serve``), it equals the same step run eagerly with a worker
    thread; deferred too (``defer_cold``)."""
    import dataclasses

    path = tmp_path / "f16.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=GGMLType.F16)
    llm, rt = hybrid(path, index_of("random"), device="cuda", kv_elem_bytes=2, threshold=-1e30)
    model, opts = llm.model, dataclasses.replace(llm.options, defer_cold=defer)

    def decode(o):
        cache = model.new_cache(N_CTX)
        rows = [model.forward(torch.tensor(PROMPT), cache, o)]
        rows += [model.forward(torch.tensor([t]), cache, o) for t in DECODE]
        return torch.cat(rows)

    got = decode(opts)
    step = model.plans.get(model, model._options(opts), 1).device
    assert step is not None and step.graph is not None, step and step.reason
    assert step.cold.served and step.deferred is defer and step.serve_s > 0
    eager_opts = dataclasses.replace(opts, graphs=False)
    want = decode(eager_opts)
    assert not model.plans.get(model, model._options(eager_opts), 1).device.cold.served
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
