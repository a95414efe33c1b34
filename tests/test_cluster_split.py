"""A model split by layer range, in one process (no Ray): each stage loads only its layers
(``powerpy.model.stage``), the stages pass the residual stream on, and the pipeline engine
(``powerpy.cluster.pipeline``) gives the scheduler the same tokens as the whole model, also after
a stage restarts."""

from __future__ import annotations

import threading

import pytest
import torch

import powerpy
from powerpy.cluster.pipeline import LocalTransport, PipelineEngine, StageDown, StageError
from powerpy.cluster.stage import Stage, StageMismatch
from powerpy.formats.constants import GGUFValueType, Keys
from powerpy.model.stage import stage_args, stage_file
from powerpy.sampling import SamplingParams
from powerpy.scheduler import Delta, Failed, Finished, PromptLogprobs, Request, Sampling, Scheduler
from powerpy.testing import TinySpec, write_tiny_model
from powerpy.testing.moe import write_moe_model

pytestmark = pytest.mark.cluster

GREEDY = Sampling(SamplingParams(temperature=0))
U32, F32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
IDS = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111]


def _write(kind: str, path):
    if kind == "dense":
        write_tiny_model(path, TinySpec(n_layer=4, n_ctx=512), sparse=False, seed=1)
    elif kind == "tied":  # the head reads token_embd: the last stage has it, not the embedding
        write_tiny_model(path, TinySpec(n_layer=4, n_ctx=512, tied=True), sparse=False, seed=4)
    elif kind == "sparse":  # predictor-gated, one layer ungated, per-layer cuts
        extra = {
            Keys.DENSE_LAYERS: ([2], GGUFValueType.ARRAY, U32),
            Keys.FFN_DOWN_THRESHOLD: ([0.0, 0.01, 0.02, 0.0], GGUFValueType.ARRAY, F32),
        }
        write_tiny_model(path, TinySpec(n_layer=4, n_ctx=512), sparse=True, seed=2, extra_kv=extra)
    else:
        spec = TinySpec(
            n_layer=4,
            n_expert=4,
            n_expert_used=2,
            n_ff_exp=64,
            arch="qwen3moe",
            key_length=16,
            n_ctx=512,
        )
        write_moe_model(path, spec, seed=3)
    return path


@pytest.fixture(scope="module", params=["dense", "tied", "sparse", "moe"])
def split(request, tmp_path_factory):
    """(path, whole model, stage [0, 2), stage [2, 4))."""
    path = _write(request.param, tmp_path_factory.mktemp("split") / f"{request.param}.gguf")
    return path, powerpy.load(path), Stage(path, range(0, 2)), Stage(path, range(2, 4), index=1)


def test_the_stages_load_only_their_layers(split):
    path, whole, s0, s1 = split
    assert len(s0.model.weights.blk) == len(s1.model.weights.blk) == 2
    assert (s0.first, s0.last, s1.first, s1.last) == (True, False, False, True)
    w0, w1 = s0.model.weights, s1.model.weights
    assert w0.output is None and w0.output_norm is None and w1.token_embd is None
    # layer 2's tensors are stage 1's layer 0, the same bytes of the file
    assert s1.llm.file.tensors["blk.0.attn_q.weight"].offset == (
        whole.file.tensors["blk.2.attn_q.weight"].offset
    )
    assert "blk.2.attn_q.weight" not in s1.llm.file.tensors
    assert s0.model.new_cache(8).k.shape[0] == 2  # each stage owns its layers' KV cache


