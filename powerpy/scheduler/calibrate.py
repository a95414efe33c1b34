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

from powerpy.model.options import RunOptions
from powerpy.model.transformer import FFN_MODES, Model
from powerpy.scheduler.local import SEQUENTIAL, Engine, LocalEngine, Prefill
from powerpy.scheduler.picks import Drawn, greedy

log = logging.getLogger(__name__)

MIN_GAIN = 1.1  # batch only when it is at least this much faster


def candidate_modes(engine: Engine, opts: RunOptions) -> list[str]:
    """The batching modes worth timing: the FFN modes only differ for a gated (sparse) FFN."""
    if opts.sparse and engine.can_gate:
        return [SEQUENTIAL, *FFN_MODES]
    return [SEQUENTIAL, "batch"]


def time_decode(
    engine: Engine, opts: RunOptions, n: int, mode: str, *, steps: int = 3, n_ctx: int = 48
) -> float:
    """Aggregate tokens/s of ``steps`` greedy decode steps of ``n`` fresh sessions in ``mode``."""
    opts = dataclasses.replace(opts, stats=None, timer=None, observer=None)
    n_vocab = engine.args.n_vocab
    caches = [engine.new_cache(min(n_ctx, engine.args.n_ctx_train)) for _ in range(n)]
    picks = [greedy(-1 - i) for i in range(n)]  # a short distinct prompt per session
    works = [
        Prefill(c, [(7 * i + j * 13 + 1) % n_vocab for j in range(8)], picks[i])
        for i, c in enumerate(caches)
    ]
    toks = [_token(d) for d in engine.prefill(works, opts)]
    dt = 0.0
    for step in range(steps + 1):  # the first step warms up
        t0 = time.perf_counter()
        drawn, _ = engine.decode(caches, toks, picks, opts, mode)
        if step:
            dt += time.perf_counter() - t0
        toks = [_token(d) for d in drawn]
    return n * steps / max(dt, 1e-9)


def _token(d: Drawn | Exception) -> int:
    if isinstance(d, Exception):
        raise d
    assert d.token is not None
    return d.token


def choose_batch_mode(
    engine: Engine | Model, opts: RunOptions, n: int, *, rounds: int = 2
) -> tuple[str, dict[str, float]]:
    """The fastest way to run one decode step of ``n`` sessions on ``engine`` (or a model in
    this process), and the tok/s of each way.

    Returns ``(mode, rates)``: ``mode`` is ``"off"`` (one forward per session) unless a batched
    mode (``powerpy.model.transformer.FFN_MODES``) is at least ``MIN_GAIN`` times faster.
    """
    engine = LocalEngine(engine) if isinstance(engine, Model) else engine
    modes = candidate_modes(engine, opts)
    if n < 2:
        return SEQUENTIAL, {}
    rates = dict.fromkeys(modes, 0.0)
    for _ in range(rounds):  # interleaved rounds, best of each: robust to a noisy neighbour
        for m in modes:
            rates[m] = max(rates[m], time_decode(engine, opts, n, m))
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
