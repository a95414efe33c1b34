"""The sparsity trade-off: perplexity against the share of FFN neurons skipped.

Two curves, each from one perplexity pass over the text per setting (``perplexity.perplexity``,
llama.cpp's method):

- ``sparsity_sweep``: the shipped predictors at several thresholds (what a user can run).
- ``oracle_sweep``: an ideal predictor that keeps, per token and layer, the neurons with the
  largest ``|h_j| · ‖ffn_down_t[j]‖`` (the profiler's SiLU score), at a fixed skipped share. It
  bounds what any predictor could reach at that share.

``SweepResult.skipped_at(0.03)`` reads the curve at +3% perplexity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from powerpy import _html
from powerpy.model.numerics import DEFAULT as DEFAULT_NUMERICS
from powerpy.model.numerics import Numerics
from powerpy.model.options import Oracle, RunOptions
from powerpy.model.transformer import Model
from powerpy.pipeline.perplexity import PerplexityResult, perplexity
from powerpy.pipeline.profile import KIND_RELU, activation_kind, down_norms, magnitude_score

DEFAULT_THRESHOLDS = (-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0)
DEFAULT_SKIPS = (0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
DEFAULT_CUT_SCALES = (0.5, 1.0, 1.5, 2.0)
KINDS = ("predictors", "oracle", "cut")
_HEADS = {"predictors": "threshold", "oracle": "oracle", "cut": "cut scale"}


@dataclass(frozen=True)
class SweepPoint:
    """One setting of a sweep."""

    setting: float  # predictor threshold, the oracle's skipped share, or the cut's scale
    ppl: float
    skipped: float  # mean fraction of FFN neurons skipped per token
    increase: float  # ppl / dense ppl - 1


@dataclass
class SweepResult:
    """A perplexity-vs-skipped-share curve of one model on one text.

    Attributes:
        model: the model's name (for titles).
        kind: "predictors" (settings are thresholds), "oracle" (skipped shares) or "cut"
            (scales of the file's cuts, ``RunOptions.cut_scale``).
        dense_ppl: the dense run's perplexity, the reference of ``increase``.
        points: one per setting, in the order run.
        n_scored, ctx, n_chunks: what each perplexity run scored.
    """

    model: str
    kind: str
    dense_ppl: float
    points: list[SweepPoint] = field(default_factory=list)
    n_scored: int = 0
    ctx: int = 0
    n_chunks: int = 0

    @property
    def skipped(self) -> npt.NDArray[np.float64]:
        """(n,) skipped shares, in run order."""
        return np.array([p.skipped for p in self.points])

    @property
    def increase(self) -> npt.NDArray[np.float64]:
        """(n,) perplexity increases over dense (0.03 = +3%), in run order."""
        return np.array([p.increase for p in self.points])

    def skipped_at(self, max_increase: float = 0.03) -> float:
        """The skipped share where the curve reaches ``max_increase``, linearly interpolated.

        The curve starts at the dense run (nothing skipped, no increase) and is walked in
        order of skipped share; the first crossing counts. When no point crosses, the largest
        skipped share measured is returned (the curve's end, a lower bound).
        """
        pts = sorted(((p.skipped, p.increase) for p in self.points), key=lambda p: p[0])
        prev = (0.0, 0.0)
        for s, inc in pts:
            if inc > max_increase:
                (s0, i0) = prev
                return s0 + (s - s0) * (max_increase - i0) / (inc - i0) if inc != i0 else s0
            prev = (s, inc)
        return prev[0]

    def table(self) -> str:
        """The sweep as a plain-text table (what ``powerpy perplexity --sweep`` prints)."""
        head = _HEADS[self.kind]
        lines = [f"{head:>10}{'skipped':>10}{'PPL':>11}{'vs dense':>10}"]
        lines.append(f"{'dense':>10}{'0.0%':>10}{self.dense_ppl:>11.4f}{'-':>10}")
        for p in self.points:
            setting = _setting(self.kind, p.setting)
            lines.append(
                f"{setting:>10}{_html.pct(p.skipped):>10}{p.ppl:>11.4f}{100 * p.increase:>+9.2f}%"
            )
        lines.append(
            f"skipped at +3% perplexity: {_html.pct(self.skipped_at(0.03))} "
            f"({self.n_chunks} chunks x {self.ctx} tokens, {self.n_scored} scored)"
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<SweepResult {self.model} ({self.kind}): {len(self.points)} points, "
            f"{100 * self.skipped_at(0.03):.1f}% skipped at +3% perplexity>"
        )

    def _repr_html_(self) -> str:
        rows = [("dense", "0.0%", f"{self.dense_ppl:.4f}", "-")]
        rows += [
            (
                _setting(self.kind, p.setting),
                _html.pct(p.skipped),
                f"{p.ppl:.4f}",
                f"{100 * p.increase:+.2f}%",
            )
            for p in self.points
        ]
        head = _HEADS[self.kind]
        note = f"skipped at +3% perplexity: {_html.pct(self.skipped_at(0.03))}"
        title = f"{self.model}: perplexity vs skipped FFN neurons ({self.kind})"
        return _html.table(title, (head, "skipped", "PPL", "vs dense"), rows, notes=[note])


def _setting(kind: str, value: float) -> str:
    if kind == "cut":
        return f"{value:g}x"
    return f"{value:+.2f}" if kind == "predictors" else _html.pct(value, 0)


def topk_oracle(model: Model, skip: float) -> Oracle:
    """An oracle keeping, per token and layer, the ``1 - skip`` share of neurons with the
    largest ``|h_j| · ‖ffn_down_t[j]‖`` (and, in ReLU models, never an exact zero).

    Raises:
        ValueError: ``skip`` outside [0, 1).
    """
    if not 0.0 <= skip < 1.0:
        raise ValueError(f"oracle skipped share {skip} must be in [0, 1)")
    norms = down_norms(model)
    relu = activation_kind(model) == KIND_RELU
    keep = max(1, round((1.0 - skip) * model.args.n_ff))

    def oracle(l: int, h: torch.Tensor) -> torch.Tensor:  # h (T, n_ff) -> (T, n_ff) bool
        top = magnitude_score(h, norms[l]).topk(keep, dim=1).indices  # (T, keep)
        mask = torch.zeros(h.shape, dtype=torch.bool).scatter_(1, top, True)
        return mask & (h != 0) if relu else mask

    return oracle


def _sweep(
    model: Model,
    ids: Sequence[int] | npt.NDArray[np.integer],
    kind: str,
    settings: Sequence[float],
    name: str,
    dense: PerplexityResult | None,
    progress: bool,
    numerics: Numerics,
    **kwargs,
) -> SweepResult:
    if not settings:
        raise ValueError("a sweep needs at least one setting")
    if any(math.isnan(s) for s in settings):
        raise ValueError(f"sweep settings {list(settings)} contain NaN")
    if dense is None:
        opts = RunOptions(sparse=False, numerics=numerics)
        dense = perplexity(model, ids, opts=opts, desc="dense", progress=progress, **kwargs)
    res = SweepResult(name, kind, dense.ppl, [], dense.n_scored, dense.ctx, dense.n_chunks)
    for s in settings:
        if kind == "oracle":
            opts = RunOptions(sparse=False, oracle=topk_oracle(model, s), numerics=numerics)
        elif kind == "cut":
            opts = RunOptions(cut_scale=s, numerics=numerics)
        else:
            opts = RunOptions(threshold=s, numerics=numerics)
        r = perplexity(model, ids, opts=opts, desc=f"{kind} {s:g}", progress=progress, **kwargs)
        skipped = 0.0 if r.sparsity is None else r.sparsity
        res.points.append(SweepPoint(float(s), r.ppl, skipped, r.ppl / dense.ppl - 1.0))
    return res


def sparsity_sweep(
    model: Model,
    ids: Sequence[int] | npt.NDArray[np.integer],
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    *,
    name: str = "",
    dense: PerplexityResult | None = None,
    progress: bool = False,
    numerics: Numerics = DEFAULT_NUMERICS,
    **kwargs,
) -> SweepResult:
    """Perplexity and skipped share of the model's predictors at each threshold.

    Args:
        model: a model with predictors (PWRI).
        ids: the held-out text's tokens.
        thresholds: predictor thresholds (lower keeps more neurons).
        name: the model's name, for titles.
        dense: a dense run of the same text and settings to reuse (None: run it).
        progress: tqdm bars.
        numerics: how every run computes (``RunOptions.numerics``; the sweeps below too).
        **kwargs: ``ctx``, ``chunks``, ``bos_id`` of :func:`perplexity.perplexity`.

    Raises:
        ValueError: a model without predictors, no thresholds, or bad perplexity settings.
    """
    if not model.can_gate:
        raise ValueError("the model has no predictors (a dense GGUF): sweep a PWRI model")
    return _sweep(model, ids, "predictors", thresholds, name, dense, progress, numerics, **kwargs)


def oracle_sweep(
    model: Model,
    ids: Sequence[int] | npt.NDArray[np.integer],
    skips: Sequence[float] = DEFAULT_SKIPS,
    *,
    name: str = "",
    dense: PerplexityResult | None = None,
    progress: bool = False,
    numerics: Numerics = DEFAULT_NUMERICS,
    **kwargs,
) -> SweepResult:
    """The same curve for the top-k oracle (:func:`topk_oracle`) at each skipped share.

    Works on any model, dense or PWRI. Arguments as for :func:`sparsity_sweep`.
    """
    for s in skips:
        if not 0.0 <= s < 1.0:
            raise ValueError(f"oracle skipped share {s} must be in [0, 1)")
    return _sweep(model, ids, "oracle", skips, name, dense, progress, numerics, **kwargs)


def cut_sweep(
    model: Model,
    ids: Sequence[int] | npt.NDArray[np.integer],
    scales: Sequence[float] = DEFAULT_CUT_SCALES,
    *,
    name: str = "",
    dense: PerplexityResult | None = None,
    progress: bool = False,
    numerics: Numerics = DEFAULT_NUMERICS,
    **kwargs,
) -> SweepResult:
    """The same curve for the file's per-layer cuts (``powerpy.ffn_down_threshold``) scaled by
    each factor (``RunOptions.cut_scale``; 1 is the file's point). Arguments as for
    :func:`sparsity_sweep`.

    Raises:
        ValueError: a model without cuts, no scales, or bad perplexity settings.
    """
    if not any(
        b.down_tau is not None or (b.moe is not None and b.moe.tau is not None)
        for b in model.weights.blk
    ):
        raise ValueError("the model has no cuts (powerpy.ffn_down_threshold): nothing to sweep")
    for s in scales:
        RunOptions(cut_scale=s)  # its check, before any run
    return _sweep(model, ids, "cut", scales, name, dense, progress, numerics, **kwargs)
