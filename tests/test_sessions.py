"""One model, many sessions: a forward depends only on its arguments (tokens, cache, options).

Two sessions interleaved token by token on one model give exactly the tokens each gives alone,
on a PWRI model and on a dense GGUF, even when the sessions run with different options (sparse
and dense, different thresholds, a profiling observer) and on a hybrid placement.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from powerpy.api import load
from powerpy.formats.gpuidx import GpuIndex
from powerpy.generate import generate_step
from powerpy.model.numerics import Numerics
from powerpy.model.options import DENSE, RunOptions, SparsityStats
from powerpy.placement.placement import Placement
from powerpy.placement.runtime import build_hybrid
from powerpy.sampling import SamplingParams, make_sampler
from powerpy.testing import TinySpec, write_tiny_model

SPEC = TinySpec(n_embd=64, n_layer=2, n_ff=256, n_head=4, n_head_kv=2)
PROMPTS = ([1, 72, 101, 108, 108, 111], [1, 87, 111, 114, 108, 100, 33, 32, 65])
N = 12


@pytest.fixture(scope="module", params=["pwri", "dense"])
def model_path(request, tmp_path_factory):
    sparse = request.param == "pwri"
    path = tmp_path_factory.mktemp("sessions") / f"m.{'powerinfer.' if sparse else ''}gguf"
    write_tiny_model(path, SPEC, sparse=sparse, seed=11)
    return path


def steps(model, prompt, opts, seed=None):
    """A generator of sampled tokens with its own cache and sampler."""
    params = SamplingParams(temperature=0.0 if seed is None else 0.9, seed=seed)
    cache = model.new_cache(len(prompt) + N + 1)
    return generate_step(model, prompt, make_sampler(params), cache, opts)


def alone(model, prompt, opts, seed=None) -> list[int]:
    gen = steps(model, prompt, opts, seed)
    return [next(gen) for _ in range(N)]


def interleaved(model, runs) -> list[list[int]]:
    """``runs``: (prompt, opts, seed) per session; one token of each in turn."""
    gens = [steps(model, p, o, s) for p, o, s in runs]
    out: list[list[int]] = [[] for _ in runs]
    for _ in range(N):
        for i, g in enumerate(gens):
            out[i].append(next(g))
    return out


def session_options(model):
    base = RunOptions(threshold=0.0, stats=SparsityStats.empty(SPEC.n_layer, SPEC.n_ff))
    seen = []
    observer = dataclasses.replace(base, sparse=False, observer=lambda l, x, h: seen.append(l))
    return [
        (PROMPTS[0], base, None),
        (PROMPTS[1], DENSE, 3),  # sampled, with its own seed
        (PROMPTS[0], RunOptions(threshold=-0.5), None),
        (PROMPTS[1], observer, None),
    ], seen


def test_interleaved_sessions_equal_each_alone(model_path):
    llm = load(model_path)
    runs, seen = session_options(llm.model)
    want = [alone(llm.model, p, o, s) for p, o, s in runs]
    assert seen and set(seen) == set(range(SPEC.n_layer))  # the observer saw every layer
    runs, _ = session_options(llm.model)
    got = interleaved(llm.model, runs)
    assert got == want
    if llm.model.can_gate:  # the options really differ: not every run is the same text
        assert want[0] != want[2] or want[0] != want[3]
        assert runs[0][1].stats.tokens.sum() > 0  # the first session's statistics only
        assert runs[2][1].stats is None


def test_interleaved_sessions_on_a_hybrid_placement(tmp_path):
    path = tmp_path / "h.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=11)
    llm = load(path)
    rng = np.random.default_rng(0)
    buckets = [np.sort(rng.choice(SPEC.n_ff, 100, replace=False)) for _ in range(SPEC.n_layer)]
    index = GpuIndex.from_buckets(buckets, SPEC.n_ff, vram_capacity=0)
    placement = Placement.for_model(llm.file, 1 << 30, index, n_ctx=64, kv_elem_bytes=4)
    hybrid = build_hybrid(llm.model, placement, "cpu", file=llm.file).model
    runs, _ = session_options(hybrid)
    want = [alone(llm.model, p, o, s) for p, o, s in runs]  # CPU-only, one at a time
    runs, _ = session_options(hybrid)
    got = interleaved(hybrid, runs)
    assert got[1] == want[1] and got[3] == want[3]  # dense runs: bitwise the same path
    # sparse runs: the same greedy tokens (hybrid = CPU-only up to f32 rounding, test_hybrid)
    assert got[0] == want[0] and got[2] == want[2]


def test_the_model_holds_no_run_state(model_path):
    """Nothing a forward reads can be flipped on the model: it has args, weights, the
    placement it was built with, its default host cache type and its decode plans (made from
    those and a call's options, one per options: ``powerpy.model.plan``), nothing else."""
    llm = load(model_path)
    attrs = {"args", "weights", "accel", "kv", "cache_dtype", "plans"}
    assert set(vars(llm.model)) == attrs
    cache = llm.model.new_cache(16)
    llm.model.forward(torch.tensor(PROMPTS[0]), cache, DENSE)
    llm.model.forward(torch.tensor([5]), cache, DENSE)
    llm.model.forward(torch.tensor([6]), cache, DENSE)  # the same plan
    assert len(llm.model.plans) == 1
    llm.model.forward(torch.tensor([7]), cache, RunOptions(sparse=False, threshold=0.25))
    assert set(vars(llm.model)) == attrs and len(llm.model.plans) == 2


def _derived_state(llm) -> dict:
    """Everything a run may leave behind, by owner: the model's attributes, its plans (decode
    plans and host executors, ``model.plans``), each quantized matrix's interleaved copy (the
    weight's own, ``QuantWeight.interleaved``) and the file's page registry (``GGUFFile``)."""
    from powerpy.model.matrices import QuantWeight

    model = llm.model
    quant = [
        w for blk in model.weights.blk for w in vars(blk).values() if isinstance(w, QuantWeight)
    ]
    return {
        "attrs": set(vars(model)),
        "plans": model.plans.keys(),
        "host": model.plans.host_keys(),
        "interleaved": [id(w.interleaved) for w in quant],
        "built": sum(bool(w.interleaved) for w in quant),
        "pages": llm.file.pages,
    }


def test_runs_leave_no_state_outside_its_owners(tmp_path):
    """Two sessions on two threads over one quantized model, under the load's options: the
    model's state after is the state after load (its host plan and the matrices' interleaved
    rows are built at load, ``stack_decode.prepare``) plus the options' one decode plan, owned
    by the model (``model.plans``); nothing is kept at module level (no plan cache in
    ``stack_decode``, no page registry in ``gguf_reader``: the file owns it); and a dense call
    adds only its own plans to the model's."""
    from concurrent.futures import ThreadPoolExecutor

    from powerpy.formats import gguf_reader
    from powerpy.formats.constants import GGMLType
    from powerpy.model import stack_decode
    from powerpy.model.plan import PlanKey

    path = tmp_path / "q4.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=GGMLType.Q4_0)
    llm = load(path)
    assert not hasattr(stack_decode, "_PLANS") and not hasattr(gguf_reader, "_FILE_PAGES")
    before = _derived_state(llm)
    assert before["host"] and before["built"], "the load's plan and layouts are built at load"

    def run(prompt):
        cache = llm.model.new_cache(16)
        llm.model.forward(torch.tensor(prompt), cache, llm.options)
        return [llm.model.forward(torch.tensor([t]), cache, llm.options) for t in (5, 6, 7)]

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, PROMPTS))
    after = _derived_state(llm)
    assert before.pop("plans") == []  # decode plans are built by the first step
    assert after.pop("plans") == [PlanKey.of(llm.options, 1)]  # one, for both sessions
    assert after == before
    cache = llm.model.new_cache(16)
    llm.model.forward(torch.tensor(PROMPTS[0]), cache, DENSE)
    llm.model.forward(torch.tensor([5]), cache, DENSE)
    after = _derived_state(llm)
    assert after["attrs"] == before["attrs"] and after["pages"] is before["pages"]
    assert set(after["host"]) == set(before["host"]) | {stack_decode.plan_key(DENSE)}


