"""The scheduler's engine over pipeline stages (:class:`PipelineEngine`).

The driver (the HTTP server, the tokenizer and the scheduler) sends token ids to the first
stage; each stage runs its layers and hands the residual stream to the next; the last one draws
the tokens. A decode step of B sequences runs as up to S micro-batches (S stages), so while the
second stage runs one the first runs the next; each prefilling sequence's chunk is its own.

Every step has a deadline. A stage that dies, or does not answer within it, ends the step with
:class:`StageError` (a 503 for the requests in it) and, unless restarts are on, the engine stays
failed: every later call fails at once and ``health`` names the stage. With restarts, the
driver waits for the stage to come back and re-runs each sequence's tokens, which it keeps
(``RemoteCache.tokens``), before the step is run again, so the sequences go on as if nothing
had happened (the same tokens, greedy; a seeded sampler starts again from its seed).

A :class:`Transport` carries the calls: stages in this process (:class:`LocalTransport`) or Ray
actors (``powerpy.cluster.actors``).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from powerpy.cluster.stage import PREFILL, Call, Head, Segment, Stage, StaleSequence, WirePick
from powerpy.config import ModelArgs
from powerpy.model.options import RunOptions
from powerpy.scheduler.local import SEQUENTIAL, EngineUnavailable, Prefill
from powerpy.scheduler.picks import Drawn, Pick, Score, pack_mask

log = logging.getLogger(__name__)

REPLAY_CHUNK = 512  # tokens a call when a sequence's tokens are run again
ATTEMPTS = 3  # runs of one step: the first, and after a stale stage or a restart


class StageError(EngineUnavailable):
    """A stage died or did not answer in time; ``detail`` names its index, host, layers and the
    error."""


@dataclass
class StageDown:
    """A transport's report of a stage that died (``timed_out`` False) or missed the deadline."""

    index: int
    error: str
    timed_out: bool = False


class Transport(Protocol):
    """How calls reach the stages. ``submit`` queues a stage's call on the result of the
    previous stage's (a handle, or None for the first stage); a stage runs its calls in the
    order they were submitted."""

    infos: list[dict[str, Any]]

    def submit(self, index: int, call: Call, prev: Any) -> Any: ...

    def gather(
        self, chains: list[list[Any]], timeout: float, abort: Callable[[], bool]
    ) -> list[Any]:
        """Each chain's last result, an exception a stage raised, or a ``StageDown``; a chain
        still running after ``timeout`` seconds (or when ``abort()`` turns true) is reported
        as a ``StageDown`` of its first unfinished stage."""
        ...

    def ping(self, timeout: float) -> list[dict[str, Any] | StageDown]: ...

    def recover(self, index: int, timeout: float, stuck: bool = False) -> dict[str, Any]:
        """Wait until stage ``index`` is back (restarted; ``stuck``: restart it first); its
        new info.

        Raises:
            TimeoutError, RuntimeError: it did not come back.
        """
        ...

    def close(self) -> None: ...


