"""Perplexity the way llama.cpp's ``perplexity`` example computes it.

The token stream is cut into non-overlapping chunks of ``ctx`` tokens, taken from the start. Each
chunk runs in a fresh context; when the model adds a BOS token, the chunk's first token is
replaced by BOS (llama.cpp does the same). Only the second half is scored: the logits at
positions ``ctx/2 … ctx-2`` predict the tokens at ``ctx/2+1 … ctx-1``, so every scored token
sees at least ``ctx/2`` tokens of context. ``PPL = exp(mean NLL)`` over all scored tokens.

The first half runs as one prefill that keeps only the last logits, the second half as a second
call through the same KV cache, so the full-vocabulary logits are computed only where scored.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from tqdm.auto import tqdm

from powerpy.model.numerics import DEFAULT as DEFAULT_NUMERICS
from powerpy.model.numerics import Numerics
from powerpy.model.options import SPARSE, RunOptions, SparsityStats
from powerpy.model.transformer import Model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PerplexityResult:
    """Perplexity of one run over a token stream."""

    ppl: float
    nll: float  # mean negative log-likelihood (nats) per scored token
    n_scored: int  # tokens scored
    n_chunks: int
    ctx: int
    sparse: bool  # the predictors gated the FFN
    active_fraction: float | None  # mean predicted-active FFN fraction (sparse runs), else None
    layer_active: npt.NDArray[np.float64] | None  # (n_layer,) per-layer fraction, sparse runs

    @property
    def sparsity(self) -> float | None:
        """Mean fraction of FFN neurons skipped per token (sparse runs), else None."""
        return None if self.active_fraction is None else 1.0 - self.active_fraction


def n_chunks_for(n_tokens: int, ctx: int, chunks: int | None) -> int:
    """Chunks that fit: ``min(chunks, n_tokens // ctx)``.

    Raises:
        ValueError: ``ctx`` < 4, ``chunks`` < 1, or the text is shorter than one chunk.
    """
    if ctx < 4 or ctx % 2:
        raise ValueError(f"context {ctx} must be an even number of at least 4 tokens")
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunk count {chunks} must be positive")
    n = n_tokens // ctx
    if n == 0:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than one {ctx}-token chunk")
    return n if chunks is None else min(n, chunks)


@torch.inference_mode()
def chunk_nll(model: Model, tokens: torch.Tensor, opts: RunOptions = SPARSE) -> torch.Tensor:
    """Per-token NLL of the scored half of one chunk.

    Args:
        model: the model.
        tokens: (ctx,) int64 chunk, BOS already in place.
        opts: run options (dense or sparse, threshold, statistics).

    Returns:
        (ctx/2 - 1,) float64 NLL of tokens ``ctx/2+1 … ctx-1``.
    """
    ctx = tokens.shape[0]
    first = ctx // 2
    cache = model.new_cache(ctx)
    model.forward(tokens[:first], cache, opts)  # prefill; only the last logits are computed
    logits = model.forward(tokens[first:], cache, opts, all_logits=True)  # (ctx - first, n_vocab)
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)  # positions first … ctx-2
    target = tokens[first + 1 :]  # (ctx - first - 1,)
    return -logp.gather(1, target[:, None]).squeeze(1)


def perplexity(
    model: Model,
    ids: Sequence[int] | npt.NDArray[np.integer],
    *,
    ctx: int = 512,
    chunks: int | None = None,
    bos_id: int | None = None,
    progress: bool = False,
    desc: str = "perplexity",
    opts: RunOptions = SPARSE,
) -> PerplexityResult:
    """Perplexity of ``model`` over a token stream (llama.cpp method, see the module docstring).

    Args:
        model: the model.
        ids: the whole text's tokens (without any added BOS).
        ctx: chunk length (even).
        chunks: at most this many chunks (None: all that fit).
        bos_id: when set, each chunk's first token is replaced by it.
        progress: show a tqdm bar with the running perplexity.
        desc: the bar's label.
        opts: run options: dense, or predictor-gated (the default, where the model has
            predictors) at ``opts.threshold``, or gated by ``opts.oracle``.

    Returns:
        A ``PerplexityResult``; its sparsity counts every token run (both halves).

    Raises:
        ValueError: bad ``ctx``/``chunks``, a text shorter than one chunk, or a chunk longer than
            the model's training context.
    """
    arr = np.asarray(ids, dtype=np.int64)
    n = n_chunks_for(len(arr), ctx, chunks)
    if ctx > model.args.n_ctx_train:
        raise ValueError(
            f"context {ctx} exceeds the model's training context {model.args.n_ctx_train}"
        )
    sparse = (opts.sparse and model.can_gate) or opts.oracle is not None  # FFN gated
    stats = SparsityStats.empty(model.args.n_layer, model.args.ffn_neurons)
    opts = dataclasses.replace(opts, sparse=sparse, stats=stats)
    total, count = 0.0, 0
    bar = tqdm(range(n), desc=desc, unit="chunk", disable=not progress)
    for i in bar:
        tokens = torch.from_numpy(arr[i * ctx : (i + 1) * ctx].copy())
        if bos_id is not None:
            tokens[0] = bos_id
        nll = chunk_nll(model, tokens, opts)
        total += float(nll.sum())
        count += nll.numel()
        bar.set_postfix(ppl=f"{math.exp(total / count):.4f}")
    frac = layer = None
    if sparse:
        layer = stats.active_fraction().astype(np.float64)
        frac = float(np.nanmean(layer))
    mean = total / count
    log.debug("ppl %.4f over %d tokens in %d chunks (sparse=%s)", math.exp(mean), count, n, sparse)
    return PerplexityResult(math.exp(mean), mean, count, n, ctx, sparse, frac, layer)


def compare_dense_sparse(
    model: Model,
    ids: Sequence[int] | npt.NDArray[np.integer],
    *,
    threshold: float | None = None,
    numerics: Numerics = DEFAULT_NUMERICS,
    **kwargs,
) -> tuple[PerplexityResult, PerplexityResult | None]:
    """Perplexity of the dense run and, where the model has predictors, the sparse run.

    Args:
        model: the model.
        ids: tokens, as for :func:`perplexity`.
        threshold: the predictor threshold of the sparse run (None: the file's).
        numerics: how both runs compute (``RunOptions.numerics``).
        **kwargs: passed to :func:`perplexity`.

    Returns:
        ``(dense, sparse)``; ``sparse`` is None for a model without predictors.
    """
    dense_opts = RunOptions(sparse=False, numerics=numerics)
    dense = perplexity(model, ids, desc="dense", opts=dense_opts, **kwargs)
    sparse = None
    if model.can_gate:
        opts = RunOptions(threshold=threshold, numerics=numerics)
        sparse = perplexity(model, ids, desc="sparse", opts=opts, **kwargs)
    return dense, sparse
