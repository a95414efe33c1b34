"""What a client asks of the scheduler, and what it hears back.

A :class:`Request` carries prompt token ids, a token budget, sampling settings and stop strings;
the scheduler calls its ``on_event`` (from its worker thread) with :class:`Delta` records of new
text, then one :class:`Finished` or :class:`Failed`. Stop strings never leak: text that could be
the start of a stop string is held back until it is known not to be one (:class:`StopMatcher`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from powerpy.sampling import Sampler, SamplingParams, apply_repeat_penalty, make_sampler
from powerpy.scheduler.logprobs import TokenLogprob

_ids = itertools.count(1)


@dataclass(frozen=True)
class Sampling:
    """How a request picks its tokens: ``SamplingParams`` plus the OpenAI / llama.cpp extras.

    Attributes:
        params: temperature, top-k/p, min-p, repeat penalty and window, seed.
        presence_penalty: subtracted once from the logit of every token in the window.
        frequency_penalty: subtracted per occurrence in the window.
        logit_bias: token id -> value added to its logit (-100 bans, +100 forces).
        ignore_eos: never sample an end-of-generation token.
    """

    params: SamplingParams = SamplingParams()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False


def build_sampler(s: Sampling, eog_ids: Sequence[int] = ()) -> Sampler:
    """A sampler for ``s``, in llama.cpp's order: logit bias, penalties (repeat, frequency,
    presence, over the last ``repeat_last_n`` tokens), then ``make_sampler``'s chain."""
    extras = s.presence_penalty or s.frequency_penalty or s.logit_bias or s.ignore_eos
    if not extras:
        return make_sampler(s.params)
    p = s.params
    base = make_sampler(dataclasses.replace(p, repeat_penalty=1.0))  # penalties applied here
    bias_ids = torch.tensor(list(s.logit_bias), dtype=torch.long)
    bias_vals = torch.tensor(list(s.logit_bias.values()), dtype=torch.float32)
    banned = torch.tensor(sorted(eog_ids), dtype=torch.long) if s.ignore_eos else None

    def sample(logits: Tensor, history: Sequence[int]) -> int:
        logits = logits.float().clone()
        if bias_ids.numel():
            logits[bias_ids] += bias_vals
        if banned is not None and banned.numel():
            logits[banned] = -math.inf
        recent = list(history[-p.repeat_last_n :]) if p.repeat_last_n else []
        logits = apply_repeat_penalty(logits, recent, p.repeat_penalty)
        if recent and (s.presence_penalty or s.frequency_penalty):
            counts = Counter(recent)
            ids = torch.tensor(list(counts), dtype=torch.long)
            n = torch.tensor(list(counts.values()), dtype=torch.float32)
            logits[ids] -= n * s.frequency_penalty + s.presence_penalty
        return base(logits, history)

    return sample


class Constraint(Protocol):
    """A request's grammar state (:class:`powerpy.structured.Constraint` is one)."""

    def apply(self, logits: Tensor) -> Tensor:
        """The logits with what the grammar forbids at -inf."""
        ...

    def accept(self, token: int) -> None:
        """Follow the sampled token."""
        ...

    @property
    def finished(self) -> bool:
        """Nothing but the end may follow."""
        ...


# ----------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Delta:
    """New text of a request (may be empty when only tokens arrived), its token ids and, when
    the request asked (``Request.logprobs``), their log-probabilities."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's own tokens with their log-probabilities (the first has none), sent before
    any :class:`Delta` when ``Request.prompt_logprobs`` is set."""

    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Finished:
    """The end of a request.

    Attributes:
        reason: "stop" (end-of-generation token or stop string) or "length" (token budget or
            context full).
        prompt_tokens: tokens of the prompt; ``cached_tokens`` of them were reused from the
            slot's KV cache and not run again.
        completion_tokens: tokens sampled.
        stop_word: the stop string that ended it, if one did.
        eos: an end-of-generation token ended it.
        slot: the session slot that ran it.
        prompt_seconds, decode_seconds: time to the first token, and after it.
    """

    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    stop_word: str | None = None
    eos: bool = False
    slot: int = -1
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0


@dataclass(frozen=True)
class Failed:
    """The request failed inside the engine (the other requests go on): an HTTP ``status``
    and error ``code`` for the server (503 ``engine_unavailable``: the engine cannot run)."""

    message: str
    status: int = 500
    code: str = "generation_failed"


Event = Delta | PromptLogprobs | Finished | Failed


class Request:
    """One generation: prompt ids, budget, sampling, stop strings and where events go.

    ``on_event`` is called from the scheduler's worker thread, so it must not block (an asyncio
    server passes ``loop.call_soon_threadsafe``). ``cancel()`` may be called from any thread;
    the request's slot is freed before its next token.
    """

    def __init__(
        self,
        prompt: Sequence[int],
        max_tokens: int = -1,
        sampling: Sampling | None = None,
        stop: Sequence[str] = (),
        on_event: Callable[[Event], None] | None = None,
        *,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        constraint: Constraint | None = None,
    ) -> None:
        """Args: ``prompt`` token ids (non-empty); ``max_tokens`` the most tokens to sample
        (-1: until the context is full, 0: none); ``sampling``; ``stop`` strings;
        ``on_event`` the callback (None: events are dropped); ``logprobs``: report each
        sampled token's log-probability with this many alternatives (None: off);
        ``prompt_logprobs``: also score the prompt's tokens (its whole prompt then runs, the
        slot's cached prefix is not reused); ``constraint``: this request's own grammar state
        (:class:`Constraint`), which masks every step's logits."""
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        self.id = next(_ids)
        self.prompt = list(prompt)
        self.max_tokens = max_tokens
        self.sampling = sampling or Sampling()
        self.stop = [s for s in stop if s]
        self.on_event = on_event
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.constraint = constraint
        self.cancelled = False

    def cancel(self) -> None:
        """Stop this request at its next token (or drop it from the queue)."""
        self.cancelled = True

    def __repr__(self) -> str:
        return f"Request(#{self.id}, {len(self.prompt)} prompt tokens, max {self.max_tokens})"


class StopMatcher:
    """Cuts streamed text at the first stop string and holds back possible beginnings of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """The text that is now safe to emit; after a match, ``matched`` is the stop string
        and the text before it is returned (what follows is dropped)."""
        if not self.stops:
            return text
        self.pending += text
        best = None
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            out, self.matched, self.pending = self.pending[: best[0]], best[1], ""
            return out
        hold = 0  # the longest suffix of pending that starts some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        """The held-back text, at the end of generation."""
        out, self.pending = self.pending, ""
        return out
