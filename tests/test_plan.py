"""The decode plan (``powerpy.model.plan``): a fully placed model's decode step as one device
function of fixed buffers, captured once and replayed.

Without a GPU the step is checked two ways:

- **values**, on the emulated accelerator (``Accelerator("cpu")``, which runs the fused ops'
  torch versions, as CUDA runs their Triton ones): the replayed graph (``graphs.EmulatedStepGraph``:
  the capture's ops run again into the same tensors) equals the eager step bit for bit, and the
  hybrid equals the CPU-only model. A step with a value frozen in Python at capture would replay
  stale (``test_the_emulation_catches_a_position_frozen_in_python``);
- **capture safety**, on fake CUDA (``tests/fake_cuda.py``): two decode steps run the same ops,
  with the same arguments, on the same memory (``StepTrace``), with no op on the host, no host
  sync (fake tensors raise on one) and one wait per step, for the logits.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import tool_modules
import torch
from fake_cuda import FakeCuda, FakeCudaOps, StepTrace
from moe_files import GLM

from powerpy.api import load
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys
from powerpy.formats.gpuidx import GpuIndex
from powerpy.model import plan as plan_mod
from powerpy.model.device import Accelerator
from powerpy.model.graphs import EmulatedStepGraph
from powerpy.model.options import SPARSE, RunOptions
from powerpy.model.step import Step
from powerpy.placement.placement import Placement
from powerpy.placement.runtime import build_hybrid
from powerpy.testing import TinySpec, write_tiny_model

SPEC = TinySpec(n_embd=64, n_layer=2, n_ff=256, n_head=4, n_head_kv=2)
PROMPT = [1, 72, 101, 108, 108, 111]
STEPS = [119, 111, 114, 108, 100, 33]
N_CTX = 32
CUT = {Keys.FFN_DOWN_THRESHOLD: ([0.05] * SPEC.n_layer, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)}


@pytest.fixture(scope="module", params=["f16", "q4_0", "f16-cut"])
def model_path(request, tmp_path_factory):
    dtype = GGMLType.Q4_0 if request.param == "q4_0" else GGMLType.F16
    path = tmp_path_factory.mktemp("plan") / f"{request.param}.powerinfer.gguf"
    extra = CUT if request.param.endswith("cut") else None
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=dtype, extra_kv=extra)
    return path


def placed(path, accel, kv_elem_bytes=2, **load_kw):
    """The model with every layer fully placed on ``accel`` (an index of every neuron)."""
    llm = load(path, threshold=0.0, **load_kw)
    index = GpuIndex.from_buckets([np.arange(SPEC.n_ff)] * SPEC.n_layer, SPEC.n_ff, vram_capacity=0)
    placement = Placement.for_model(
        llm.file, 1 << 40, index, n_ctx=8 * N_CTX, kv_elem_bytes=kv_elem_bytes
    )
    rt = build_hybrid(llm.model, placement, accel, file=llm.file)
    return llm, rt.model


def decode(model, opts, steps=STEPS, dtype=None):
    """Logits of the prompt's last position and of each decode step (teacher forced)."""
    cache = model.new_cache(N_CTX, dtype=dtype)
    rows = [model.forward(torch.tensor(PROMPT), cache, opts)]
    rows += [model.forward(torch.tensor([t]), cache, opts) for t in steps]
    return torch.cat(rows)