def test_interleaved_sessions_keep_their_own_numerics(smollm2_path):
    """Numerics are per call: three sessions on one quantized model (llama.cpp's rounding,
    exact f32 activations, torch's code paths), stepped token by token in turn, each give the
    logits of their solo run bit for bit, and the three differ."""
    llm = load(smollm2_path)
    kinds = {
        "llama.cpp": Numerics(),
        "exact": Numerics(quantized_activations=False),
        "torch": Numerics(native=False, quantized_activations=False),
    }
    opts = {k: RunOptions(numerics=n) for k, n in kinds.items()}
    prompt, steps = llm.tokenize("The Lord is my shepherd"), [11, 260, 1028, 30, 7]

    def start(k):
        cache = llm.model.new_cache(32)
        return cache, llm.model.forward(torch.tensor(prompt), cache, opts[k])

    solo = {}
    for k in kinds:
        cache, first = start(k)
        rows = [llm.model.forward(torch.tensor([t]), cache, opts[k]) for t in steps]
        solo[k] = torch.cat([first, *rows])
    runs = {k: start(k) for k in kinds}
    got = {k: [runs[k][1]] for k in kinds}
    for t in steps:
        for k in kinds:  # one token of each session in turn
            got[k].append(llm.model.forward(torch.tensor([t]), runs[k][0], opts[k]))
    for k in kinds:
        assert torch.equal(torch.cat(got[k]), solo[k]), k
    assert not torch.equal(solo["llama.cpp"], solo["exact"])
    assert not torch.equal(solo["exact"], solo["torch"])
