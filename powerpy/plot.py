"""Figures of what sparsity does, for notebooks and ``--plot FILE.png``.

    from powerpy import plot
    plot.power_law(prof)                 # sorted activation frequency per layer (log-log)
    plot.coverage_vs_budget(llm, prof)   # GPU-served share of activations vs VRAM budget
    plot.predictor_quality(report)       # recall / precision / predicted vs true active
    plot.tradeoff(sweep, oracle)         # perplexity increase vs skipped share
    plot.phases(bench)                   # decode ms per token by phase, sparse vs dense

Every function returns a matplotlib ``Figure`` (rendered inline in Jupyter, saved with
``fig.savefig`` or :func:`save`) and takes ``ax=`` to draw into an existing axes instead.
Figures are made without pyplot, so nothing global changes and no window opens. matplotlib comes
with the ``plot`` extra (``pip install 'powerpy[plot]'``) and is imported on the first call.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from powerpy._fs import atomic_write
from powerpy.errors import PowerpyError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from powerpy.benchmark import BenchResult
    from powerpy.pipeline.profile import ProfileResult
    from powerpy.pipeline.sweep import SweepResult
    from powerpy.pipeline.train import TrainReport
    from powerpy.placement.coverage import CoverageCurve

FORMATS = ("png", "pdf", "svg")
MANY_LAYERS = 10  # above this, layers get a colour bar instead of a legend
MAX_INCREASE_SHOWN = 1000.0  # % perplexity increase at the top of the tradeoff axes
PHASES = ("attention", "predictor", "ffn", "output", "other")  # tg time, in bar order


class PlotError(PowerpyError):
    """matplotlib is missing, or a plot's input or output is unusable."""


def available() -> bool:
    """matplotlib can be imported."""
    return importlib.util.find_spec("matplotlib") is not None


def _require() -> None:
    if not available():
        raise PlotError("plots need matplotlib: pip install 'powerpy[plot]'")
    if "ipykernel" in sys.modules:  # Jupyter: make Figure objects render inline
        try:
            importlib.import_module("matplotlib_inline.backend_inline")
        except ImportError:  # an old kernel: figures still save, they just do not render
            pass


def _axes(ax: Axes | None, size: tuple[float, float] = (7.0, 4.2)) -> tuple[Figure, Axes]:
    _require()
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained", dpi=110)
    return fig, fig.add_subplot()