def test_two_stages_give_the_whole_models_logits(split):
    """Prefill, decode steps and a batched decode step: the same bits as one model."""
    _, whole, s0, s1 = split
    m, m0, m1 = whole.model, s0.model, s1.model
    ids = torch.tensor(IDS)
    c, c0, c1 = m.new_cache(64), m0.new_cache(64), m1.new_cache(64)
    want = m.forward(ids, c, whole.options, all_logits=True)
    h = m0.forward(ids, c0, s0.opts, all_logits=True)
    assert h.shape == (len(IDS), m.args.n_embd)
    assert torch.equal(m1.forward(h, c1, s1.opts, all_logits=True), want)
    tok, got_toks, want_toks = int(want[-1].argmax()), [], []
    for _ in range(8):  # greedy decode, token by token
        r = m.forward(torch.tensor([tok]), c, whole.options)
        g = m1.forward(m0.forward(torch.tensor([tok]), c0, s0.opts), c1, s1.opts)
        assert torch.equal(g, r)
        tok = int(r[-1].argmax())
        want_toks.append(tok), got_toks.append(int(g[-1].argmax()))
    assert got_toks == want_toks
    caches = [[m.new_cache(32) for _ in range(2)] for m in (m, m0, m1)]
    for p, cs in zip(([5, 6, 7], [8, 9]), zip(*caches, strict=True), strict=True):
        m.forward(torch.tensor(p), cs[0], whole.options)
        m1.forward(m0.forward(torch.tensor(p), cs[1], s0.opts, all_logits=True), cs[2], s1.opts)
    for mode in ("rows", "batch"):
        want = m.decode_batch(torch.tensor([3, 4]), caches[0], whole.options, ffn_mode=mode)
        h = m0.decode_batch(torch.tensor([3, 4]), caches[1], s0.opts, ffn_mode=mode)
        got = m1.decode_batch(h, caches[2], s1.opts, ffn_mode=mode)
        assert torch.equal(got, want), mode


def _collect(sched, prompt, n, sampling=GREEDY, **kw):
    events, done = [], threading.Event()

    def on_event(ev):
        events.append(ev)
        if isinstance(ev, (Finished, Failed)):
            done.set()

    sched.submit(Request(sched.encode(prompt), n, sampling, on_event=on_event, **kw))
    return events, done


def _text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


@pytest.mark.parametrize("batch", ["off", "batch"])
def test_the_scheduler_over_a_pipeline_equals_the_whole_model(split, batch):
    """Greedy and seeded streams, token log-probabilities and a scored prompt: the same as
    the scheduler over the whole model, with the sequences in micro-batches on the stages."""
    path, whole, s0, s1 = split
    engine = PipelineEngine(LocalTransport([s0, s1]), whole.model.args, whole.options)
    if batch == "off":  # the API's own way to the same: stages of this process
        engine = PipelineEngine.in_process(path, [range(0, 1), range(1, 3), range(3, 4)])
        assert engine.n_stages == 3 and engine.tokenizer is not None
    seeded = Sampling(SamplingParams(temperature=0.9, seed=11))
    prompts = [("Hello", GREEDY), ("Once upon a time", seeded), ("x", GREEDY)]
    runs = {}
    for name, model in (("whole", whole.model), ("pipeline", engine)):
        sched = Scheduler(model, whole.tokenizer, whole.options, n_parallel=3, batch=batch)
        sched.start()
        try:
            got = [_collect(sched, p, 12, s, logprobs=2) for p, s in prompts]
            got.append(_collect(sched, "The Lord is", 3, GREEDY, prompt_logprobs=True, logprobs=1))
            for _, done in got:
                assert done.wait(60)
            runs[name] = [ev for ev, _ in got]
        finally:
            sched.close()
    for a, b in zip(runs["whole"], runs["pipeline"], strict=True):
        assert isinstance(b[-1], Finished), b[-1]
        assert _text(a) == _text(b)
        assert [e for e in a if isinstance(e, PromptLogprobs)] == [
            e for e in b if isinstance(e, PromptLogprobs)
        ]
        la, lb = ([lp for e in ev if isinstance(e, Delta) for lp in e.logprobs] for ev in (a, b))
        if batch == "off":  # one forward per sequence: the same bits
            assert la == lb
        else:  # the micro-batches are smaller batches than the whole model's one (last bits)
            assert [x.token for x in la] == [x.token for x in lb]
            got, want = ([x.logprob for x in lps] for lps in (lb, la))
            assert got == pytest.approx(want, abs=1e-3)
    assert _text(runs["whole"][0]) == whole.generate("Hello", 12, temperature=0)


