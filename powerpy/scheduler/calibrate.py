"""Whether batching the decode steps of several sessions pays, measured on this machine.

One forward over B tokens reads every dense matrix once instead of B times, but the sparse FFN
of a PWRI model then needs the union of the B tokens' active rows (or a dense masked pass), which
can cost more than B separate gathers. Which wins depends on the model, its sparsity, the
weight format and the CPU, so the server times a few decode steps each way at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from powerpy.model.options import RunOptions
from powerpy.model.transformer import FFN_MODES, Model

log = logging.getLogger(__name__)

SEQUENTIAL = "off"  # one forward per session
MIN_GAIN = 1.1  # batch only when it is at least this much faster


def candidate_modes(model: Model, opts: RunOptions) -> list[str]:
    """The batching modes worth timing: the FFN modes only differ for a gated (sparse) FFN."""
    if opts.sparse and model.can_gate:
        return [SEQUENTIAL, *FFN_MODES]
    return [SEQUENTIAL, "batch"]


def time_decode(
    model: Model, opts: RunOptions, n: int, mode: str, *, steps: int = 3, n_ctx: int = 48
) -> float:
    """Aggregate tokens/s of ``steps`` decode steps of ``n`` fresh sessions in ``mode``."""
    opts = dataclasses.replace(opts, stats=None, timer=None, observer=None)
    n_vocab = model.args.n_vocab
    caches = [model.new_cache(min(n_ctx, model.args.n_ctx_train)) for _ in range(n)]
    toks = []
    for i, c in enumerate(caches):  # a short distinct prompt per session
        prompt = torch.tensor([(7 * i + j * 13 + 1) % n_vocab for j in range(8)])
        toks.append(int(model.forward(prompt, c, opts)[-1].argmax()))
    dt = 0.0
    for step in range(steps + 1):  # the first step warms up
        t0 = time.perf_counter()
        if mode == SEQUENTIAL:
            pairs = zip(toks, caches, strict=True)
            logits = torch.cat([model.forward(torch.tensor([t]), c, opts) for t, c in pairs])
        else:
            logits = model.decode_batch(torch.tensor(toks), caches, opts, ffn_mode=mode)
        if step:
            dt += time.perf_counter() - t0
        toks = [int(t) for t in logits.argmax(-1)]
    return n * steps / max(dt, 1e-9)


def choose_batch_mode(
    model: Model, opts: RunOptions, n: int, *, rounds: int = 2
) -> tuple[str, dict[str, float]]:
    """The fastest way to run one decode step of ``n`` sessions, and the tok/s of each way.

    Returns ``(mode, rates)``: ``mode`` is ``"off"`` (one forward per session) unless a batched
    mode (``powerpy.model.transformer.FFN_MODES``) is at least ``MIN_GAIN`` times faster.
    """
    modes = candidate_modes(model, opts)
    if n < 2:
        return SEQUENTIAL, {}
    rates = dict.fromkeys(modes, 0.0)
    for _ in range(rounds):  # interleaved rounds, best of each: robust to a noisy neighbour
        for m in modes:
            rates[m] = max(rates[m], time_decode(model, opts, n, m))
    best = max(rates, key=rates.get)
    if rates[best] < MIN_GAIN * rates[SEQUENTIAL]:
        best = SEQUENTIAL
    log.info(
        "decode of %d sessions: %s tok/s -> batching %s",
        n,
        ", ".join(f"{m} {r:.0f}" for m, r in rates.items()),
        best,
    )
    return best, rates