class LocalTransport:
    """Stages in this process, run one call at a time (tests, and a split on one machine)."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = list(stages)
        self.infos = [s.info() for s in self.stages]

    def submit(self, index: int, call: Call, prev: Any) -> Any:
        if isinstance(prev, BaseException):
            return prev
        try:
            return self.stages[index].run(call, prev)
        except Exception as e:
            return e

    def gather(self, chains, timeout, abort):
        return [chain[-1] for chain in chains]

    def ping(self, timeout: float) -> list[dict[str, Any] | StageDown]:
        return [s.ping() for s in self.stages]

    def recover(self, index: int, timeout: float, stuck: bool = False) -> dict[str, Any]:
        raise RuntimeError("a stage in this process cannot restart")

    def close(self) -> None:
        self.stages.clear()


@dataclass(eq=False)
class RemoteCache:
    """A sequence's KV caches, one on each stage, as the scheduler sees them.

    Attributes:
        seq: the sequence's id on the stages.
        n_ctx: positions.
        pos: positions filled (the scheduler may lower it to reuse a prefix).
        tokens: the token ids the stages ran, by position (what a restarted stage re-runs).
        valid: positions every stage holds (below ``pos`` only after a stage lost them).
        key: the sampler the last stage holds for it (a request's id).
    """

    seq: int
    n_ctx: int
    pos: int = 0
    tokens: list[int] = field(default_factory=list)
    valid: int = 0
    key: int | None = None


class PipelineEngine:
    """The engine of a model split into stages (``powerpy.scheduler.local.Engine``): use it as
    a ``Model`` in ``Scheduler(engine, tokenizer, engine.options)``.

    Args:
        transport: the stages.
        args: the whole model's hyperparameters.
        options: the run options the scheduler passes (the stages run with their own, from
            their load; these say sparse or dense).
        timeout: seconds a step (every micro-batch of it) may take before its stage counts as
            stuck.
        restart: wait for a dead stage to come back (Ray restarts it) and re-run the sequences
            instead of failing.
        restart_timeout: seconds a restarted stage may take to load.
        ping_timeout: seconds ``health`` waits for each stage's answer.
        tokenizer: the model's (for ``Scheduler(engine, engine.tokenizer, engine.options)``).

    Example (stages on Ray actors; ``in_process`` for stages in this process)::

        engine = powerpy.cluster.start_pipeline("m.gguf", parse_pipeline("pc1:0-39,pc2:40-79", 80))
        sched = Scheduler(engine, engine.tokenizer, engine.options, n_parallel=4)
    """

    def __init__(
        self,
        transport: Transport,
        args: ModelArgs,
        options: RunOptions,
        *,
        timeout: float = 120.0,
        restart: bool = False,
        restart_timeout: float = 1800.0,
        ping_timeout: float = 5.0,
        tokenizer: Any = None,
    ) -> None:
        self.transport, self.args, self.options = transport, args, options
        self.tokenizer = tokenizer
        self.timeout, self.restart, self.restart_timeout = timeout, restart, restart_timeout
        self.ping_timeout = ping_timeout
        self.n_stages = len(transport.infos)
        self._caches: weakref.WeakSet[RemoteCache] = weakref.WeakSet()
        self._released: list[int] = []
        self._next_seq = 0
        self._failure: StageError | None = None
        self._lock = threading.Lock()

    @classmethod
    def in_process(
        cls, path: str | os.PathLike[str], layers: Sequence[range], **load_options: Any
    ) -> PipelineEngine:
        """The stages ``layers`` of the model at ``path`` in this process (keywords of
        ``powerpy.load`` for each), as one engine."""
        stages = [Stage(path, r, index=i, load_options=load_options) for i, r in enumerate(layers)]
        llm = stages[0].llm
        args = ModelArgs.from_gguf(llm.file.base).with_ffn_act(load_options.get("ffn_act"))
        return cls(LocalTransport(stages), args, llm.options, tokenizer=llm.tokenizer)

    # ------------------------------------------------------------------------- engine
    @property
    def can_gate(self) -> bool:
        return all(i.get("can_gate", False) for i in self.transport.infos)

    @property
    def failure(self) -> StageError | None:
        return self._failure

    @property
    def stages(self) -> list[dict[str, Any]]:
        """Each stage's info (host, layers, digest, load time, placement)."""
        return list(self.transport.infos)

    def new_cache(self, n_ctx: int) -> RemoteCache:
        with self._lock:
            self._next_seq += 1
            cache = RemoteCache(self._next_seq, n_ctx)
            self._caches.add(cache)
        weakref.finalize(cache, self._released.append, cache.seq)  # forgotten with the next call
        return cache

    def prefill(self, works: Sequence[Prefill], opts: RunOptions) -> list[Drawn | Exception]:
        batches = [[_Row(w.cache, list(w.tokens), w.pick, w.score)] for w in works]
        return [r if isinstance(r, Exception) else r[0] for r in self._step(batches, PREFILL)]

    def decode(self, caches, tokens, picks, opts, mode):
        rows = [_Row(c, [t], p) for c, t, p in zip(caches, tokens, picks, strict=True)]
        m = min(self.n_stages, len(rows))  # micro-batches: the stages work on them at once
        size = -(-len(rows) // m)
        batches = [rows[i : i + size] for i in range(0, len(rows), size)]
        out: list[Drawn | Exception] = []
        for batch, result in zip(batches, self._step(batches, mode), strict=True):
            out += [result] * len(batch) if isinstance(result, Exception) else result
        return out, len(batches)

    def health(self) -> dict[str, Any] | None:
        """None while every stage answers its probe, else the stage, host, layers and error
        (a dead stage fails the engine unless restarts are on)."""
        if self._failure is not None:
            return self._failure.detail
        for i, r in enumerate(self.transport.ping(self.ping_timeout)):
            if isinstance(r, StageDown):
                err = self._error(r)
                if not r.timed_out and not self.restart:
                    self._failure = err
                return err.detail
            if r.get("incarnation") != self.transport.infos[i].get("incarnation"):
                self._restarted(i, r)
        return None

    def close(self) -> None:
        self.transport.close()

    # ------------------------------------------------------------------------- steps
    def _step(self, batches: list[list[_Row]], mode: str) -> list[list[Drawn] | Exception]:
        """Run each micro-batch through every stage; each one's results or exception."""
        results: list[Any] = [None] * len(batches)
        for _ in range(ATTEMPTS):
            if self._failure is not None:
                raise self._failure
            todo = [i for i, r in enumerate(results) if r is None or isinstance(r, _Retry)]
            if not todo:
                break
            self._replay([row for i in todo for row in batches[i]])
            chains = [self._chain(batches[i], mode) for i in todo]
            downed: set[int] = set()  # a stage's death fails every later chain through it
            for i, got in zip(todo, self._gather(chains), strict=True):
                results[i] = got
                if isinstance(got, StaleSequence):
                    self._invalidate(got.seqs)
                    results[i] = _Retry(got)
                elif isinstance(got, StageDown):
                    if got.index not in downed:
                        downed.add(got.index)
                        self._down(got)
                    results[i] = _Retry(self._error(got))
                elif not isinstance(got, Exception):
                    self._advance(batches[i])
        return [r.error if isinstance(r, _Retry) else r for r in results]

    def _chain(self, rows: list[_Row], mode: str) -> list[Call]:
        segs = tuple(Segment(r.cache.seq, r.cache.pos, len(r.tokens), r.cache.n_ctx) for r in rows)
        released = []
        while self._released:  # sequences the scheduler dropped (appended by finalizers)
            released.append(self._released.pop())
        heads = tuple(r.head() for r in rows)  # built now: a restart may have lost a sampler
        calls = []
        for i in range(self.n_stages):
            calls.append(
                Call(
                    segs,
                    mode if len(rows) > 1 or mode == PREFILL else SEQUENTIAL,
                    tokens=tuple(t for r in rows for t in r.tokens) if i == 0 else None,
                    heads=heads if i == self.n_stages - 1 else (),
                    release=tuple(released),
                )
            )
        return calls

    def _gather(self, chains: list[list[Call]]) -> list[Any]:
        handles = []
        for calls in chains:
            prev, hs = None, []
            for i, call in enumerate(calls):
                prev = self.transport.submit(i, call, prev)
                hs.append(prev)
            handles.append(hs)
        return self.transport.gather(handles, self.timeout, lambda: self._failure is not None)

    def _advance(self, rows: list[_Row]) -> None:
        for r in rows:
            c = r.cache
            del c.tokens[c.pos :]
            c.tokens += r.tokens
            c.pos = c.valid = len(c.tokens)
            if r.pick is not None:
                c.key = r.pick.key

    def _replay(self, rows: list[_Row]) -> None:
        """Re-run the tokens a stage lost (below each row's position) before the row runs."""
        lost = {
            id(r.cache): r.cache
            for r in rows
            if r.cache.valid < min(r.cache.pos, len(r.cache.tokens))
        }
        for c in lost.values():
            pos, tokens = c.pos, c.tokens[: c.pos]
            log.warning("sequence %d: re-running %d tokens on the stages", c.seq, pos - c.valid)
            while c.valid < pos:
                c.pos = c.valid
                chunk = tokens[c.valid : c.valid + REPLAY_CHUNK]
                (got,) = self._gather([self._chain([_Row(c, chunk)], PREFILL)])
                if isinstance(got, StageDown):
                    self._down(got)
                    c.pos = pos
                    raise self._error(got)
                if isinstance(got, Exception):
                    c.pos = pos
                    raise got
                c.valid += len(chunk)
            c.pos = pos

    # ------------------------------------------------------------------------- failures
    def _error(self, down: StageDown) -> StageError:
        info = self.transport.infos[down.index]
        what = "did not answer in time" if down.timed_out else "died"
        msg = (
            f"stage {down.index} (layers {info.get('layers')} on {info.get('host')}) {what}: "
            f"{down.error}"
        )
        detail = {
            "message": msg,
            "stage": down.index,
            "host": info.get("host"),
            "layers": info.get("layers"),
            "error": down.error,
        }
        return StageError(msg, detail)

    def _down(self, down: StageDown) -> None:
        """A stage died or hangs: wait for its restart, or fail the engine."""
        err = self._error(down)
        log.error("%s", err)
        if not self.restart:
            self._failure = err
            raise err
        try:
            info = self.transport.recover(down.index, self.restart_timeout, down.timed_out)
        except Exception as e:
            self._failure = StageError(f"{err}; it did not come back: {e}", err.detail)
            raise self._failure from None
        self._restarted(down.index, info)

    def _restarted(self, index: int, info: dict[str, Any]) -> None:
        log.warning("stage %d is back (%s): its sequences will be re-run", index, info.get("host"))
        with self._lock:
            self.transport.infos[index] = {**self.transport.infos[index], **info}
            caches = list(self._caches)
        for c in caches:
            c.valid = 0
            if index == self.n_stages - 1:
                c.key = None

    def _invalidate(self, seqs: tuple[int, ...]) -> None:
        with self._lock:
            caches = [c for c in self._caches if c.seq in seqs]
        for c in caches:
            c.valid, c.key = 0, None


@dataclass
class _Row:
    """One sequence's tokens in a step, and what the last stage takes from its logits."""

    cache: RemoteCache
    tokens: list[int]
    pick: Pick | None = None
    score: Score | None = None

    def head(self) -> Head | None:
        if self.pick is None and self.score is None:
            return None
        return Head(None if self.pick is None else _wire(self.cache, self.pick), self.score)


@dataclass
class _Retry:
    error: Exception


def _wire(cache: RemoteCache, pick: Pick) -> WirePick:
    """``pick`` for the last stage: its sampler's settings and history only when the stage
    does not hold its sampler."""
    start = None
    if cache.key != pick.key:
        start = (pick.sampling, tuple(pick.eog_ids), tuple(pick.history))
    return WirePick(pick.key, pack_mask(pick.mask), pick.logprobs, start)
