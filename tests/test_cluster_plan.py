"""Where the stages go (no Ray): ``--pipeline`` specs, the planner (``powerpy plan``), and a
stage's own hybrid placement on the emulated accelerator."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import powerpy
from powerpy.cli import main
from powerpy.cluster.pipeline import LocalTransport, PipelineEngine
from powerpy.cluster.plan import GPU_BW, HOST_BW, Node, parse_nodes, plan_pipeline, predict
from powerpy.cluster.spec import StageSpec, parse_pipeline
from powerpy.cluster.stage import Stage
from powerpy.formats.stats import save_activation_stats
from powerpy.sampling import SamplingParams
from powerpy.scheduler import Delta, Finished, Request, Sampling, Scheduler
from powerpy.testing import TinySpec, write_tiny_model

pytestmark = pytest.mark.cluster

MIB = 1 << 20
SPEC = TinySpec(n_embd=64, n_layer=4, n_ff=512, n_head=4, n_head_kv=2, n_ctx=256)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny PWRI model with activation statistics beside it."""
    d = tmp_path_factory.mktemp("plan")
    path = d / "m.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=2)
    rng = np.random.default_rng(0)
    stats = [rng.pareto(1.0, SPEC.n_ff).astype(np.float32) for _ in range(SPEC.n_layer)]
    save_activation_stats(d / "activation", stats)
    return path, stats


def test_pipeline_specs():
    got = parse_pipeline("10.0.0.1:0-1,pc2:2-3:6.5", 4)
    assert got == [StageSpec(range(0, 2), "10.0.0.1"), StageSpec(range(2, 4), "pc2", 6.5)]
    assert [str(s) for s in got] == ["10.0.0.1:0-1", "pc2:2-3:6.5"]
    assert parse_pipeline("[::1]:0-3", 4) == [StageSpec(range(0, 4), "::1")]
    assert parse_pipeline("*:0-3", 4)[0].host is None
    for bad, what in [
        ("a:0-1", "covers layers 0-1"),
        ("a:0-1,b:3-3", "should start at layer 2"),
        ("a:0-2,b:1-3", "should start at layer 3"),
        ("a0-3", "HOST:FIRST-LAST"),
        ("a:0-3:x", "not a number"),
        ("a:3-0", "start at layer 0"),
        ("a:x-3", "FIRST-LAST"),
    ]:
        with pytest.raises(ValueError, match=what):
            parse_pipeline(bad, 4)


def test_a_model_that_fits_one_node_gets_one_stage(model):
    path, _ = model
    size = path.stat().st_size
    plan = plan_pipeline(path, [Node("small", size // 3), Node("big", 4 * size)], n_ctx=64)
    assert [(str(s.spec), s.node.name) for s in plan.stages] == [("big:0-3", "big")]
    assert plan.tok_s > 0 and plan.stages[0].host_bytes > size * 0.9


def test_a_model_too_big_for_one_node_is_split(model):
    path, _ = model
    size = path.stat().st_size
    nodes = [Node("a", int(size * 0.7)), Node("b", int(size * 0.7))]
    plan = plan_pipeline(path, nodes, n_ctx=64)
    assert len(plan.stages) == 2
    ranges = [s.spec.layers for s in plan.stages]
    assert ranges[0].start == 0 and ranges[0].stop == ranges[1].start and ranges[1].stop == 4
    for s in plan.stages:
        assert s.host_bytes <= 0.9 * s.node.ram
    assert plan.seconds == pytest.approx(sum(s.seconds for s in plan.stages) + plan.hop_seconds)
    with pytest.raises(ValueError, match="the model needs about"):
        plan_pipeline(path, [Node("a", size // 4)], n_ctx=64)


def test_vram_moves_work_off_the_cpu(model):
    """A node's GPU takes the dense tensors and hot rows: less RAM, more tok/s."""
    path, _ = model
    size = path.stat().st_size
    cpu = plan_pipeline(path, [Node("a", 4 * size)], n_ctx=64)
    gpu = plan_pipeline(path, [Node("a", 4 * size, 1 << 30)], n_ctx=64)
    assert gpu.stages[0].device_bytes > 0 and gpu.stages[0].hot_share == 1.0
    assert gpu.stages[0].host_bytes < cpu.stages[0].host_bytes
    assert gpu.tok_s > cpu.tok_s
    # a second GPU node would not make it clearly faster: one stage still
    two = plan_pipeline(
        path, [Node("a", 4 * size, 1 << 30), Node("b", 4 * size, 1 << 30)], n_ctx=64
    )
    assert len(two.stages) == 1
    # the prediction of a split over one CPU node and one GPU node, as given
    plan = predict(
        path, [Node("a", 4 * size), Node("g", 4 * size, 1 << 30)], "a:0-1,g:2-3", n_ctx=64
    )
    assert [s.device_bytes > 0 for s in plan.stages] == [False, True]
    with pytest.raises(ValueError, match="none of the nodes"):
        predict(path, [Node("a", size)], "a:0-1,z:2-3")


def test_nodes_flag_and_the_plan_command(model, capsys):
    path, _ = model
    assert parse_nodes("pc1:64:24,pc2:0.5") == [
        Node("pc1", 64 << 30, 24 << 30, HOST_BW, GPU_BW),
        Node("pc2", 512 * MIB, 0, HOST_BW, GPU_BW),
    ]
    with pytest.raises(ValueError, match="NAME:RAM_GIB"):
        parse_nodes("pc1:lots")
    gib = path.stat().st_size * 0.7 / (1 << 30)
    assert main(["plan", str(path), "--nodes", f"a:{gib},b:{gib}", "-c", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["stages"]) == 2 and out["pipeline"].startswith(("a:0-", "b:0-"))
    assert main(["plan", str(path), "--nodes", "a:1", "-c", "64"]) == 0
    text = capsys.readouterr().out
    assert "1 stage(s), --pipeline a:0-3" in text and "tok/s" in text


def test_a_stage_places_its_own_layers(model):
    """A stage's hybrid placement (emulated accelerator): its own GPU index, from its own
    layers' statistics, and the pipeline's tokens are the whole CPU-only model's."""
    path, stats = model
    whole = powerpy.load(path)
    opts = {"vram_budget": 0.001, "device": "cpu", "n_ctx": 64, "reset_gpu_index": True}
    s0 = Stage(path, range(0, 2))
    s1 = Stage(path, range(2, 4), index=1, load_options=opts)
    rt = s1.llm.runtime
    assert (
        rt is not None and (path.parent / "m.powerinfer.gguf.layers-2-3.generated.gpuidx").exists()
    )
    k = rt.placement.layers[1].k
    assert 0 < k < SPEC.n_ff  # layer 3's hottest neurons, by layer 3's statistics
    top = np.sort(np.argsort(-stats[3], kind="stable")[:k])
    assert np.array_equal(np.sort(rt.placement.layers[1].gpu_bucket), top)
    engine = PipelineEngine(LocalTransport([s0, s1]), whole.model.args, whole.options)
    sched = Scheduler(engine, whole.tokenizer, whole.options, n_parallel=1)
    sched.start()
    try:
        events = []
        greedy = Sampling(SamplingParams(temperature=0))
        sched.submit(Request(sched.encode("Hello"), 8, greedy, on_event=events.append))
        deadline = time.monotonic() + 60
        while not (events and isinstance(events[-1], Finished)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(events[-1], Finished), events[-1:]
        text = "".join(e.text for e in events if isinstance(e, Delta))
        assert text == whole.generate("Hello", 8, temperature=0)
    finally:
        sched.close()
