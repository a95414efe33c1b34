"""One pipeline stage: layers [first, end) of a model, the KV caches of those layers for every
sequence, and on the last stage the sequences' samplers.

A :class:`Stage` runs in any process; ``powerpy.cluster.actors`` makes it a Ray actor. Each
:class:`Call` names its sequences with their cache positions, so the driver alone decides what a
cache holds (it lowers a position to reuse a prefix). The first stage takes token ids, the others
the residual stream of the stage before; a stage before the last returns the residual stream
(T, n_embd) f32 as a numpy array, the last one a ``picks.Drawn`` per sequence: logits never
leave it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from powerpy.model.stage import layer_span
from powerpy.scheduler.local import SEQUENTIAL
from powerpy.scheduler.picks import Drawn, Pick, Score, take, unpack_mask
from powerpy.scheduler.request import Sampling

log = logging.getLogger(__name__)

PREFILL = "prefill"  # a Call's mode for a prompt chunk (else a decode batching mode)


@dataclass(frozen=True)
class Segment:
    """One sequence's tokens in a call: ``n`` at cache position ``pos``; its cache holds
    ``n_ctx`` positions (made when the sequence first runs, at position 0)."""

    seq: int
    pos: int
    n: int
    n_ctx: int


@dataclass(frozen=True)
class WirePick:
    """A ``picks.Pick`` as the last stage receives it: the sampler's settings and history only
    when the stage does not hold the sampler of ``key`` yet (``start``), the mask in bits."""

    key: int
    mask: tuple[int, bytes] | None = None
    logprobs: int | None = None
    start: tuple[Sampling, tuple[int, ...], tuple[int, ...]] | None = None  # settings, eog, ids


@dataclass(frozen=True)
class Head:
    """What the last stage takes from one segment's logits."""

    pick: WirePick | None = None
    score: Score | None = None


@dataclass(frozen=True)
class Call:
    """One forward on a stage: a prompt chunk of one sequence (``mode`` PREFILL) or one token of
    each sequence (a decode batching mode: ``SEQUENTIAL`` or an FFN mode)."""

    segments: tuple[Segment, ...]
    mode: str
    tokens: tuple[int, ...] | None = None  # the first stage's input
    heads: tuple[Head | None, ...] = ()  # the last stage's, one per segment
    release: tuple[int, ...] = ()  # sequences to forget first


class StaleSequence(RuntimeError):
    """The stage does not hold what a call assumes (it restarted): the driver re-runs these
    sequences' tokens, then the call."""

    def __init__(self, seqs: tuple[int, ...]) -> None:
        super().__init__(f"sequences {list(seqs)} are not in this stage's caches (restarted?)")
        self.seqs = seqs


class StageMismatch(ValueError):
    """This stage's copy of the model file is not the driver's."""