def test_per_layer_keys_follow_the_layers(tmp_path):
    """Dense layers, cuts and windowed layers are renumbered; the view reads back as a model."""
    path = _write("sparse", tmp_path / "s.powerinfer.gguf")
    whole = powerpy.read_gguf(path)
    view = stage_file(whole, range(1, 4))
    a = powerpy.load(path).model.args
    b = stage_args(a, range(1, 4))
    assert (b.n_layer, b.dense_layers) == (3, (1,))
    assert b.down_thresholds == pytest.approx((0.01, 0.02, 0.0)) and b.down_thresholds[0] > 0
    assert view.kv[Keys.DENSE_LAYERS] == [1] and view.ends == (False, True)
    assert powerpy.load(path, layers=range(1, 4)).model.weights.blk[1].sparse_layer is False
    g = tmp_path / "g.gguf"
    extra = {
        "gemma3.attention.sliding_window": (8, U32),
        "gemma3.attention.sliding_window_pattern": (2, U32),
    }
    write_tiny_model(
        g, TinySpec(arch="gemma3", n_layer=4, key_length=16), sparse=False, extra_kv=extra
    )
    ga = powerpy.load(g).model.args
    assert ga.swa_layers == (0, 2)
    assert powerpy.load(g, layers=range(1, 4)).model.args.swa_layers == (1,)
    with pytest.raises(ValueError, match="not a range"):
        powerpy.load(g, layers=range(2, 6))


def test_a_stage_checks_its_copy_of_the_file(tmp_path):
    path = _write("dense", tmp_path / "a.gguf")
    other = tmp_path / "b.gguf"
    write_tiny_model(other, TinySpec(n_layer=4, n_ctx=512), sparse=False, seed=9)
    digest = stage_file(powerpy.read_gguf(path), range(2, 4)).digest()
    assert Stage(path, range(2, 4), digest=digest).digest == digest
    assert stage_file(powerpy.read_gguf(path), range(0, 2)).digest() != digest
    with pytest.raises(StageMismatch, match="differ from the driver's copy"):
        Stage(other, range(2, 4), digest=digest)


class FlakyTransport(LocalTransport):
    """Stage 1 dies at its ``die_at``-th call; ``recover`` loads it again (empty caches)."""

    def __init__(self, stages, die_at: int, path) -> None:
        super().__init__(stages)
        self.calls, self.die_at, self.path = 0, die_at, path

    def submit(self, index, call, prev):
        if index == 1 and not isinstance(prev, BaseException):
            self.calls += 1
            if self.calls == self.die_at:
                return StageDown(1, "killed by the test")
        return super().submit(index, call, prev)

    def gather(self, chains, timeout, abort):
        return [next((h for h in chain if isinstance(h, StageDown)), chain[-1]) for chain in chains]

    def recover(self, index, timeout, stuck=False):
        self.stages[index] = Stage(self.path, self.stages[index].layers, index=index)
        return self.stages[index].info()


@pytest.mark.parametrize("restart", [False, True])
def test_a_dead_stage_fails_or_restarts_and_replays(tmp_path, restart):
    """Without restarts the request ends with a 503 and the engine stays failed; with them the
    interrupted greedy sequence ends with the tokens of an uninterrupted run."""
    path = _write("dense", tmp_path / "m.gguf")
    whole = powerpy.load(path)
    stages = [Stage(path, range(0, 2)), Stage(path, range(2, 4), index=1)]
    engine = PipelineEngine(
        FlakyTransport(stages, 6, path), whole.model.args, whole.options, restart=restart
    )
    born = engine.stages[1]["incarnation"]
    sched = Scheduler(engine, whole.tokenizer, whole.options, n_parallel=2, batch="off")
    sched.start()
    try:
        events, done = _collect(sched, "Hello", 16)
        assert done.wait(60)
        if not restart:
            end = events[-1]
            assert isinstance(end, Failed) and end.status == 503, end
            assert "stage 1 (layers 2-3" in end.message and "killed by the test" in end.message
            health = sched.health()
            assert health["stage"] == 1 and health["layers"] == "2-3", health
            with pytest.raises(StageError):
                sched.submit(Request([1, 2], 2))
            return
        assert isinstance(events[-1], Finished), events[-1]
        assert engine.stages[1]["incarnation"] != born  # it died and came back, mid-stream
        assert _text(events) == whole.generate("Hello", 16, temperature=0)
        assert sched.health() is None
        events, done = _collect(sched, "Once upon", 6)
        assert done.wait(60) and _text(events) == whole.generate("Once upon", 6, temperature=0)
    finally:
        sched.close()