@pytest.mark.parametrize("sparse", [True, False])
def test_a_fully_placed_step_replays_its_eager_run_bit_for_bit(model_path, sparse):
    llm, model = placed(model_path, Accelerator("cpu"), kv_elem_bytes=4)
    opts = RunOptions(sparse=sparse, stats=llm.options.stats, threshold=0.0)
    got = decode(model, opts)
    step = model.plans.get(model, opts, 1).device
    assert step is not None and isinstance(step.graph, EmulatedStepGraph), step and step.reason
    eager = decode(model, dataclasses.replace(opts, graphs=False))  # the same step, eagerly
    assert model.plans.get(model, dataclasses.replace(opts, graphs=False), 1).device.graph is None
    assert torch.equal(got, eager)
    # the hybrid is the CPU-only model, up to f32 rounding (both keep f32 activations and an f32
    # cache, whose f16 rounding would turn a last-bit difference into a visible one)
    cpu = load(model_path, threshold=0.0, exact_activations=True)
    exact = RunOptions(sparse=sparse, threshold=0.0, numerics=cpu.options.numerics)
    ref = decode(cpu.model, exact, dtype=torch.float32)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_the_sparsity_counts_come_from_the_device(model_path):
    """The plan counts each layer's predicted (and not cut) neurons on the device, and they
    arrive with the logits: the CPU-only model's counts (both with f32 activations)."""
    llm, model = placed(model_path, Accelerator("cpu"), kv_elem_bytes=4)
    decode(model, llm.options)
    cpu = load(model_path, threshold=0.0, exact_activations=True)
    decode(cpu.model, cpu.options, dtype=torch.float32)
    assert np.array_equal(llm.sparsity.tokens, cpu.sparsity.tokens)
    assert np.array_equal(llm.sparsity.active, cpu.sparsity.active)


def test_the_emulation_catches_a_position_frozen_in_python(model_path, monkeypatch):
    """The check has teeth: a step whose position came from Python (the caches' ints, not the
    plan's buffer) replays the position it was captured with, and its logits stop matching."""
    llm, model = placed(model_path, Accelerator("cpu"))

    def frozen(self, accel):  # positions made in Python at capture
        pos = torch.tensor([c.pos for c in self.caches])
        return pos, torch.tensor([c.base for c in self.caches])

    want = decode(model, llm.options)
    _, bad = placed(model_path, Accelerator("cpu"))
    monkeypatch.setattr(Step, "rows", frozen)
    got = decode(bad, llm.options)
    assert torch.equal(got[:1], want[:1])  # the prompt (no plan)
    assert all(not torch.equal(got[i], want[i]) for i in range(2, len(want)))  # stale replays


def test_batches_pad_to_their_bucket(model_path):
    """Three sessions decode in the plan of 4 (one padded entry on the pool's scratch row): each
    session's logits are its own single steps', and the sessions go on unharmed."""
    llm, model = placed(model_path, Accelerator("cpu"))
    prompts = [PROMPT, PROMPT[:3], [1, 33, 34, 35, 36]]
    caches = [model.new_cache(N_CTX) for _ in prompts]
    for p, c in zip(prompts, caches, strict=True):
        model.forward(torch.tensor(p), c, llm.options)
    solo = [model.new_cache(N_CTX) for _ in prompts]
    for p, c in zip(prompts, solo, strict=True):
        model.forward(torch.tensor(p), c, llm.options)
    for toks in ([5, 6, 7], [8, 9, 10]):
        got = model.decode_batch(torch.tensor(toks), caches, llm.options)
        want = torch.cat(
            [
                model.forward(torch.tensor([t]), c, llm.options)
                for t, c in zip(toks, solo, strict=True)
            ]
        )
        # one product of 4 rows against 1 row at a time: f32 rounding (the cut amplifies it)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert model.plans.get(model, llm.options, 3).batch == 4
    assert model.plans.get(model, llm.options, 3).device.graph is not None
    assert [c.pos for c in caches] == [len(p) + 2 for p in prompts]


def test_a_step_that_cannot_be_captured_warns_and_runs_eagerly(model_path, caplog):
    """The gathered hot rows (``nonzero``: a host sync; taken without the fused ops) cannot be
    captured: one warning names the reason, and the step runs the same function eagerly, with
    the same values."""
    llm, model = placed(model_path, Accelerator("cpu", gather_hot=True, fused=False))
    with caplog.at_level(logging.WARNING, logger="powerpy.model.plan"):
        got = decode(model, llm.options)
    assert caplog.text.count("no emulated graph (nonzero makes the host wait") == 1
    assert model.plans.get(model, llm.options, 1).device.graph is None
    assert torch.equal(got, decode(model, dataclasses.replace(llm.options, graphs=False)))


