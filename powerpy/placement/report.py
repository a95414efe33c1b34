"""The placement report: one set of rows, printed as text (``gen-gpuidx``, ``infer``) or shown
as HTML in a notebook (``Placement._repr_html_``).

The functions take a ``Placement`` (``placement.placement``); this module does not import it, so
the placement can import this one lazily.
"""

from __future__ import annotations

from typing import Any

from powerpy import _html
from powerpy._fs import fmt_bytes
from powerpy.placement.budget import ATTN, FFN_NORM, HOT_FFN, KV, OUTPUT, PREDICTOR

SUMMARY_CATEGORIES = (ATTN, PREDICTOR, FFN_NORM, OUTPUT, KV, HOT_FFN)
_MODE_LABELS = {"upstream": "powerinfer"}  # the --capacity-model flag's name for the mode


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / max(whole, 1):.1f}%"


def category_rows(p: Any) -> list[tuple[str, int, str]]:
    """``(category, accelerator bytes, detail)`` per summary category."""
    counts: dict[str, tuple[int, int]] = {}
    for e in p.plan.entries:
        if e.category in SUMMARY_CATEGORIES:
            placed, total = counts.get(e.category, (0, 0))
            counts[e.category] = (placed + e.on_gpu, total + 1)
    by_cat = p.bytes_by_category
    all_neurons = p.n_ff * p.n_layer
    rows = []
    for cat in SUMMARY_CATEGORIES:
        if cat == KV:
            what = "on the accelerator" if p.kv_on_gpu else "host"
            detail = f"{what}, n_ctx {p.n_ctx}, {p.kv_elem_bytes} B/value"
        elif cat == HOT_FFN:
            detail = f"{p.n_hot}/{all_neurons} neurons ({_pct(p.n_hot, all_neurons)})"
        else:
            placed, total = counts.get(cat, (0, 0))
            detail = f"{placed}/{total} tensors"
        rows.append((cat, by_cat[cat], detail))
    return rows


def detail_lines(p: Any) -> list[str]:
    """The index, how it was solved, notes and the reason for an empty split."""
    f = fmt_bytes
    lines = []
    if p.index is not None:
        lines.append(
            f"index made for {f(p.index.vram_capacity)}; split budget {f(p.plan.split_budget)}"
        )
    if p.solve is not None:
        s = p.solve
        lines.append(
            f"capacity   {s.capacity} neurons "
            f"({_MODE_LABELS.get(s.capacity_mode, s.capacity_mode)} mode, "
            f"{p.ffn.neuron_bytes[0]} bytes/neuron, batch {s.batch}, threshold {s.threshold})"
        )
        if s.method is not None:
            lines.append(
                f"solver     {s.method}{'' if s.optimal else ' (not proven optimal)'} in "
                f"{s.seconds:.3f} s ({s.total_seconds:.3f} s with export)"
            )
    lines.extend(f"note: {n}" for n in p.notes)
    if p.empty_reason:
        lines.append(f"empty placement: {p.empty_reason}")
    return lines


def layer_rows(p: Any) -> list[tuple[str, int, str, int, str]]:
    """``(layer, hot neurons, share of neurons, bytes, coverage)`` per layer, then the total."""
    cov = p.coverage
    rows = [
        (
            str(i),
            lp.k,
            _pct(lp.k, lp.n_ff),
            lp.hot_bytes,
            f"{100 * cov[i]:.2f}%" if cov is not None else "-",
        )
        for i, lp in enumerate(p.layers)
    ]
    total_cov = f"{100 * p.total_coverage:.2f}%" if p.total_coverage is not None else "-"
    total = p.n_ff * p.n_layer
    rows.append(("total", p.n_hot, _pct(p.n_hot, total), p.hot_bytes, total_cov))
    return rows


def summary_text(p: Any, device: str | None = None) -> str:
    """The text report (``Placement.summary``)."""
    f = fmt_bytes
    where = f" on {device}" if device else ""
    lines = [f"placement{where}: budget {f(p.budget)}, used {f(p.used)}, left {f(p.remaining)}"]
    lines += [f"  {cat:<10} {f(b):>11}  {detail}" for cat, b, detail in category_rows(p)]
    lines += [f"  {line}" for line in detail_lines(p)]
    if p.index is not None:
        lines.append(
            f"  {'layer':>5} {'hot':>8} {'GPU % of neurons':>17} {'bytes':>14} {'coverage':>9}"
        )
        lines += [f"  {l:>5} {k:>8} {s:>17} {b:>14} {c:>9}" for l, k, s, b, c in layer_rows(p)]
    lines.append(f"  hot rows   {p.hot_bytes} bytes; remaining budget {p.remaining} bytes")
    return "\n".join(lines)


def summary_html(p: Any) -> str:
    """The HTML report (``Placement._repr_html_``): categories, then layers."""
    f = fmt_bytes
    title = f"placement: budget {f(p.budget)}, used {f(p.used)}, left {f(p.remaining)}"
    cats = [(cat, f(b), detail) for cat, b, detail in category_rows(p)]
    out = _html.table(title, ("category", "bytes", ""), cats, notes=detail_lines(p))
    if p.index is not None:
        rows = [(l, k, s, f(b), c) for l, k, s, b, c in layer_rows(p)]
        header = ("layer", "hot neurons", "of layer", "bytes", "activations covered")
        out += "\n" + _html.table("hot neurons per layer", header, rows)
    return out
