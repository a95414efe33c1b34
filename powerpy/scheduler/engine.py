"""The scheduler: N session slots over one shared model, all model work on one worker thread.

Each slot owns a KV cache. Requests wait in a bounded queue until a slot is free; a new request
takes the free slot whose cached tokens share the longest prefix with its prompt (then the least
recently used one), and only the rest of its prompt is run, as ``ChatSession`` does between turns.

The worker advances every active slot in turn: one prefill chunk per prefilling slot, then one
token for every decoding slot, so a long generation never starves the others. Where it pays
(:mod:`powerpy.scheduler.calibrate`), the decoding slots' tokens go through one batched forward
(``Model.decode_batch``). A failure inside one slot ends that request with a
:class:`Failed` event; the others go on. The model runs through an engine
(``powerpy.scheduler.local``): a model in this process, or a pipeline of stages
(``powerpy.cluster``), which draws the tokens where the logits are.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from powerpy.chat import Message, encode_chat
from powerpy.config import ModelArgs
from powerpy.model.options import SPARSE, RunOptions
from powerpy.model.transformer import FFN_MODES, Model
from powerpy.scheduler.calibrate import choose_batch_mode
from powerpy.scheduler.local import SEQUENTIAL, Engine, EngineUnavailable, LocalEngine, Prefill
from powerpy.scheduler.logprobs import TokenLogprob
from powerpy.scheduler.picks import Pick, Score, allowed_tokens
from powerpy.scheduler.request import Delta, Event, Failed, Finished, PromptLogprobs, Request
from powerpy.scheduler.slot import Slot, common_prefix
from powerpy.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BATCH_MODES = ("auto", SEQUENTIAL, *FFN_MODES)
OUTCOMES = ("stop", "length", "cancelled", "error")


class QueueFull(RuntimeError):
    """Every slot is busy and the queue is full: retry after ``retry_after`` seconds."""

    def __init__(self, waiting: int, retry_after: int = 1) -> None:
        super().__init__(f"the server is busy: {waiting} requests are waiting; retry later")
        self.retry_after = retry_after


class ShuttingDown(RuntimeError):
    """The scheduler is draining or stopped and takes no new requests."""


class PromptTooLong(ValueError):
    """The prompt does not fit a slot's context."""


@dataclass
class Stats:
    """Counters since start (written by the worker, read by anyone)."""

    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    rejected: int = 0  # refused: queue full
    prompt_tokens: int = 0  # prompt tokens run (reused ones excluded)
    cached_tokens: int = 0  # prompt tokens reused from a slot's cache
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0  # decode forwards (a batch counts once)
    decode_rows: int = 0  # tokens those forwards ran


