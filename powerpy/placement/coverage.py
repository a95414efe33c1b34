"""How much of the activation mass a VRAM budget puts on the GPU: the solver run at many budgets.

For each budget the dense offload pass runs (docs/architecture.md#dense-offload-order) and the
hot-neuron split is solved (``solve.solve_placement``) on the profile's statistics. The curve's y
value is the placement's ``total_coverage``: the share of all counted activations whose neuron is on
the GPU, which is the share of FFN work the GPU serves when the text looks like the profiled one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from powerpy import _html
from powerpy._fs import fmt_bytes
from powerpy.formats.gguf_reader import GGUFFile
from powerpy.placement.placement import Placement
from powerpy.placement.solve import solve_placement


@dataclass(frozen=True)
class CoverageCurve:
    """GPU-served activation share against the VRAM budget.

    Attributes:
        model: the model's name (for titles).
        budgets: (n,) budgets in bytes, ascending.
        coverage: (n,) share of the counted activations on the GPU at each budget.
        hot_neurons: (n,) FFN neurons placed on the GPU.
        dense_bytes: bytes of the dense tensors and the KV cache, placed before any neuron.
        full_bytes: the budget that holds the whole model (every neuron on the GPU).
        n_ff_total: neurons in all layers.
    """

    model: str
    budgets: npt.NDArray[np.int64]
    coverage: npt.NDArray[np.float64]
    hot_neurons: npt.NDArray[np.int64]
    dense_bytes: int
    full_bytes: int
    n_ff_total: int

    def budget_for(self, share: float = 0.8) -> float | None:
        """The budget in bytes at which ``share`` of the activations are on the GPU, linearly
        interpolated between the measured budgets; None when the curve never reaches it."""
        c, b = self.coverage, self.budgets.astype(np.float64)
        above = np.nonzero(c >= share)[0]
        if above.size == 0:
            return None
        i = int(above[0])
        if i == 0 or c[i] == c[i - 1]:
            return float(b[i])
        return float(b[i - 1] + (b[i] - b[i - 1]) * (share - c[i - 1]) / (c[i] - c[i - 1]))

    def __repr__(self) -> str:
        at = self.budget_for(0.8)
        where = "not reached" if at is None else fmt_bytes(int(at))
        return f"<CoverageCurve {self.model}: {len(self.budgets)} budgets, 80% at {where}>"

    def _repr_html_(self) -> str:
        rows = [
            (fmt_bytes(int(b)), _html.pct(c), f"{n}", _html.pct(n / self.n_ff_total))
            for b, c, n in zip(self.budgets, self.coverage, self.hot_neurons, strict=True)
        ]
        at80 = self.budget_for(0.8)
        notes = [
            f"dense tensors and KV cache: {fmt_bytes(self.dense_bytes)}; whole model: "
            f"{fmt_bytes(self.full_bytes)}",
            "80% of activations on the GPU at "
            + ("(not reached)" if at80 is None else fmt_bytes(int(at80))),
        ]
        return _html.table(
            f"{self.model}: GPU-served activations vs VRAM budget",
            ("budget", "activations on GPU", "hot neurons", "of all neurons"),
            rows,
            notes=notes,
        )


def default_batch(n_ff: int, groups: int = 32) -> int:
    """The largest power-of-two group size (at most 256) that divides ``n_ff`` into at least
    ``groups`` groups, so the curve is smooth on small models (1 when none does)."""
    batch = 256
    while batch > 1 and (n_ff % batch or n_ff // batch < groups):
        batch //= 2
    return batch


def coverage_curve(
    gguf: GGUFFile,
    stats: Sequence[npt.ArrayLike],
    budgets: Sequence[int] | None = None,
    *,
    n_ctx: int = 2048,
    kv_elem_bytes: int = 2,
    batch: int | None = None,
    points: int = 16,
    include: Sequence[int] = (),
    method: str = "auto",
    name: str | None = None,
) -> CoverageCurve:
    """Solve the placement at each budget and record the GPU-served share of ``stats``.

    Args:
        gguf: an open PowerInfer model (its header only is read).
        stats: per-layer activation counts, (n_ff,) each (``ProfileResult.counts``).
        budgets: budgets in bytes (None: ``points`` budgets from the dense part to the whole
            model, plus 0).
        n_ctx: context length of the KV cache the budget must also hold.
        kv_elem_bytes: 2 (f16 KV cache) or 4 (f32).
        batch: solver group size (None: :func:`default_batch`).
        points: number of budgets when ``budgets`` is None.
        include: more budgets to measure (e.g. the one a placement was solved for).
        method: solver method (``solve.solve_placement``).
        name: the model's name (default: the file name).

    Raises:
        ValueError: a dense GGUF, statistics that do not match the model, bad budgets.
    """
    full = Placement.for_model(gguf, 1 << 62, n_ctx=n_ctx, kv_elem_bytes=kv_elem_bytes)
    dense = full.plan.used
    n_ff_total = full.n_layer * full.n_ff
    whole = dense + int(np.sum(full.ffn.neuron_bytes)) * full.n_ff
    if budgets is None:
        budgets = [0] + [int(x) for x in np.linspace(dense, whole, points)]
    budgets = [*budgets, *include]
    if any(b < 0 or not math.isfinite(b) for b in budgets):
        raise ValueError(f"budgets must be finite numbers of bytes >= 0, got {list(budgets)}")
    bs = np.array(sorted({int(b) for b in budgets}), dtype=np.int64)
    batch = batch or default_batch(full.n_ff)
    cov, hot = [], []
    quiet = logging.getLogger("powerpy.placement")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # budgets too small for the dense part are expected here
    try:
        for b in bs:
            base = Placement.for_model(gguf, int(b), n_ctx=n_ctx, kv_elem_bytes=kv_elem_bytes)
            p = solve_placement(base, stats, batch=batch, method=method)
            cov.append(p.total_coverage or 0.0)
            hot.append(p.n_hot)
    finally:
        quiet.setLevel(level)
    return CoverageCurve(
        name or gguf.path.name,
        bs,
        np.array(cov),
        np.array(hot, dtype=np.int64),
        dense,
        whole,
        n_ff_total,
    )
