"""The engine under `powerpy serve`, in process: the batched decode step, stop strings, the
scheduler (turns, prefix reuse, queue, cancellation, failures) and a failing session over HTTP."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from powerpy.api import load
from powerpy.formats.gpuidx import GpuIndex
from powerpy.model.options import DENSE, RunOptions
from powerpy.model.transformer import FFN_MODES
from powerpy.placement.placement import Placement
from powerpy.placement.runtime import build_hybrid
from powerpy.sampling import SamplingParams
from powerpy.scheduler import (
    Delta,
    Failed,
    Finished,
    PromptTooLong,
    QueueFull,
    Request,
    Sampling,
    Scheduler,
    StopMatcher,
)
from powerpy.scheduler.calibrate import choose_batch_mode
from powerpy.testing import TinySpec, write_tiny_model

GREEDY = Sampling(SamplingParams(temperature=0))


@pytest.fixture(scope="module", params=["pwri", "dense"])
def llm(request, tmp_path_factory):
    sparse = request.param == "pwri"
    path = tmp_path_factory.mktemp("engine") / f"m.{'powerinfer.' if sparse else ''}gguf"
    write_tiny_model(path, TinySpec(n_ctx=512), sparse=sparse, seed=7)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load(path)
    torch.set_num_threads(n)


class Collector:
    """Events of one request, with a wait for its end."""

    def __init__(self) -> None:
        self.events: list = []
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        self.events.append(ev)
        if isinstance(ev, (Finished, Failed)):
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Delta))

    @property
    def end(self):
        assert self.done.wait(30)
        return self.events[-1]


def run_all(sched: Scheduler, reqs: list[tuple[str, int]], sampling=GREEDY, stop=()):
    cols = []
    for prompt, n in reqs:
        c = Collector()
        sched.submit(Request(sched.encode(prompt), n, sampling, stop, on_event=c))
        cols.append(c)
    for c in cols:
        assert c.done.wait(30)
    return cols


# ----------------------------------------------------------------------------------- batch forward
@pytest.mark.parametrize("mode", FFN_MODES)
def test_decode_batch_matches_one_forward_per_session(llm, mode):
    m = llm.model
    prompts = [llm.tokenize(p) for p in ("Hello", "Once upon", "x", "The Lord is my")]
    for opts in (llm.options, DENSE, RunOptions(threshold=-0.3)):
        # f32 caches: with f16 ones, the f16 rounding of q amplifies the last-bit differences
        # of batched and one-token matmuls beyond 1e-4
        ca = [m.new_cache(64, dtype=torch.float32) for _ in prompts]
        cb = [m.new_cache(64, dtype=torch.float32) for _ in prompts]
        toks = []
        for p, a, b in zip(prompts, ca, cb, strict=True):
            m.forward(torch.tensor(p), a, opts)
            toks.append(int(m.forward(torch.tensor(p), b, opts)[-1].argmax()))
        for _ in range(6):
            want = torch.cat(
                [m.forward(torch.tensor([t]), c, opts) for t, c in zip(toks, ca, strict=True)]
            )
            got = m.decode_batch(torch.tensor(toks), cb, opts, ffn_mode=mode)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            assert [c.pos for c in ca] == [c.pos for c in cb]
            toks = [int(t) for t in want.argmax(-1)]
            assert toks == [int(t) for t in got.argmax(-1)]


@pytest.mark.parametrize("mode", FFN_MODES)
def test_decode_batch_on_a_hybrid_placement(tmp_path, mode):
    """Hot rows on an (emulated) accelerator, the KV caches there too."""
    path = tmp_path / "h.powerinfer.gguf"
    spec = TinySpec(n_ctx=512)
    write_tiny_model(path, spec, sparse=True, seed=3)
    llm = load(path)
    rng = np.random.default_rng(0)
    buckets = [np.sort(rng.choice(spec.n_ff, 100, replace=False)) for _ in range(spec.n_layer)]
    index = GpuIndex.from_buckets(buckets, spec.n_ff, vram_capacity=0)
    placement = Placement.for_model(llm.file, 1 << 30, index, n_ctx=64, kv_elem_bytes=4)
    m = build_hybrid(llm.model, placement, "cpu", file=llm.file).model
    assert m.accel is not None and any(b.hot is not None for b in m.weights.blk)
    prompts = [llm.tokenize(p) for p in ("Hello", "x", "The Lord is my")]
    caches = [m.new_cache(32) for _ in prompts]
    toks = [
        int(m.forward(torch.tensor(p), c, llm.options)[-1].argmax())
        for p, c in zip(prompts, caches, strict=True)
    ]
    want = [llm.generate(p, 7, temperature=0) for p in ("Hello", "x", "The Lord is my")]
    got = [[t] for t in toks]
    for _ in range(6):
        logits = m.decode_batch(torch.tensor(toks), caches, llm.options, ffn_mode=mode)
        toks = [int(t) for t in logits.argmax(-1)]
        for g, t in zip(got, toks, strict=True):
            g.append(t)
    assert [llm.detokenize(g) for g in got] == want


def test_decode_batch_refuses_bad_batches(llm):
    m = llm.model
    c = m.new_cache(4)
    with pytest.raises(ValueError, match="twice"):
        m.decode_batch(torch.tensor([5, 6]), [c, c])
    c.pos = 4
    with pytest.raises(ValueError, match="context is full"):
        m.decode_batch(torch.tensor([5]), [c])
    with pytest.raises(ValueError, match="ffn_mode"):
        m.decode_batch(torch.tensor([5]), [m.new_cache(4)], ffn_mode="bogus")


def test_calibration_picks_a_mode(llm):
    mode, rates = choose_batch_mode(llm.model, llm.options, 3, rounds=1)
    assert mode in rates and all(r > 0 for r in rates.values())
    assert choose_batch_mode(llm.model, llm.options, 1) == ("off", {})


# ----------------------------------------------------------------------------------- stop strings
def test_stop_matcher_holds_back_and_cuts():
    s = StopMatcher(["END", "xy"])
    assert s.push("abc E") == "abc "  # "E" may start "END"
    assert s.push("N") == ""
    assert s.push("Dzzz") == "" and s.matched == "END"
    s = StopMatcher(["END"])
    assert s.push("EN") == "" and s.push("x") == "ENx" and s.matched is None
    assert s.push("E") == "" and s.flush() == "E"
    s = StopMatcher(["cd", "abc"])  # the earliest match wins
    assert s.push("zabcd") == "z" and s.matched == "abc"


# ----------------------------------------------------------------------------------- scheduler
def test_scheduler_equals_generate_and_stops(llm):
    sched = Scheduler(llm.model, llm.tokenizer, llm.options, n_parallel=3, batch="batch")
    sched.start()
    try:
        reqs = [("Hello", 10), ("Once upon a time", 16), ("abc", 5), ("x", 12), ("Hi!", 9)]
        for c, (p, n) in zip(run_all(sched, reqs), reqs, strict=True):
            assert c.text == llm.generate(p, n, temperature=0)
            assert c.end.completion_tokens <= n
        full = llm.generate("Once upon a time", 30, temperature=0)
        stop = full[10:13]
        (c,) = run_all(sched, [("Once upon a time", 30)], stop=[stop])
        assert c.text == full[: full.find(stop)]
        assert (c.end.reason, c.end.stop_word) == ("stop", stop)
    finally:
        sched.close()


def test_sessions_take_turns_and_reuse_prefixes(llm):
    sched = Scheduler(llm.model, llm.tokenizer, llm.options, n_parallel=2, batch="off")
    sched.start()
    try:
        long, short = Collector(), Collector()
        ignore = Sampling(SamplingParams(temperature=0), ignore_eos=True)
        sched.submit(Request(sched.encode("Hello"), 400, ignore, on_event=long))
        sched.submit(Request(sched.encode("Once upon a time"), 5, ignore, on_event=short))
        assert short.done.wait(30)
        n_long = sum(isinstance(e, Delta) for e in list(long.events))
        assert n_long < 100  # the long one did not run ahead alone
        assert long.done.wait(30) and long.end.completion_tokens == 400
        # a prompt that extends the short session's reuses its cache
        ids = sched.encode("Once upon a time") + [70, 71]
        c = Collector()
        sched.submit(Request(ids, 3, GREEDY, on_event=c))
        assert c.end.cached_tokens == len(sched.encode("Once upon a time"))
        assert c.text == llm.generate(ids, 3, temperature=0)
    finally:
        sched.close()


def test_queue_full_cancel_and_zero_budget(llm):
    sched = Scheduler(llm.model, llm.tokenizer, llm.options, n_parallel=1, queue_size=1)
    sched.start()
    try:
        ignore = Sampling(SamplingParams(temperature=0), ignore_eos=True)
        a, b = Collector(), Collector()
        ra = Request(sched.encode("Hello"), 450, ignore, on_event=a)
        sched.submit(ra)
        while not a.events:
            time.sleep(0.001)
        sched.submit(Request(sched.encode("Hi"), 2, GREEDY, on_event=b))  # queued
        with pytest.raises(QueueFull):
            sched.submit(Request(sched.encode("x"), 2, GREEDY))
        ra.cancel()  # frees the slot at the next token; the queued request runs
        assert b.end.reason in ("length", "stop") and not a.done.is_set()
        assert sched.snapshot()["outcomes"]["cancelled"] == 1
        z = Collector()
        sched.submit(Request(sched.encode("Hi"), 0, GREEDY, on_event=z))
        assert (z.end.reason, z.end.completion_tokens, z.text) == ("length", 0, "")
        with pytest.raises(PromptTooLong):
            sched.submit(Request(list(range(3, 3 + sched.n_ctx)), 2))
    finally:
        sched.close()


class FaultyScheduler(Scheduler):
    """Fails the sampling of any request whose prompt contains the token FAULT."""

    FAULT = 90  # "W" in the byte vocabulary

    def _accept(self, s, tok, lp):
        if self.FAULT in s.req.prompt and s.n_gen == 2:
            self._fail(s, RuntimeError("injected fault"))
            return
        super()._accept(s, tok, lp)


def test_a_failing_session_fails_alone(llm):
    sched = FaultyScheduler(llm.model, llm.tokenizer, llm.options, n_parallel=2, batch="batch")
    sched.start()
    try:
        bad, good = Collector(), Collector()
        sched.submit(Request(sched.encode("W"), 20, GREEDY, on_event=bad))
        sched.submit(Request(sched.encode("Hello"), 20, GREEDY, on_event=good))
        assert isinstance(bad.end, Failed) and "injected fault" in bad.end.message
        assert isinstance(good.end, Finished)
        assert good.text == llm.generate("Hello", 20, temperature=0)
        assert sched.snapshot()["outcomes"]["error"] == 1
    finally:
        sched.close()


def test_a_failing_session_over_http(llm):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    import uvicorn

    from powerpy.serve import create_app
    from powerpy.serve.server import bind

    sched = FaultyScheduler(llm.model, llm.tokenizer, llm.options, n_parallel=2)
    sched.start()
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(sched), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            client.completions.create(model="powerpy", prompt="W", max_tokens=8)
        stream = client.chat.completions.create(
            model="powerpy", messages=[{"role": "user", "content": "W"}], stream=True
        )
        with pytest.raises(openai.APIError, match="injected fault"):
            list(stream)
        r = client.completions.create(model="powerpy", prompt="Hello", max_tokens=6, temperature=0)
        assert r.choices[0].text == llm.generate("Hello", 6, temperature=0)
    finally:
        server.should_exit = True
        thread.join(10)
        sched.close()
