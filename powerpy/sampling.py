"""Token sampling in llama.cpp's order: penalties → top-k → top-p → min-p → temperature → draw."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

Sampler = Callable[[Tensor, Sequence[int]], int]  # (logits (n_vocab,), history) -> token id


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options; the defaults are llama.cpp's."""

    temperature: float = 0.8  # <= 0: greedy
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # >= 1: off
    min_p: float = 0.05  # <= 0: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64
    seed: int | None = None  # None: nondeterministic


def apply_repeat_penalty(logits: Tensor, history: Sequence[int], penalty: float) -> Tensor:
    """Divide positive and multiply negative logits of tokens seen in ``history``."""
    if penalty == 1.0 or not history:
        return logits
    ids = torch.tensor(sorted(set(history)), dtype=torch.long)
    seen = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def filter_logits(logits: Tensor, top_k: int, top_p: float, min_p: float) -> Tensor:
    """Set the logits of tokens outside top-k / top-p / min-p to -inf (1-D logits)."""
    out = logits.clone()
    if 0 < top_k < out.numel():
        kth = torch.topk(out, top_k).values[-1]
        out[out < kth] = -float("inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = torch.cumsum(probs, dim=-1) - probs >= top_p
        out[order[drop]] = -float("inf")
    if min_p > 0.0:
        probs = torch.softmax(out, dim=-1)
        out[probs < min_p * probs.max()] = -float("inf")
    return out


def make_sampler(params: SamplingParams) -> Sampler:
    """Return a sampler closure with its own seeded generator."""
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)

    def sample(logits: Tensor, history: Sequence[int]) -> int:
        logits = logits.float()
        recent = list(history[-params.repeat_last_n :]) if params.repeat_last_n else []
        logits = apply_repeat_penalty(logits, recent, params.repeat_penalty)
        if params.temperature <= 0:
            return int(torch.argmax(logits))
        logits = filter_logits(logits, params.top_k, params.top_p, params.min_p)
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if not bool(torch.isfinite(probs).all()):  # huge finite logits overflowed when scaled
            probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    return sample
