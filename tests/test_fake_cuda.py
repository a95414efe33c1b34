"""The CUDA path of the hybrid runtime, checked without a GPU
(docs/architecture.md#split-and-merge).

The accelerator is faked as CUDA (``tests/fake_cuda.py``): device tensors have no data, raise on
any op that mixes devices and on data-dependent host syncs. A hybrid prefill and decode steps
run through the same code as on a real GPU; the tests check that every placed tensor and every
device-side matmul is on the device, that the bytes placed fit the budget, and that the device
part of a decode step makes no host sync (only the planned transfers through the accelerator).
Values are checked on the emulated accelerator (``test_hybrid.py``) and on a real GPU (``-m
cuda``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_cuda import FakeCuda, FakeCudaOps, OpLog
from torch._subclasses.fake_tensor import FakeTensor

from powerpy.api import load
from powerpy.formats.constants import GGMLType
from powerpy.formats.gpuidx import GpuIndex
from powerpy.placement.placement import Placement
from powerpy.placement.runtime import build_hybrid
from powerpy.testing import TinySpec, write_tiny_model

SPEC = TinySpec(n_embd=64, n_layer=2, n_ff=256, n_head=4, n_head_kv=2)
N_CTX = 32
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]
HOT = 100  # hot neurons per layer
MATMUL = ("linear", "mm", "bmm", "matmul", "addmm", "block_rows_sum")


@pytest.fixture(scope="module", params=[GGMLType.F16, GGMLType.Q4_0])
def model_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("fake") / f"m-{request.param.name}.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=request.param)
    return path


def _index() -> GpuIndex:
    rng = np.random.default_rng(1)
    buckets = [np.sort(rng.choice(SPEC.n_ff, HOT, replace=False)) for _ in range(SPEC.n_layer)]
    return GpuIndex.from_buckets(buckets, SPEC.n_ff, vram_capacity=0)


def _budgets(gf) -> dict[str, int]:
    full = Placement.for_model(gf, 1 << 40, n_ctx=N_CTX)
    dense = sum(nb for cat, nb in full.bytes_by_category.items() if cat not in ("kv", "hot_ffn"))
    neuron = full.layers[0].neuron_bytes
    return {
        "everything": full.used + SPEC.n_layer * HOT * neuron,  # dense, KV and every hot row
        "hot-truncated": full.used + 120 * neuron,  # the index is cut to 120 neurons in all
        "mid-dense": dense // 2,  # attention partly on the device, the FFN all on the host
    }


def _hybrid(path, what, *, fused=True):
    llm = load(path, threshold=0.0)
    budget = _budgets(llm.file)[what]
    placement = Placement.for_model(llm.file, budget, _index(), n_ctx=N_CTX, kv_elem_bytes=2)
    accel = FakeCuda()
    accel.fused = fused
    rt = build_hybrid(llm.model, placement, accel, file=llm.file)
    return llm, rt, accel, budget


def _device_tensors(model):
    w = model.weights
    out = {"output": w.output.storage, "output_norm": w.output_norm}
    for l, b in enumerate(w.blk):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "fc1", "fc2"):
            out[f"blk.{l}.{name}"] = getattr(b, name).storage
        out[f"blk.{l}.attn_norm"], out[f"blk.{l}.ffn_norm"] = b.attn_norm, b.ffn_norm
    return out


@pytest.mark.parametrize("what", ["everything", "hot-truncated", "mid-dense"])
def test_placed_bytes_fit_the_budget(model_path, what):
    llm, rt, accel, budget = _hybrid(model_path, what)
    p = rt.placement
    placed = set(p.gpu_tensors)
    for name, t in _device_tensors(rt.model).items():
        gguf = name + ".weight" if not name.startswith("output") else f"{name}.weight"
        on_device = isinstance(t, FakeTensor) and t.device.type == "cuda"
        assert on_device == (gguf in placed), name
    index_bytes = 8 * p.n_hot  # the int64 bucket of each layer: outside the budget
    assert accel.bytes_in == rt.dense_bytes + rt.hot_bytes + index_bytes
    assert rt.dense_bytes + rt.hot_bytes + p.kv_bytes <= budget
    cache = rt.model.new_cache(N_CTX)
    assert isinstance(cache.k, FakeTensor) == p.kv_on_gpu
    # the KV pool: the placed positions, and one scratch row (a padded batch's entries) outside
    # the budget, like the row indexes
    scratch = 2 * SPEC.n_layer * SPEC.n_head_kv * (SPEC.n_embd // SPEC.n_head) * 2
    assert accel.allocated == (p.kv_bytes + scratch if p.kv_on_gpu else 0)
    assert accel.bytes_in + accel.allocated <= budget + index_bytes + scratch
    if what == "everything":
        assert p.n_hot == SPEC.n_layer * HOT and p.kv_on_gpu
    if what == "hot-truncated":
        assert p.n_hot == 120
    if what == "mid-dense":
        assert p.n_hot == 0 and not p.kv_on_gpu and 0 < len(placed)


def _decode_step(model, cache, opts, accel, tok=5) -> OpLog:
    accel.reset_counts()
    log = OpLog()
    with log:
        model.forward(torch.tensor([tok]), cache, opts)
    # every per-step copy went through a pinned buffer (FakeCuda asserts it) and no tensor
    # was copied twice
    assert len({id(t) for t in accel.copied}) == len(accel.copied)
    return log


@pytest.mark.parametrize("what", ["everything", "hot-truncated", "mid-dense"])
def test_prefill_and_decode_run_on_the_device_without_host_syncs(model_path, what):
    """Any host sync on a device tensor (``nonzero``, ``item``) or a cross-device op raises."""
    llm, rt, accel, _ = _hybrid(model_path, what)
    model, n_layer = rt.model, SPEC.n_layer
    cache = model.new_cache(N_CTX)
    with FakeCudaOps():
        logits = model.forward(torch.tensor(PROMPT), cache, llm.options)  # prefill
        assert logits.shape == (1, model.args.n_vocab) and logits.device.type == "cpu"
        _decode_step(model, cache, llm.options, accel, 4)  # builds the decode plan
        for tok in (5, 6, 7):
            log = _decode_step(model, cache, llm.options, accel, tok)
            if what != "mid-dense":
                # the decode plan's device step: out, per layer the cold rows' input and the
                # predictor's mask, then the logits and the counts; in, the embedding row, the
                # position, the pool row and per layer the cold rows' sum; two host functions
                # per layer (submit, wait) and one wait, at the end
                assert accel.n_out == 2 * n_layer + 2, accel.n_out
                assert accel.n_in == n_layer + 3, accel.n_in
                assert accel.waits == 1 and accel.host_calls == 2 * n_layer, accel.waits
            if what == "everything":
                # per layer: q/k/v stacked, output, fc1, fc2 and the stacked hot gate/up rows,
                # then the output matrix; the hot FFN is one activation and one row sum
                assert log.kernels["linear"] == 5 * n_layer + 1, log.kernels
                assert log.kernels["glu"] == log.kernels["block_rows_sum"] == n_layer, log.kernels
                assert not any(dev == "cpu" and op in MATMUL for (op, dev) in log.ops)
            if what == "mid-dense":
                assert log.launches > 0, log.ops
    assert cache.pos == len(PROMPT) + 4


def _launches_per_layer(tmp_path, dtype) -> int:
    """Device launches of one fully placed layer in a decode step: the difference between a
    4-layer and a 2-layer model, halved (what is outside the layers cancels)."""
    counts = []
    for n_layer in (2, 4):
        spec = TinySpec(**{**SPEC.__dict__, "n_layer": n_layer})
        path = tmp_path / f"l{n_layer}-{dtype.name}.powerinfer.gguf"
        write_tiny_model(path, spec, sparse=True, seed=5, dtype=dtype)
        llm = load(path, threshold=0.0)
        full = Placement.for_model(llm.file, 1 << 40, n_ctx=N_CTX)
        index = GpuIndex.from_buckets([np.arange(spec.n_ff)] * n_layer, spec.n_ff, vram_capacity=0)
        placement = Placement.for_model(llm.file, 1 << 40, index, n_ctx=N_CTX)
        assert placement.n_hot == n_layer * spec.n_ff and full.kv_on_gpu
        accel = FakeCuda()
        model = build_hybrid(llm.model, placement, accel, file=llm.file).model
        cache = model.new_cache(N_CTX)
        with FakeCudaOps():
            model.forward(torch.tensor(PROMPT), cache, llm.options)
            _decode_step(model, cache, llm.options, accel)  # builds the plan (its RoPE tables)
            log = _decode_step(model, cache, llm.options, accel)
        # the decode plan's one device step: in, the embedding row, the position and the pool
        # row; out, the logits and the sparsity counts; one wait, for them, and none per layer
        assert model.plans.get(model, llm.options, 1).device is not None
        assert (accel.n_in, accel.n_out, accel.waits) == (3, 2, 1)
        counts.append(log.launches)
    return (counts[1] - counts[0]) // 2


def test_a_fully_placed_layer_takes_few_launches_whatever_its_type(tmp_path):
    """The fused kernels read F16 and Q4_0 blocks alike: one launch per matrix, the same
    count for both, at most 30 per layer (attention, predictor, hot FFN, copies)."""
    f16 = _launches_per_layer(tmp_path, GGMLType.F16)
    q40 = _launches_per_layer(tmp_path, GGMLType.Q4_0)
    assert f16 == q40 <= 30, (f16, q40)


def test_a_host_sync_on_the_device_is_caught(model_path, monkeypatch):
    """The checks are real: the gathered hot pass (``nonzero`` on the device) is refused."""
    llm, rt, accel, _ = _hybrid(model_path, "everything", fused=False)
    accel.gather_hot = True
    cache = rt.model.new_cache(N_CTX)
    with FakeCudaOps():
        rt.model.forward(torch.tensor(PROMPT), cache, llm.options)
        with pytest.raises(Exception, match="nonzero|dynamic|data-dependent"):
            rt.model.forward(torch.tensor([5]), cache, llm.options)


def test_a_cut_runs_on_the_device_without_host_syncs(tmp_path):
    """A model with cuts (powerpy.ffn_down_threshold): the hot rows' cut is a device-side mask,
    so a decode step moves no more than without one."""
    from powerpy.formats.constants import GGUFValueType, Keys

    path = tmp_path / "cut.powerinfer.gguf"
    cut = {
        Keys.FFN_DOWN_THRESHOLD: ([0.05] * SPEC.n_layer, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    }
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=GGMLType.F16, extra_kv=cut)
    llm, rt, accel, _ = _hybrid(path, "everything")
    assert all(
        b.hot.tau is not None and b.hot.tau.device.type == "cuda" for b in rt.model.weights.blk
    )
    cache = rt.model.new_cache(N_CTX)
    with FakeCudaOps():
        rt.model.forward(torch.tensor(PROMPT), cache, llm.options)
        rt.model.forward(torch.tensor([4]), cache, llm.options)  # builds the plan
        accel.reset_counts()
        rt.model.forward(torch.tensor([5]), cache, llm.options)
    assert accel.n_out == 2 * SPEC.n_layer + 2 and accel.n_in == SPEC.n_layer + 3


def test_parallel_sessions_get_the_device_caches_the_placement_reserved(model_path, caplog):
    """A placement for 2 x N_CTX positions (``serve --parallel 2``) holds two device caches;
    a third session's cache stays on the host, with a warning."""
    llm = load(model_path, threshold=0.0)
    placement = Placement.for_model(llm.file, 1 << 40, _index(), n_ctx=2 * N_CTX)
    model = build_hybrid(llm.model, placement, FakeCuda(), file=llm.file).model
    caches = [model.new_cache(N_CTX) for _ in range(3)]
    assert [isinstance(c.k, FakeTensor) for c in caches] == [True, True, False]
    assert "stays on the host" in caplog.text
    del caches[0]  # a finished session gives its positions back
    assert isinstance(model.new_cache(N_CTX).k, FakeTensor)


def test_a_budget_above_free_memory_is_clamped_with_the_reserve(model_path, caplog):
    """``place`` on a device with 8 GiB free: a 100 GiB budget places at most the free memory
    less the modelled workspaces and temporaries, and says so."""
    from powerpy.placement.reserve import DeviceReserve
    from powerpy.placement.runtime import place

    llm = load(model_path, threshold=0.0)
    accel = FakeCuda()
    rt = place(llm.model, llm.file, 100.0, device=accel, n_ctx=N_CTX, disable_gpu_index=True)
    reserve = DeviceReserve.for_model(llm.model.args, N_CTX)
    assert rt.placement.budget == accel.free_memory() - reserve.total
    assert "clamped" in rt.summary() and "cuBLAS workspaces" in rt.summary()
    assert "do not fit" in caplog.text