class Scheduler:
    """Runs requests on ``n_parallel`` session slots of one model, on one worker thread.

    ``model`` is a ``Model`` in this process or any engine (``powerpy.scheduler.local.Engine``,
    e.g. ``powerpy.cluster.PipelineEngine``). Example::

        sched = Scheduler(llm.model, llm.tokenizer, llm.options, n_parallel=4)
        sched.start()
        sched.submit(Request(ids, 32, on_event=print))
        ...
        sched.close()
    """

    def __init__(
        self,
        model: Model | Engine,
        tokenizer: Tokenizer,
        opts: RunOptions = SPARSE,
        *,
        n_parallel: int = 1,
        n_ctx: int | None = None,
        queue_size: int = 64,
        batch: str = "auto",
        prefill_chunk: int = 512,
        source: str = "model",
    ) -> None:
        """Args: the shared ``model``, its ``tokenizer`` and run ``opts``; ``n_parallel`` slots
        of ``n_ctx`` positions each (default: training context, at most 4096); ``queue_size``
        requests may wait; ``batch``: "auto" (measure at start), "off" or an FFN mode of
        ``decode_batch``; ``prefill_chunk``: prompt tokens per forward; ``source``: the model
        file, for messages.

        Raises:
            ValueError: a bad size or batch mode.
        """
        if n_parallel < 1 or queue_size < 0 or prefill_chunk < 1:
            raise ValueError("n_parallel and prefill_chunk must be >= 1, queue_size >= 0")
        if batch not in BATCH_MODES:
            raise ValueError(f"unknown batch mode {batch!r}: one of {BATCH_MODES}")
        engine = LocalEngine(model) if isinstance(model, Model) else model
        self.engine, self.tokenizer, self.opts, self.source = engine, tokenizer, opts, source
        self.n_ctx = n_ctx or engine.args.default_n_ctx
        self.slots = [Slot(i, engine.new_cache(self.n_ctx)) for i in range(n_parallel)]
        self.queue_size = queue_size
        self.batch = batch
        self.batch_mode = SEQUENTIAL if batch == "auto" else batch
        self.batch_rates: dict[str, float] = {}
        self.prefill_chunk = prefill_chunk
        self.stats = Stats()
        self._waiting: collections.deque[Request] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._draining = False

    @property
    def args(self) -> ModelArgs:
        """The model's hyperparameters."""
        return self.engine.args

    # ------------------------------------------------------------------------- prompts
    def encode(self, prompt: str | Sequence[int], *, add_bos: bool | None = None) -> list[int]:
        """Token ids of a text prompt, or the ids given (checked against the vocabulary).

        Raises:
            ValueError: an id outside the vocabulary.
        """
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=add_bos)
        ids = [int(t) for t in prompt]
        n_vocab = self.args.n_vocab
        bad = [t for t in ids if not 0 <= t < n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
        return ids

    def encode_chat(
        self, messages: Sequence[Message], tools: Sequence[Any] | None = None
    ) -> list[int]:
        """The prompt ids of a conversation (with ``tools`` definitions), through the model's
        chat template.

        Raises:
            ValueError: malformed messages or a failing template.
        """
        ids = encode_chat(self.tokenizer, messages, tokenize=True, source=self.source, tools=tools)
        return list(ids)

    # ------------------------------------------------------------------------- control
    def start(self) -> None:
        """Choose the batching mode ("auto": measure it) and start the worker thread."""
        if self._thread is not None:
            return
        if self.batch == "auto" and len(self.slots) > 1:
            self.batch_mode, self.batch_rates = choose_batch_mode(
                self.engine, self.opts, len(self.slots)
            )
        self._thread = threading.Thread(target=self._run, name="powerpy-scheduler", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> None:
        """Queue ``req``; its events go to ``req.on_event`` from the worker thread.

        Raises:
            PromptTooLong: the prompt leaves no room to generate in a slot's context.
            QueueFull: ``queue_size`` requests are already waiting.
            ShuttingDown: the scheduler is draining or closed.
            EngineUnavailable: the engine cannot run (a pipeline stage is dead).
        """
        failure = self.engine.failure
        if failure is not None:
            raise failure
        if len(req.prompt) >= self.n_ctx:
            raise PromptTooLong(
                f"the prompt is {len(req.prompt)} tokens and the context holds {self.n_ctx}: "
                "shorten it, or start the server with a larger context (-c)"
            )
        with self._cv:
            if self._draining or self._stop:
                raise ShuttingDown("the server is shutting down")
            if any(r.cancelled for r in self._waiting):  # clients gone while queued
                kept = [r for r in self._waiting if not r.cancelled]
                self.stats.outcomes["cancelled"] += len(self._waiting) - len(kept)
                self._waiting = collections.deque(kept)
            free = sum(s.req is None for s in self.slots)
            if len(self._waiting) >= self.queue_size + free:  # the free slots take some at once
                self.stats.rejected += 1
                raise QueueFull(len(self._waiting))
            self._waiting.append(req)
            self._cv.notify()

    def drain(self) -> None:
        """Refuse new requests; the running and queued ones go on (see ``idle``)."""
        with self._cv:
            self._draining = True

    @property
    def idle(self) -> bool:
        """No request is running or waiting."""
        return not self._waiting and all(s.req is None for s in self.slots)

    def health(self) -> dict[str, Any] | None:
        """The liveness probe: None while the worker runs and the engine can, else what is
        wrong (``message`` and, for a pipeline, the stage's ``stage``, ``host``, ``layers`` and
        ``error``). It may probe the engine for a moment: call it off the event loop."""
        if self._thread is not None and not self._thread.is_alive() and not self._stop:
            return {"message": "the scheduler's worker thread has stopped"}
        return self.engine.health()

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the worker; requests still running or waiting get a ``Failed`` event."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        while self._waiting:
            self._emit(self._waiting.popleft(), Failed("the server is shutting down"))
        for s in self.slots:
            if s.req is not None:
                self._emit(s.req, Failed("the server is shutting down"))
                s.req = None

    def snapshot(self) -> dict[str, Any]:
        """Queue depth, busy slots, batching and counters, for health and metrics."""
        st = self.stats
        frac = None
        if self.opts.stats is not None and self.opts.sparse and self.engine.can_gate:
            f = self.opts.stats.active_fraction()
            if (self.opts.stats.tokens > 0).any():
                frac = float(f[self.opts.stats.tokens > 0].mean())
        return {
            "slots_total": len(self.slots),
            "slots_busy": sum(s.req is not None for s in self.slots),
            "queue_depth": len(self._waiting),
            "queue_size": self.queue_size,
            "n_ctx": self.n_ctx,
            "batch_mode": self.batch_mode,
            "outcomes": dict(st.outcomes),
            "rejected": st.rejected,
            "prompt_tokens": st.prompt_tokens,
            "cached_tokens": st.cached_tokens,
            "prompt_seconds": st.prompt_seconds,
            "generated_tokens": st.generated_tokens,
            "decode_seconds": st.decode_seconds,
            "decode_steps": st.decode_steps,
            "decode_rows": st.decode_rows,
            "active_fraction": frac,
            "draining": self._draining,
        }

    # ------------------------------------------------------------------------- worker
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and self._all_free():
                    self._cv.wait()
                if self._stop:
                    return
                admitted = self._pop_admissions()
            try:
                for slot, req in admitted:
                    self._admit(slot, req)
                self._step()
            except Exception as e:  # a bug outside any one session, or the engine's failure
                if isinstance(e, EngineUnavailable):
                    log.error("the engine is unavailable: %s", e)
                else:
                    log.exception("scheduler step failed")
                for s in self.slots:
                    if s.req is not None:
                        self._fail(s, e)

    def _all_free(self) -> bool:
        return all(s.req is None for s in self.slots)

    def _pop_admissions(self) -> list[tuple[Slot, Request]]:
        free = [s for s in self.slots if s.req is None]
        out = []
        while free and self._waiting:
            req = self._waiting.popleft()
            if req.cancelled:
                self.stats.outcomes["cancelled"] += 1
                continue
            slot = max(free, key=lambda s: (common_prefix(s.cached, req.prompt[:-1]), -s.last_used))
            free.remove(slot)
            slot.req = req  # reserved now, started by _admit
            out.append((slot, req))
        return out

    def _admit(self, slot: Slot, req: Request) -> None:
        slot.start(req, self.tokenizer)
        self.stats.cached_tokens += slot.keep
        log.debug("%r -> slot %d (%d cached tokens reused)", req, slot.index, slot.keep)
        if slot.budget <= 0 and not req.prompt_logprobs:  # scored prompts run, then finish
            self._finish(slot, "length")

    def _step(self) -> None:
        for s in self.slots:
            if s.req is not None and s.req.cancelled:
                self._release(s, "cancelled")
        prefilling = [s for s in self.slots if s.req is not None and s.pending]
        if prefilling:  # one chunk per prefilling slot (an engine may run them at once)
            self._prefill(prefilling)
        ready = [s for s in self.slots if s.req is not None and s.next_token is not None]
        if ready:
            self._decode(ready)

    def _pick(self, s: Slot) -> Pick:
        """How ``s`` picks its next token now (its grammar's mask computed here).

        Raises:
            RuntimeError: the grammar is in an error state or allows nothing.
        """
        req = s.req
        assert req is not None
        mask = allowed_tokens(req.constraint, self.args.n_vocab)
        return Pick(req.id, req.sampling, s.eog_ids, s.history, mask, req.logprobs, s.sampler)

    def _prefill(self, slots: list[Slot]) -> None:
        t0 = time.perf_counter()
        works, runs = [], []
        for s in slots:
            req = s.req
            assert req is not None
            chunk = s.pending[: self.prefill_chunk]
            start, last = s.cache.pos, len(chunk) == len(s.pending)
            score = None
            if req.prompt_logprobs:  # row i predicts the prompt's token at start + 1 + i
                score = Score(
                    tuple(req.prompt[start + 1 : start + 1 + len(chunk)]), req.logprobs or 0
                )
            try:
                draws = last and not (req.prompt_logprobs and s.budget <= 0)
                pick = self._pick(s) if draws else None
            except Exception as e:
                self._fail(s, e)
                continue
            works.append(Prefill(s.cache, chunk, pick, score))
            runs.append((s, start))
        results = self.engine.prefill(works, self.opts) if works else []
        for (s, start), w, out in zip(runs, works, results, strict=True):
            req = s.req
            assert req is not None
            if isinstance(out, Exception):
                self._fail(s, out)
                continue
            if req.prompt_logprobs:
                if start == 0:
                    s.scored.append(TokenLogprob(req.prompt[0], None))
                s.scored.extend(out.scored)
            s.cached.extend(w.tokens)
            s.pending = s.pending[len(w.tokens) :]
            self.stats.prompt_tokens += len(w.tokens)
            if not s.pending:
                if req.prompt_logprobs:
                    self._emit(req, PromptLogprobs(tuple(s.scored)))
                    if s.budget <= 0:
                        self._finish(s, "length")
                        continue
                self._accept(s, out.token, out.logprob)
        self.stats.prompt_seconds += time.perf_counter() - t0

    def _decode(self, ready: list[Slot]) -> None:
        t0 = time.perf_counter()
        run, picks = [], []
        for s in ready:
            try:
                picks.append(self._pick(s))
                run.append(s)
            except Exception as e:
                self._fail(s, e)
        if not run:
            return
        toks = [s.next_token for s in run]
        mode = self.batch_mode if len(run) > 1 else SEQUENTIAL
        results, steps = self.engine.decode([s.cache for s in run], toks, picks, self.opts, mode)
        self.stats.decode_steps += steps
        self.stats.decode_rows += len(run)
        for s, t, out in zip(run, toks, results, strict=True):
            if isinstance(out, Exception):
                self._fail(s, out)
                continue
            s.cached.append(t)
            s.next_token = None
            self._accept(s, out.token, out.logprob)
        self.stats.decode_seconds += time.perf_counter() - t0

    def _accept(self, s: Slot, tok: int | None, lp: TokenLogprob | None) -> None:
        """Take the token ``s`` drew and emit its text, or finish the request."""
        req = s.req
        assert req is not None and tok is not None
        lps = () if lp is None else (lp,)
        try:
            if req.constraint is not None:
                req.constraint.accept(tok)
        except Exception as e:
            self._fail(s, e)
            return
        s.n_gen += 1
        s.history.append(tok)
        self.stats.generated_tokens += 1
        if s.t_first is None:
            s.t_first = time.perf_counter()
        if self.tokenizer.is_eog(tok):
            text = s.stopper.push(s.decoder.flush())
            if s.stopper.matched is None:
                text += s.stopper.flush()
            self._emit(req, Delta(text, (tok,), lps))
            self._finish(s, "stop", eos=s.stopper.matched is None)
            return
        text = s.stopper.push(s.decoder.push(tok))
        if s.stopper.matched is None and (s.n_gen >= s.budget or s.cache.pos >= s.cache.n_ctx):
            text += s.stopper.push(s.decoder.flush())
            if s.stopper.matched is None:
                self._emit(req, Delta(text + s.stopper.flush(), (tok,), lps))
                self._finish(s, "length")
                return
        if req.constraint is not None and req.constraint.finished and s.stopper.matched is None:
            text += s.stopper.push(s.decoder.flush()) + s.stopper.flush()  # the grammar is done
            self._emit(req, Delta(text, (tok,), lps))
            self._finish(s, "stop", eos=True)
            return
        self._emit(req, Delta(text, (tok,), lps))
        if s.stopper.matched is not None:
            self._finish(s, "stop")
        else:
            s.next_token = tok

    # ------------------------------------------------------------------------- endings
    def _emit(self, req: Request | None, event: Event) -> None:
        if req is None or req.on_event is None:
            return
        try:
            req.on_event(event)
        except Exception:  # the listener is gone (e.g. its event loop closed): stop the request
            log.debug("%r: event listener failed; cancelling", req, exc_info=True)
            req.cancel()

    def _finish(self, s: Slot, reason: str, *, eos: bool = False) -> None:
        now = time.perf_counter()
        t_first = s.t_first or now
        assert s.req is not None
        self._emit(
            s.req,
            Finished(
                reason,
                prompt_tokens=len(s.req.prompt),
                completion_tokens=s.n_gen,
                cached_tokens=s.keep,
                stop_word=s.stopper.matched,
                eos=eos,
                slot=s.index,
                prompt_seconds=t_first - s.t0,
                decode_seconds=now - t_first,
            ),
        )
        self._release(s, reason)

    def _fail(self, s: Slot, exc: BaseException) -> None:
        if isinstance(exc, EngineUnavailable):  # the engine's fault, not the request's: a 503
            log.error("%r failed in slot %d: %s", s.req, s.index, exc)
            failed = Failed(f"the engine is unavailable: {exc}", 503, "engine_unavailable")
        else:
            log.error("%r failed in slot %d: %s", s.req, s.index, exc, exc_info=exc)
            failed = Failed(f"generation failed: {type(exc).__name__}: {exc}")
        self._emit(s.req, failed)
        s.cached = []  # the cache state is unknown
        s.cache.pos = 0
        self._release(s, "error")

    def _release(self, s: Slot, outcome: str) -> None:
        self.stats.outcomes[outcome] += 1
        s.req = None
        s.pending = []
        s.next_token = None
        s.last_used = time.perf_counter()