class Stage:
    """Layers ``layers`` of the model file at ``path``, loaded as ``powerpy.load`` loads a
    model (``load_options``: its keywords, ``vram_budget`` included, for this stage's own
    placement), with its KV caches per sequence.

    Args:
        path: this machine's copy of the model.
        layers: the stage's layers.
        index: the stage's place in the pipeline (for messages).
        digest: what ``StageFile.digest`` must give for the driver's copy (None: not checked).
        threads: torch threads (0: torch's default).
        load_options: keywords of ``powerpy.load``.

    Raises:
        StageMismatch: the file's digest is not ``digest``.
        FileNotFoundError, ValueError: as ``powerpy.load``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layers: range,
        *,
        index: int = 0,
        digest: str | None = None,
        threads: int = 0,
        load_options: dict[str, Any] | None = None,
    ) -> None:
        from powerpy.api import load

        t0 = time.perf_counter()
        if threads > 0:
            torch.set_num_threads(threads)
        self.index, self.layers, self.path = index, layers, Path(path)
        self.llm = load(path, layers=layers, **(load_options or {}))
        self.model = self.llm.model
        self.opts = self.llm.options  # with its statistics, as a whole model's server has
        self.first, self.last = self.llm.file.ends
        self.digest = self.llm.file.digest()
        if digest is not None and digest != self.digest:
            raise StageMismatch(
                f"{path} on {socket.gethostname()}: layers {layer_span(layers)} differ from the "
                f"driver's copy of the model (digest {self.digest[:12]}, expected "
                f"{digest[:12]}): copy the same file to every machine"
            )
        self.caches: dict[int, Any] = {}  # seq -> KVCache of this stage's layers
        self.picks: dict[int, Pick] = {}  # seq -> its sampler (last stage)
        self.incarnation = uuid.uuid4().hex  # a restarted stage is another one
        self.load_seconds = time.perf_counter() - t0

    def info(self) -> dict[str, Any]:
        """Where and what this stage is (``/health`` and ``powerpy plan`` print it)."""
        rt = self.llm.runtime
        return {
            "index": self.index,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "layers": layer_span(self.layers),
            "digest": self.digest,
            "incarnation": self.incarnation,
            "load_seconds": round(self.load_seconds, 3),
            "threads": torch.get_num_threads(),
            "can_gate": self.model.can_gate,
            "placement": None if rt is None else rt.summary(),
        }

    def run(self, call: Call, x: np.ndarray | None = None) -> np.ndarray | list[Drawn]:
        """Run ``call`` on the residual stream ``x`` (T, n_embd) f32 of the stage before (the
        first stage reads ``call.tokens``): the residual stream after this stage's layers, or
        on the last stage one ``Drawn`` per segment.

        Raises:
            StaleSequence: a segment continues a sequence this stage does not hold, or a pick
                names a sampler it does not hold; nothing ran.
            ValueError: a call that does not fit (a full cache, a bad mode or input).
        """
        for seq in call.release:
            self.caches.pop(seq, None)
            self.picks.pop(seq, None)
        picks = self._picks(call) if self.last else []
        stale = [s.seq for s in call.segments if s.pos > 0 and s.seq not in self.caches]
        stale += [s.seq for s, p in zip(call.segments, picks, strict=False) if p is False]
        if stale:
            raise StaleSequence(tuple(sorted(set(stale))))
        caches = [self._cache(s) for s in call.segments]
        inp = torch.tensor(call.tokens, dtype=torch.long) if self.first else _tensor(x)
        if inp is None or inp.shape[0] != sum(s.n for s in call.segments):
            raise ValueError(f"stage {self.index}: the input does not match the call's tokens")
        if call.mode == PREFILL:
            if len(caches) != 1:
                raise ValueError("a prompt chunk is one sequence's")
            score = self.last and call.heads[0] is not None and call.heads[0].score is not None
            out = self.model.forward(inp, caches[0], self.opts, all_logits=not self.last or score)
            rows = [out]
        elif len(caches) > 1 and call.mode != SEQUENTIAL:
            out = self.model.decode_batch(inp, caches, self.opts, ffn_mode=call.mode)
            rows = list(out.split(1))
        else:
            rows = [self.model.forward(inp[i : i + 1], c, self.opts) for i, c in enumerate(caches)]
            out = torch.cat(rows)
        if not self.last:  # numpy crosses Ray's wire faster than a tensor (zero-copy)
            return out.contiguous().numpy()
        drawn = []
        for row, head, pick in zip(rows, call.heads, picks, strict=True):
            d = take(row, pick or None, None if head is None else head.score)
            if pick:
                pick.history.append(d.token)
            drawn.append(d)
        return drawn

    def _cache(self, s: Segment):
        cache = self.caches.get(s.seq)
        if cache is None or cache.n_ctx != s.n_ctx:
            cache = self.caches[s.seq] = self.model.new_cache(s.n_ctx)
        cache.pos = s.pos
        return cache

    def _picks(self, call: Call) -> list[Pick | None | bool]:
        """Each segment's sampler with this call's mask (False: a sampler it does not hold)."""
        out: list[Pick | None | bool] = []
        for s, head in zip(call.segments, call.heads, strict=True):
            wp = None if head is None else head.pick
            if wp is None:
                out.append(None)
                continue
            pick = self.picks.get(s.seq)
            if wp.start is not None:
                sampling, eog, history = wp.start
                pick = self.picks[s.seq] = Pick(wp.key, sampling, eog, list(history))
            elif pick is None or pick.key != wp.key:
                out.append(False)
                continue
            pick.mask, pick.logprobs = unpack_mask(wp.mask), wp.logprobs
            out.append(pick)
        return out

    def ping(self) -> dict[str, Any]:
        """The liveness probe: this stage's identity (a restarted stage has a new one)."""
        return {"index": self.index, "incarnation": self.incarnation, "pid": os.getpid()}


def _tensor(x: np.ndarray | None) -> Tensor | None:
    """The residual stream as a tensor (a private copy where Ray's array is read-only)."""
    if x is None:
        return None
    return torch.from_numpy(x if x.flags.writeable else x.copy())
