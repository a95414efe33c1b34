"""HTML tables for Jupyter: the ``_repr_html_`` of powerpy's result objects.

Every notebook-facing object (``LLM``, ``Placement``, profile results, the predictor report,
bench and sweep results) renders through :func:`table`, so they look alike. Values are escaped;
nothing here imports a notebook package.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

_STYLE = "border-collapse:collapse;font-size:90%"
_CELL = "padding:2px 8px;border-bottom:1px solid #ddd"


def _cell(v: object, tag: str) -> str:
    align = "right" if isinstance(v, int | float) and not isinstance(v, bool) else "left"
    return f'<{tag} style="{_CELL};text-align:{align}">{html.escape(str(v))}</{tag}>'


def table(
    title: str,
    header: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    notes: Sequence[str] = (),
    max_rows: int = 64,
) -> str:
    """An HTML table with a bold caption, one row per item and optional note lines below.

    Rows past ``max_rows`` are elided (the count is said), so a 80-layer model stays readable.
    Numbers are right-aligned; format them as strings first where the digits matter.
    """
    rows = list(rows)
    body = rows if len(rows) <= max_rows else rows[: max_rows - 1]
    out = [f'<table style="{_STYLE}">']
    out.append(f'<caption style="text-align:left"><b>{html.escape(title)}</b></caption>')
    out.append("<tr>" + "".join(_cell(h, "th") for h in header) + "</tr>")
    out += ["<tr>" + "".join(_cell(v, "td") for v in r) + "</tr>" for r in body]
    if len(body) < len(rows):
        more = f"... {len(rows) - len(body)} more rows"
        out.append(f'<tr><td colspan="{len(header)}" style="{_CELL}">{more}</td></tr>')
    out.append("</table>")
    out += [f'<div style="font-size:90%">{html.escape(n)}</div>' for n in notes]
    return "\n".join(out)


def pairs(title: str, items: Iterable[tuple[str, object]]) -> str:
    """A two-column key/value table."""
    return table(title, ("", ""), items)


def pct(x: float | None, digits: int = 1) -> str:
    """``0.123`` -> ``"12.3%"``; None -> ``"-"``."""
    return "-" if x is None else f"{100 * x:.{digits}f}%"