def test_a_partial_placement_keeps_the_per_layer_path(model_path):
    """Attention partly placed and the KV cache on the host: not one device step; the plan
    says why and the layer loop runs."""
    llm = load(model_path, threshold=0.0)
    full = Placement.for_model(llm.file, 1 << 40, n_ctx=N_CTX)
    dense = sum(nb for cat, nb in full.bytes_by_category.items() if cat not in ("kv", "hot_ffn"))
    placement = Placement.for_model(llm.file, dense // 2, n_ctx=N_CTX)
    model = build_hybrid(llm.model, placement, Accelerator("cpu"), file=llm.file).model
    decode(model, llm.options, STEPS[:2])
    plan = model.plans.get(model, llm.options, 1)
    assert plan.device is None and plan.refusal == "the KV cache stays on the host"
    assert plan_mod.device_refusal(llm.model) == "no accelerator"


def test_two_fake_cuda_steps_run_the_same_ops_on_the_same_memory(model_path):
    """Capture safety: decode steps 2 and 3 of the plan on fake CUDA trace the same ops, with
    the same arguments, on the same memory; no op runs on the host inside the step, nothing
    syncs, and each step waits once (for its logits and counts), through fixed buffers."""
    llm, model = placed(model_path, FakeCuda())
    accel = model.accel
    cache = model.new_cache(N_CTX)
    traces: list[StepTrace] = []
    with FakeCudaOps():
        model.forward(torch.tensor(PROMPT), cache, llm.options)
        model.forward(torch.tensor([STEPS[0]]), cache, llm.options)  # builds the plan
        step = model.plans.get(model, llm.options, 1).device
        assert step is not None and step.reason == "this device replays no graphs"
        body = step.body

        def traced():
            with StepTrace() as t:
                body()
            traces.append(t)

        step.body = traced
        for tok in STEPS[1:3]:
            accel.reset_counts()
            model.forward(torch.tensor([tok]), cache, llm.options)
            assert (accel.n_in, accel.n_out, accel.waits) == (3, 2, 1)
    assert len(traces) == 2 and len(traces[0].ops) > 10
    assert traces[0].ops == traces[1].ops
    assert traces[0].host_ops == [] == traces[1].host_ops


HYBRID = {"attention only": 0, "a third hot": SPEC.n_ff // 3, "most hot": SPEC.n_ff - 40}


def placed_hybrid(path, accel, hot: int, **load_kw):
    """Attention, predictors, the KV pool and the output placed, ``hot`` FFN rows per layer
    (the rest on the host)."""
    llm = load(path, threshold=0.0, **load_kw)
    rng = np.random.default_rng(hot)
    buckets = [np.sort(rng.choice(SPEC.n_ff, hot, replace=False)) for _ in range(SPEC.n_layer)]
    index = GpuIndex.from_buckets(buckets, SPEC.n_ff, vram_capacity=0)
    placement = Placement.for_model(llm.file, 1 << 40, index, n_ctx=8 * N_CTX, kv_elem_bytes=4)
    return llm, build_hybrid(llm.model, placement, accel, file=llm.file).model


@pytest.mark.parametrize("budget", HYBRID)
def test_a_hybrid_step_is_one_replay_with_its_host_tasks(model_path, budget):
    """A layer with FFN rows on the host is in the device step too: its cold rows are a task
    the stream submits and waits for (host functions, replayed with the graph). The replay
    equals the eager step bit for bit, and the CPU-only model up to f32 rounding."""
    llm, model = placed_hybrid(
        model_path, Accelerator("cpu"), HYBRID[budget], exact_activations=True
    )
    opts = RunOptions(threshold=0.0, stats=llm.options.stats, numerics=llm.options.numerics)
    got = decode(model, opts)
    step = model.plans.get(model, opts, 1).device
    assert isinstance(step.graph, EmulatedStepGraph) and set(step.cold.layers) == {0, 1}
    hosted = [op for op, *_ in step.graph.ops if op.__name__ == "host_call.default"]
    assert len(hosted) == 2 * SPEC.n_layer  # submit and wait per layer, replayed each token
    assert torch.equal(got, decode(model, dataclasses.replace(opts, graphs=False)))
    cpu = load(model_path, threshold=0.0, exact_activations=True)
    exact = RunOptions(threshold=0.0, numerics=cpu.options.numerics)
    ref = decode(cpu.model, exact, dtype=torch.float32)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_a_hybrid_batch_pads_to_its_bucket(model_path):
    llm, model = placed_hybrid(model_path, Accelerator("cpu"), SPEC.n_ff // 3)
    caches = [model.new_cache(N_CTX) for _ in range(3)]
    solo = [model.new_cache(N_CTX) for _ in range(3)]
    for cs in (caches, solo):
        for i, c in enumerate(cs):
            model.forward(torch.tensor(PROMPT[: 3 + i]), c, llm.options)
    got = model.decode_batch(torch.tensor([5, 6, 7]), caches, llm.options)
    want = torch.cat(
        [
            model.forward(torch.tensor([t]), c, llm.options)
            for t, c in zip([5, 6, 7], solo, strict=True)
        ]
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert model.plans.get(model, llm.options, 3).device.cold.layers[0].task.T == 3


@pytest.mark.parametrize("defer", [False, True])
def test_two_fake_cuda_hybrid_steps_trace_alike(model_path, defer):
    """Capture safety of a hybrid step (its cold rows deferred or not): the same ops on the
    same memory in steps 2 and 3, nothing on the host inside the step, two host functions and
    three copies (the input and the mask out, the cold sum in) per layer, one wait per step."""
    llm, model = placed_hybrid(model_path, FakeCuda(), SPEC.n_ff // 3)
    accel = model.accel
    cache = model.new_cache(N_CTX)
    opts = dataclasses.replace(llm.options, defer_cold=defer)
    traces: list[StepTrace] = []
    with FakeCudaOps():
        model.forward(torch.tensor(PROMPT), cache, opts)
        model.forward(torch.tensor([STEPS[0]]), cache, opts)
        step = model.plans.get(model, opts, 1).device
        assert step.deferred is defer
        body = step.body

        def traced():
            with StepTrace() as t:
                body()
            traces.append(t)

        step.body = traced
        for tok in STEPS[1:3]:
            accel.reset_counts()
            model.forward(torch.tensor([tok]), cache, opts)
            n = SPEC.n_layer
            assert (accel.n_in, accel.n_out, accel.waits) == (3 + n, 2 + 2 * n, 1)
            assert accel.host_calls == 2 * n
    assert traces[0].ops == traces[1].ops and traces[0].host_ops == []


# ------------------------------------------------------------------- a mixture of experts
MOE_SPECS = {
    "qwen3moe": TinySpec(
        arch="qwen3moe",
        n_embd=64,
        n_layer=2,
        n_ff=64,
        n_head=4,
        n_head_kv=2,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=64,
    ),
    "glm4moe": GLM,
}
MOE_BUDGETS = {"router only": 0.0, "a third hot": 1 / 3, "most hot": 0.8, "all hot": 1.0}


@pytest.fixture(scope="module", params=list(MOE_SPECS))
def moe_path(request, tmp_path_factory):
    from moe_files import write_gguf_py

    path = tmp_path_factory.mktemp("plan-moe") / f"{request.param}.gguf"
    write_gguf_py(path, MOE_SPECS[request.param], GGMLType.Q8_0, seed=4)
    return request.param, path


def placed_moe(path, spec, accel, share: float, **load_kw):
    """Attention, routers, shared experts, leading dense layers and the KV pool placed, and
    ``share`` of each layer's expert neurons (the rest on the host)."""
    llm = load(path, **load_kw)
    n = spec.n_expert * spec.n_ff_exp
    rng = np.random.default_rng(7)
    buckets = [np.sort(rng.choice(n, round(share * n), replace=False)) for _ in range(spec.n_layer)]
    index = GpuIndex.from_buckets(buckets, n, vram_capacity=0)
    placement = Placement.for_model(llm.file, 1 << 40, index, n_ctx=8 * N_CTX, kv_elem_bytes=4)
    return llm, build_hybrid(llm.model, placement, accel, file=llm.file).model


def _moe_hosted(model) -> set[int]:
    return {
        l
        for l, b in enumerate(model.weights.blk)
        if b.moe is not None and (b.moe.hot is None or b.moe.hot.n_cold)
    }


@pytest.mark.parametrize("budget", MOE_BUDGETS)
def test_a_mixtures_step_is_one_replay_with_its_host_tasks(moe_path, budget):
    """A mixture's layer is in the device step: the router on the device, its choice copied
    out with the input, the routed experts' cold neurons a host task, the hot ones on the
    device. The replay equals the eager step bit for bit, and the CPU-only model up to f32
    rounding; the sparsity counts are the CPU-only model's."""
    arch, path = moe_path
    spec = MOE_SPECS[arch]
    llm, model = placed_moe(
        path, spec, Accelerator("cpu"), MOE_BUDGETS[budget], exact_activations=True
    )
    assert plan_mod.device_refusal(model) is None
    opts = llm.options  # (its statistics and numerics)
    got = decode(model, opts)
    counted = opts.stats.active.copy()
    step = model.plans.get(model, model._options(opts), 1).device  # (a mixture is not gated)
    assert isinstance(step.graph, EmulatedStepGraph)
    hosted = _moe_hosted(model)
    assert (set(step.cold.layers) if step.cold else set()) == hosted
    calls = [op for op, *_ in step.graph.ops if op.__name__ == "host_call.default"]
    assert len(calls) == 2 * len(hosted)
    assert torch.equal(got, decode(model, dataclasses.replace(opts, graphs=False)))
    cpu = load(path, exact_activations=True)
    ref = decode(cpu.model, cpu.options, dtype=torch.float32)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-4)  # (Q8_0 rows in f32 on the device)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert np.array_equal(counted, cpu.options.stats.active)


def test_the_mixtures_cold_task_is_the_host_paths_sum(moe_path):
    """One layer's task, run on the calling thread, against ``moe_host.experts_host`` with
    the cold mask (the eager hybrid's host part) in the same numerics: the same bits."""
    from powerpy.model import moe_host, numerics
    from powerpy.model.host_tasks import ColdTasks

    arch, path = moe_path
    spec = MOE_SPECS[arch]
    llm, model = placed_moe(path, spec, Accelerator("cpu"), 1 / 3)
    opts = RunOptions(numerics=llm.options.numerics)
    with numerics.using(opts.numerics):
        tasks = ColdTasks(model, opts, 4)
        for l, c in tasks.layers.items():
            ex = model.weights.blk[l].moe
            g = torch.Generator().manual_seed(l)
            x = torch.randn(3, spec.n_embd, generator=g)
            ids = torch.stack([torch.randperm(spec.n_expert, generator=g)[:2] for _ in range(3)])
            w = torch.rand(3, 2, generator=g)
            c.x[:3].copy_(x)
            c.ids[:3].copy_(ids)
            c.wts[:3].copy_(w)
            c.task.T = 3
            assert tasks.lib.cdll.pp_cold_run(c.ptr) == 0
            for i in range(3):  # the host path one token at a time (a batch groups by expert)
                one = (x[i : i + 1], ids[i : i + 1], w[i : i + 1])
                want, kept = moe_host.experts_host(l, ex, *one, ex.tau, opts, ex.hot.cold)
                assert torch.equal(c.y[i], want[0]) and int(c.kept[i]) == int(kept[0])


def test_two_fake_cuda_mixture_steps_trace_alike(moe_path):
    """Capture safety of a mixture's hybrid step: the same ops on the same memory in steps 2
    and 3, nothing on the host inside, two host functions a hosted layer, one wait a step."""
    arch, path = moe_path
    llm, model = placed_moe(path, MOE_SPECS[arch], FakeCuda(), 1 / 3)
    accel = model.accel
    cache = model.new_cache(N_CTX)
    traces: list[StepTrace] = []
    with FakeCudaOps():
        model.forward(torch.tensor(PROMPT), cache, llm.options)
        model.forward(torch.tensor([STEPS[0]]), cache, llm.options)
        step = model.plans.get(model, model._options(llm.options), 1).device
        assert step is not None, plan_mod.device_refusal(model)
        body = step.body

        def traced():
            with StepTrace() as t:
                body()
            traces.append(t)

        step.body = traced
        for tok in STEPS[1:3]:
            accel.reset_counts()
            model.forward(torch.tensor([tok]), cache, llm.options)
            assert accel.waits == 1 and accel.host_calls == 2 * len(_moe_hosted(model))
    assert traces[0].ops == traces[1].ops and traces[0].host_ops == []


# ------------------------------------------------------------------- deferred cold rows
def deferred_reference(model, opts, monkeypatch, steps=STEPS):
    """What ``RunOptions.defer_cold`` computes, by the per-layer path (no plan): the prompt
    as usual; then each decode step's hot/cold splits (``split.run_split``, the FFN's and a
    mixture's) return their hot part alone, and each cold part joins the residual stream after
    the next layer's block, or before the head after the last."""
    from powerpy.model import moe, split
    from powerpy.model.transformer import Model

    run_split, block, head = split.run_split, Model._block, Model.head
    on, layer, pending = [False], [0], []

    def deferring_split(accel, x, sel, hot, cold, o=SPARSE, *, keep=()):
        if not on[0]:
            return run_split(accel, x, sel, hot, cold, o, keep=keep)

        def stash(x_host, sel_host):
            pending.append((layer[0], cold(x_host, sel_host)))
            return torch.zeros_like(pending[-1][1])

        return run_split(accel, x, sel, hot, stash, o, keep=keep)

    def deferring_block(self, l, *args, **kw):
        layer[0] = l
        y = block(self, l, *args, **kw)
        while on[0] and pending and pending[0][0] < l:
            y = y + pending.pop(0)[1].to(y.device)
        return y

    def deferring_head(self, x, o):
        while pending:
            x = x + pending.pop(0)[1].to(x.device)
        return head(self, x, o)

    monkeypatch.setattr(split, "run_split", deferring_split)
    monkeypatch.setattr(moe, "run_split", deferring_split)
    monkeypatch.setattr(Model, "_block", deferring_block)
    monkeypatch.setattr(Model, "head", deferring_head)
    monkeypatch.setattr(model.plans, "get", lambda *a: None)  # the per-layer path
    cache = model.new_cache(N_CTX)
    rows = [model.forward(torch.tensor(PROMPT), cache, opts)]
    on[0] = True
    rows += [model.forward(torch.tensor([t]), cache, opts) for t in steps]
    monkeypatch.undo()
    return torch.cat(rows)


@pytest.mark.parametrize("budget", ["attention only", "a third hot"])
def test_deferred_cold_rows_join_the_stream_a_layer_late(model_path, budget, monkeypatch):
    """``defer_cold``: the replay equals its eager run bit for bit and the deferred
    computation done by the per-layer path up to f32 rounding, and it is not the undeferred
    step (the check could fail): each layer's task is waited for after the next layer."""
    llm, model = placed_hybrid(
        model_path, Accelerator("cpu"), HYBRID[budget], exact_activations=True
    )
    base = RunOptions(threshold=0.0, numerics=llm.options.numerics)
    opts = dataclasses.replace(base, defer_cold=True)
    got = decode(model, opts)
    step = model.plans.get(model, opts, 1).device
    assert step.deferred and isinstance(step.graph, EmulatedStepGraph)
    calls = [args[1:3] for op, args, *_ in step.graph.ops if op.__name__ == "host_call.default"]
    c0, c1 = step.cold.layers[0].ptr, step.cold.layers[1].ptr
    sub, wait = step.cold.submit, step.cold.wait
    assert calls == [(sub, c0), (sub, c1), (wait, c0), (wait, c1)]  # layer 1 submitted first
    assert torch.equal(got, decode(model, dataclasses.replace(opts, graphs=False)))
    ref = deferred_reference(model, base, monkeypatch)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    undeferred = decode(model, base)
    assert (got - undeferred)[1:].abs().max() > 100 * 1e-4  # the prompt's row is not deferred
    assert torch.equal(got[0], undeferred[0])


def test_a_mixtures_deferred_step_and_its_counts(moe_path, monkeypatch):
    """A mixture's routed cold neurons deferred: the per-layer path's deferred computation,
    with the same sparsity counts (the host's neurons counted when their task is waited for)."""
    arch, path = moe_path
    spec = MOE_SPECS[arch]
    llm, model = placed_moe(path, spec, Accelerator("cpu"), 1 / 3, exact_activations=True)
    opts = dataclasses.replace(llm.options, defer_cold=True)
    got = decode(model, opts)
    counted = opts.stats.active.copy()
    step = model.plans.get(model, model._options(opts), 1).device
    assert step.deferred and set(step.cold.layers) == _moe_hosted(model)
    opts.stats.reset()
    ref = deferred_reference(model, llm.options, monkeypatch)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert np.array_equal(counted, opts.stats.active)
    assert counted.sum() > 0


def test_a_normed_ffn_output_is_not_deferred(model_path, caplog):
    """A hosted layer whose FFN output is normalized (``post_ffw_norm``) cannot add its cold
    part apart: the step warns once and runs undeferred, the same bits as without the option."""
    llm, model = placed_hybrid(model_path, Accelerator("cpu"), SPEC.n_ff // 3)
    model.weights.blk[1].post_ffw_norm = model.accel.to_device(torch.full((SPEC.n_embd,), 0.5))
    base = RunOptions(threshold=0.0, numerics=llm.options.numerics)
    with caplog.at_level(logging.WARNING, logger="powerpy.model.plan"):
        got = decode(model, dataclasses.replace(base, defer_cold=True))
    assert "layer 1 normalizes its FFN's output" in caplog.text
    assert not model.plans.get(model, dataclasses.replace(base, defer_cold=True), 1).device.deferred
    assert torch.equal(got, decode(model, base))


def test_the_deferral_quality_script_measures_real_rows(tmp_path):
    """``tools/defer_quality.py`` on kjv-relu, briefly: a CPU-only row and a hybrid one whose
    step deferred, with perplexities near the CPU-only one."""
    import json

    tool = tool_modules.tool("defer_quality")
    out = tmp_path / "rows.json"
    assert tool.main(["--tokens", "24", "--budgets", "3", "--json", str(out)]) == 0
    cpu, row = json.loads(out.read_text())["rows"]
    assert row["device_step"] and row["deferred"] and 0 < row["hot_share"] < 1
    assert abs(row["nll"] - cpu["nll"]) < 1e-3  # the hybrid is the CPU-only model
    assert 0 < row["max_dlogit"] and abs(row["nll_deferred"] - cpu["nll"]) < 0.5
