"""What the scheduler asks of a segment's logits, and what comes back: the next token (a
:class:`Pick`), the prompt's log-probabilities (a :class:`Score`), as one :class:`Drawn`.

An engine (``powerpy.scheduler.local``) computes them where the logits are: in this process for
a local model, on the last stage for a pipeline (``powerpy.cluster``), so logits never leave the
process that made them. :func:`take` is the one implementation both use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from powerpy.sampling import Sampler
from powerpy.scheduler.logprobs import TokenLogprob, prompt_logprobs, sampled_logprob
from powerpy.scheduler.request import Constraint, Sampling, build_sampler


@dataclass
class Pick:
    """How one sequence picks its next token from its last logits.

    Attributes:
        key: the request whose sampler this is (a new key starts a new sampler).
        sampling: its settings (seeded samplers are built once per request and key).
        eog_ids: the end-of-generation tokens (``ignore_eos`` bans them).
        history: the prompt and the tokens so far, which the penalties read.
        mask: (n_vocab,) bool, the tokens its grammar allows now (None: every token).
        logprobs: report the token's log-probability with this many alternatives (None: no).
        sampler: the sampler of ``key`` in this process (built on first use).
    """

    key: int
    sampling: Sampling
    eog_ids: tuple[int, ...] = ()
    history: list[int] = field(default_factory=list)
    mask: Tensor | None = None
    logprobs: int | None = None
    sampler: Sampler | None = None

    def draw(self, logits: Tensor) -> tuple[int, TokenLogprob | None]:
        """The token drawn from ``logits`` (n_vocab,) and, when asked, its log-probability
        (of the raw logits, before the mask, the penalties and the temperature)."""
        if self.sampler is None:
            self.sampler = build_sampler(self.sampling, self.eog_ids)
        allowed = logits
        if self.mask is not None:
            allowed = logits.float().masked_fill(~self.mask[: logits.shape[-1]], -math.inf)
        tok = self.sampler(allowed, self.history)
        lp = None if self.logprobs is None else sampled_logprob(logits, tok, self.logprobs)
        return tok, lp


@dataclass(frozen=True)
class Score:
    """Score a prompt chunk: row i of its logits predicts ``following[i]`` (with ``top``
    alternatives); a chunk's last row predicts nothing when the prompt ends there."""

    following: tuple[int, ...]
    top: int = 0


@dataclass(frozen=True)
class Drawn:
    """What a segment's logits gave: the next token (None: no pick was asked), its entry, and
    the prompt entries of a :class:`Score`."""

    token: int | None = None
    logprob: TokenLogprob | None = None
    scored: tuple[TokenLogprob, ...] = ()


def take(logits: Tensor, pick: Pick | None, score: Score | None = None) -> Drawn:
    """``pick`` from the last row of ``logits`` (T, n_vocab), ``score`` from its rows."""
    scored: tuple[TokenLogprob, ...] = ()
    if score is not None and score.following:
        rows = logits[: len(score.following)]
        scored = tuple(prompt_logprobs(rows, score.following, score.top))
    if pick is None:
        return Drawn(scored=scored)
    tok, lp = pick.draw(logits[-1])
    return Drawn(tok, lp, scored)


def allowed_tokens(constraint: Constraint | None, n_vocab: int) -> Tensor | None:
    """(n_vocab,) bool: what ``constraint`` allows as the next token (None: everything).

    Raises:
        RuntimeError: the grammar is in an error state or allows nothing.
    """
    if constraint is None:
        return None
    allowed = torch.isfinite(constraint.apply(torch.zeros(n_vocab)))
    return None if bool(allowed.all()) else allowed


def pack_mask(mask: Tensor | None) -> tuple[int, bytes] | None:
    """A token mask as (length, bits): 1 bit a token for the wire."""
    if mask is None:
        return None
    return mask.numel(), np.packbits(mask.numpy(), bitorder="little").tobytes()


def unpack_mask(packed: tuple[int, bytes] | None) -> Tensor | None:
    """The inverse of :func:`pack_mask`."""
    if packed is None:
        return None
    n, bits = packed
    flags = np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little")[:n]
    return torch.from_numpy(flags.astype(np.bool_))


def greedy(key: int, history: Sequence[int] = ()) -> Pick:
    """A greedy pick (calibration, tests)."""
    from powerpy.sampling import SamplingParams

    return Pick(key, Sampling(SamplingParams(temperature=0)), history=list(history))