def _layer_colours(fig: Figure, ax: Axes, n_layer: int) -> list[Any]:
    """One colour per layer from viridis; a colour bar labelled "layer" when there are many."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    cmap = colormaps["viridis"]
    norm = Normalize(0, max(1, n_layer - 1))
    if n_layer > MANY_LAYERS:
        bar = fig.colorbar(ScalarMappable(norm, cmap), ax=ax, pad=0.01)
        bar.set_label("layer")
    return [cmap(norm(l)) for l in range(n_layer)]


def _title(ax: Axes, model: str, what: str) -> None:
    ax.set_title(f"{model}: {what}" if model else what, fontsize=11)


# ----------------------------------------------------------------------------------- figures
def power_law(
    prof: ProfileResult, *, ax: Axes | None = None, top: float = 0.1, title: str | None = None
) -> Figure:
    """Each layer's neurons sorted by activation frequency, on log-log axes.

    The y values of layer ``l`` are ``sorted(counts[l], descending) / n_tokens``; the dashed
    line marks the top ``top`` share of neurons, and the box says how much of the activations
    they carry (``ProfileResult.top_coverage``).
    """
    fig, ax = _axes(ax)
    n_layer, n_ff = len(prof.counts), len(prof.counts[0])
    colours = _layer_colours(fig, ax, n_layer)
    rank = np.arange(1, n_ff + 1)
    for l, c in enumerate(prof.counts):
        freq = np.sort(np.asarray(c))[::-1] / max(1, prof.n_tokens)
        ax.plot(rank, freq, color=colours[l], lw=1.2, label=f"layer {l}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    cut = max(1, round(top * n_ff))
    ax.axvline(cut, color="0.3", ls="--", lw=1)
    cov = prof.top_coverage(top)
    rule = "h ≠ 0" if prof.kind == "relu" else "|h|·‖down‖ > layer threshold"
    ax.text(
        0.02,
        0.04,
        f"{prof.n_tokens} tokens; active: {rule}\n"
        f"top {100 * top:g}% of neurons (rank ≤ {cut}) carry\n"
        f"{100 * cov.mean():.1f}% of activations (layers {100 * cov.min():.0f}–"
        f"{100 * cov.max():.0f}%)",
        transform=ax.transAxes,
        fontsize=9,
        va="bottom",
        bbox={"boxstyle": "round", "fc": "white", "ec": "0.7"},
    )
    ax.set_xlabel("neuron rank in its layer (most active first)")
    ax.set_ylabel("activation frequency (share of tokens)")
    _title(ax, prof.model, title or "activation power law")
    if n_layer <= MANY_LAYERS:
        ax.legend(fontsize=8, ncol=2, loc="upper right")
    ax.grid(True, which="major", alpha=0.3)
    return fig


def coverage_vs_budget(
    model: Any,
    prof: ProfileResult | Sequence[Any] | None = None,
    *,
    ax: Axes | None = None,
    budgets: Sequence[int] | None = None,
    n_ctx: int | None = None,
    share: float = 0.8,
    mark: int | None = None,
) -> Figure:
    """The share of activations the GPU serves, against the VRAM budget.

    Args:
        model: a ``CoverageCurve`` (then ``prof`` is not needed), an ``LLM``, an open
            ``GGUFFile`` or a path to a PowerInfer model.
        prof: the profile (or per-layer counts) whose activations are counted.
        ax: draw here instead of a new figure.
        budgets: budgets in bytes (default: 16 from the dense part to the whole model).
        n_ctx: KV cache context the budget holds (default: the model's, at most 2048).
        share: the coverage level to mark (default 80%).
        mark: a budget in bytes to mark (e.g. the one ``gen-gpuidx`` solved).
    """
    curve = _coverage(model, prof, budgets, n_ctx)
    fig, ax = _axes(ax)
    mib = 2**30 if curve.full_bytes > 4 * 2**30 else 2**20
    unit = "GiB" if mib == 2**30 else "MiB"
    x = curve.budgets / mib
    ax.axvspan(0, curve.dense_bytes / mib, color="0.9", zorder=0)
    ax.text(
        curve.dense_bytes / mib / 2,
        50,
        "dense tensors\n+ KV cache",
        ha="center",
        va="center",
        fontsize=8,
        color="0.35",
    )
    ax.plot(x, 100 * curve.coverage, "o-", color="C0", ms=4, lw=1.5)
    at = curve.budget_for(share)
    if at is not None:
        ax.axhline(100 * share, color="C3", ls="--", lw=1)
        ax.plot([at / mib], [100 * share], "o", color="C3")
        ax.annotate(
            f"{100 * share:g}% at {at / mib:.3g} {unit}",
            (at / mib, 100 * share),
            xytext=(8, -16),
            textcoords="offset points",
            color="C3",
            fontsize=9,
        )
    if mark is not None:
        ax.axvline(mark / mib, color="C2", lw=1.2)
        ax.annotate(
            "budget",
            (mark / mib, 2),
            xytext=(4, 0),
            textcoords="offset points",
            color="C2",
            fontsize=9,
        )
    ax.set_xlim(0, curve.full_bytes / mib * 1.02)
    ax.set_ylim(0, 102)
    ax.set_xlabel(f"VRAM budget ({unit})")
    ax.set_ylabel("activations served by the GPU (%)")
    _title(ax, curve.model, "GPU-served share of FFN activations vs VRAM budget")
    ax.grid(True, alpha=0.3)
    return fig


def _coverage(model: Any, prof: Any, budgets: Any, n_ctx: int | None) -> CoverageCurve:
    from powerpy.formats.gguf_reader import GGUFFile, read_gguf
    from powerpy.placement.coverage import CoverageCurve, coverage_curve

    if isinstance(model, CoverageCurve):
        return model
    if prof is None:
        raise PlotError("coverage_vs_budget needs the profile whose activations it counts")
    counts = getattr(prof, "counts", prof)
    name = getattr(model, "name", None)
    gf = getattr(model, "file", model)
    if isinstance(gf, str | os.PathLike):
        with read_gguf(gf) as f:
            return _coverage(f, counts, budgets, n_ctx)
    if not isinstance(gf, GGUFFile):
        raise PlotError(f"coverage_vs_budget takes an LLM, a GGUF file or a path, not {gf!r}")
    if n_ctx is None:
        from powerpy.config import ModelArgs

        n_ctx = ModelArgs.from_gguf(gf).default_n_ctx
    return coverage_curve(gf, counts, budgets, n_ctx=n_ctx, name=name)


def predictor_quality(report: TrainReport, *, ax: Axes | None = None) -> Figure:
    """Per layer: the predictors' recall and precision on held-out tokens, and the predicted
    against the true active share (all in %)."""
    if not report.layers:
        raise PlotError("the predictor report has no layers")
    fig, ax = _axes(ax)
    layers = [r.layer for r in report.layers]
    series = (
        ("recall", [r.recall for r in report.layers], "C0", "o-"),
        ("precision", [r.precision for r in report.layers], "C1", "s-"),
        ("predicted active", [r.pred_active for r in report.layers], "C2", "^--"),
        ("true active", [r.true_active for r in report.layers], "0.3", "v:"),
    )
    for label, ys, colour, style in series:
        ax.plot(layers, 100 * np.asarray(ys), style, color=colour, label=label, ms=4, lw=1.3)
    ax.set_ylim(0, 102)
    ax.set_xlabel("layer")
    ax.set_ylabel("share (%)")
    if len(layers) <= 16:
        ax.set_xticks(layers)
    thr = f", threshold {report.threshold:g}" if report.threshold is not None else ""
    _title(ax, report.model, f"predictor quality on held-out tokens{thr}")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(True, alpha=0.3)
    return fig


def tradeoff(*sweeps: SweepResult, ax: Axes | None = None, max_increase: float = 0.03) -> Figure:
    """Perplexity increase over dense against the share of FFN neurons skipped, one line per
    sweep (e.g. the predictors and the oracle, or two models), with the +3% line marked.

    The x axis is the share of neurons still computed, on a log scale that runs from 100%
    (dense, left) down, so a ReLU model at 99% skipped and a SiLU model at 40% are both
    readable. The y axis is linear up to +10% and logarithmic above, so the useful range and
    the collapse at high sparsity both show; lines above +1000% leave the axes at the top.
    """
    if not sweeps or not all(s.points for s in sweeps):
        raise PlotError("tradeoff needs at least one sweep with points")
    fig, ax = _axes(ax)
    styles = ("o-", "s--", "^-", "v--", "D-", "P--")
    models = {s.model for s in sweeps}
    lowest, highest, bottom = 100.0, 0.0, -1.0
    for i, s in enumerate(sweeps):
        order = np.argsort(s.skipped)
        kept = 100 * (1 - np.concatenate([[0.0], s.skipped[order]]))  # % computed
        ys = 100 * np.concatenate([[0.0], s.increase[order]])
        label = s.kind if len(models) == 1 else f"{s.model} ({s.kind})"
        at = s.skipped_at(max_increase)
        bound = "" if (s.increase > max_increase).any() else "≥ "  # never crossed: the end
        label += f": {bound}{100 * at:.1f}% skipped at +{100 * max_increase:g}% PPL"
        kept = np.maximum(kept, 0.01)  # every neuron skipped: show at the axis end
        ax.plot(kept, ys, styles[i % len(styles)], color=f"C{i}", ms=4, lw=1.4, label=label)
        ax.plot([100 * (1 - at)], [100 * max_increase], "o", color=f"C{i}", mfc="white", ms=8)
        lowest, highest = min(lowest, kept.min()), max(highest, ys.max())
        bottom = min(bottom, ys.min())
    ax.axhline(100 * max_increase, color="C3", ls=":", lw=1)
    ax.set_xscale("log")
    left, right = 100 * 1.15, max(0.01, lowest / 1.5)
    ax.set_xlim(left, right)  # inverted: more skipped to the right
    from matplotlib.ticker import FuncFormatter, NullFormatter

    percent = FuncFormatter(lambda v, _: f"{v:g}%")
    ax.xaxis.set_major_formatter(percent)

    # less than about a decade shown: label the 20% ... 60% ticks too, in the same style (70%,
    # 80%, 90% would crowd 100% on a log axis)
    def minor(v: float, _) -> str:
        lead = round(v / 10 ** math.floor(math.log10(v))) if v > 0 else 0
        return f"{v:g}%" if 2 <= lead <= 6 else ""

    ax.xaxis.set_minor_formatter(FuncFormatter(minor) if left / right < 20 else NullFormatter())
    ax.tick_params(axis="x", which="minor", length=3.5)  # labels level with the major ones
    ax.set_yscale("symlog", linthresh=10, linscale=2)
    top = min(max(20.0, highest * 1.5), MAX_INCREASE_SHOWN)  # steeper lines leave at the top
    ax.set_ylim(1.2 * bottom, top)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g}%" if v else "0"))
    ax.set_xlabel("FFN neurons kept per token (log scale)")
    ax.set_ylabel("perplexity increase over dense")
    _title(ax, sweeps[0].model if len(models) == 1 else "", "perplexity vs sparsity")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="both", alpha=0.25)
    return fig


def phases(bench: BenchResult, *, ax: Axes | None = None) -> Figure:
    """Decode time per token split by phase (attention, predictor, FFN, output, other), one bar
    per measured mode, with tokens per second at the end of each bar."""
    rows = [r for r in (bench.tg("sparse"), bench.tg("dense")) if r is not None]
    if not rows:
        raise PlotError("the bench result has no token-generation rows (run it with n_gen > 0)")
    fig, ax = _axes(ax, (7.0, 2.0 + 0.7 * len(rows)))
    for y, r in enumerate(rows):
        ms = phase_ms(r.phases_ms)
        left = 0.0
        for i, name in enumerate(PHASES):
            w = ms[name]
            ax.barh(y, w, left=left, color=f"C{i}", label=name if y == 0 else None, height=0.6)
            left += w
        ax.text(left, y, f"  {r.tok_s:.1f} tok/s", va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), [f"{r.mode}\n{_active(r)}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, max(sum(phase_ms(r.phases_ms).values()) for r in rows) * 1.25)
    ax.set_xlabel("ms per token")
    _title(ax, bench.model, f"decode time by phase ({bench.threads} threads)")
    ax.legend(fontsize=8, ncol=len(PHASES), loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def _active(r: Any) -> str:
    return f"{100 * r.active_fraction:.0f}% active"


def phase_ms(phases_ms: dict[str, float]) -> dict[str, float]:
    """The bar's segments from a tg row's timer: the predictor is timed inside the FFN, so the
    FFN segment is the FFN without it; hybrid sub-phases are inside the FFN too."""
    ms = {k: float(phases_ms.get(k, 0.0)) for k in PHASES}
    ms["ffn"] = max(0.0, ms["ffn"] - ms["predictor"])
    return ms


# ----------------------------------------------------------------------------------- saving
def save(fig: Figure, path: str | os.PathLike[str], *, dpi: int = 150) -> Path:
    """Write ``fig`` to ``path`` atomically (a crash or Ctrl-C leaves the old file or none).

    The format comes from the suffix (.png, .pdf, .svg).

    Raises:
        PlotError: an unknown suffix. FileNotFoundError: the directory does not exist.
    """
    p = Path(path)
    check_path(p)
    with atomic_write(p) as tmp:
        fig.savefig(tmp, format=p.suffix[1:].lower(), dpi=dpi)
    return p


def check_path(path: str | os.PathLike[str]) -> None:
    """Fail early on an output a figure cannot be written to (before long work)."""
    p = Path(path)
    if p.suffix[1:].lower() not in FORMATS:
        raise PlotError(f"plot file {p}: use a .png, .pdf or .svg name")
    if not p.parent.is_dir():
        raise FileNotFoundError(f"plot file {p}: directory {p.parent} does not exist")
    if p.is_dir():
        raise IsADirectoryError(f"plot file {p} is a directory")
