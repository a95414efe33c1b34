"""Token log-probabilities: the log-softmax of the model's raw logits (before logit bias,
penalties, temperature or a grammar mask), as OpenAI and llama-server report them.

The scheduler computes them on its worker thread for requests that ask (``Request.logprobs``,
``Request.prompt_logprobs``); the HTTP layer only formats them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

MAX_TOP_LOGPROBS = 20  # alternatives per position (llama-server's and vLLM's limit)


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token, its log-probability (None for a prompt's first token, which
    nothing predicts) and the ``top`` most likely tokens there, most likely first."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def _top(row: Tensor, k: int) -> tuple[tuple[int, float], ...]:
    if k <= 0:
        return ()
    values, ids = torch.topk(row, min(k, row.numel()))
    return tuple(zip(ids.tolist(), values.tolist(), strict=True))


def sampled_logprob(logits: Tensor, token: int, k: int) -> TokenLogprob:
    """The entry of ``token`` sampled from ``logits`` (n_vocab,), with ``k`` alternatives."""
    row = torch.log_softmax(logits.float(), dim=-1)
    return TokenLogprob(token, float(row[token]), _top(row, k))


def prompt_logprobs(logits: Tensor, next_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """Entries of the tokens ``next_ids`` that follow the positions of ``logits`` (T, n_vocab):
    row ``i`` predicts ``next_ids[i]``."""
    rows = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(next_ids), dtype=torch.long)
    chosen = rows.gather(1, ids[:, None])[:, 0].tolist()
    if k > 0:
        values, top_ids = torch.topk(rows, min(k, rows.shape[1]), dim=-1)
        tops = [
            tuple(zip(i, v, strict=True))
            for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)
        ]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(next_ids, chosen, tops, strict=True)]
