"""Make a GPU index: capacity → solver → export rule
(docs/architecture.md#hybrid-placement).

The only powerpy module that imports ``solver`` (the torch-free solver package). Statistics come
in as numpy arrays (``powerpy.formats.stats.load_activation_stats``).

- :func:`topk_bucket` / :func:`index_from_counts`: the export rule, layer ``l`` keeps its
  ``counts[l]`` most active neurons.
- :func:`solve_index`: statistics and a neuron capacity → a :class:`GpuIndex`
  (what ``python -m solver`` does).
- :func:`solve_placement`: a placement's dense pass and statistics → the same placement with a
  freshly solved index (what ``powerpy gen-gpuidx`` and the index lifecycle do). The dense pass
  is not run again: its ``split_budget`` is the ``R`` the capacity comes from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

import solver
from powerpy.formats.gpuidx import GpuIndex
from powerpy.placement.budget import CapacityMode, hot_capacity
from powerpy.placement.placement import Placement, SolveSummary
from powerpy.placement.split import check_stats

logger = logging.getLogger(__name__)

__all__ = ["TieBreak", "index_from_counts", "solve_index", "solve_placement", "topk_bucket"]

TieBreak = Literal["stable", "torch"]


# --- export rule (docs/architecture.md#export-rule) ----------------------------------------------
def topk_bucket(
    stats: npt.ArrayLike, k: int, *, tie_break: TieBreak = "stable"
) -> npt.NDArray[np.int32]:
    """The ``k`` most active neurons of a layer, ascending: its ``gpu_bucket``.

    Upstream takes ``torch.topk(stats, k)`` on the raw statistics and sorts the indices. Which
    of several equal values make the cut is an implementation detail of ``torch.topk``.

    Args:
        stats: 1-D statistics of one layer.
        k: neurons to select, ``0 <= k <= len(stats)``.
        tie_break: ``"stable"`` (default): order by (-value, index), so among equal values the
            lower index wins; deterministic everywhere, no torch. ``"torch"``: call the
            installed ``torch.topk`` as upstream's exporter does, for byte identity with
            upstream files when values tie at the cut (integer counts often do); this is a
            compatibility switch and imports torch.

    Returns:
        ``(k,)`` int32 strictly ascending neuron ids.

    Raises:
        ValueError: ``k`` out of range, stats not 1-D, or unknown ``tie_break``.
    """
    a = np.asarray(stats)
    if a.ndim != 1:
        raise ValueError(f"statistics must be 1-D, got shape {a.shape}")
    if not 0 <= k <= a.shape[0]:
        raise ValueError(f"cannot select {k} of {a.shape[0]} neurons")
    if tie_break == "stable":
        order = np.argsort(-a.astype(np.float64), kind="stable")[:k]
    elif tie_break == "torch":
        import torch

        t = torch.from_numpy(np.ascontiguousarray(a.astype(np.float64, copy=False)))
        # topk is comparison-based, so an order-preserving dtype change keeps its choice
        order = torch.topk(t, int(k)).indices.numpy()
    else:
        raise ValueError(f"tie_break must be 'stable' or 'torch', got {tie_break!r}")
    return np.sort(order).astype(np.int32)


def index_from_counts(
    stats: Sequence[npt.ArrayLike],
    counts: Sequence[int] | npt.NDArray[np.integer],
    *,
    vram_capacity: int,
    block_count: int | None = None,
    tie_break: TieBreak = "stable",
) -> GpuIndex:
    """The export rule (docs/architecture.md#export-rule): layer ``l`` keeps the ``counts[l]``
    most active neurons.

    Args:
        stats: per-layer 1-D statistics used for the selection (the raw values, not the
            groups). For upstream's bug #247 pass the lexicographically paired list
            (``powerpy.formats.stats.lexicographic_pairing``).
        counts: neurons per layer (from the solver).
        vram_capacity: bytes the index is made for.
        block_count: defaults to the layer count.
        tie_break: see :func:`topk_bucket`.

    Returns:
        A validated index.

    Raises:
        ValueError: lengths differ, or a count is negative or larger than ``n_ff``.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if len(stats) != counts.shape[0]:
        raise ValueError(f"{len(stats)} layers of statistics but {counts.shape[0]} counts")
    if len(stats) == 0:
        raise ValueError("cannot build a GPU index for 0 layers")
    n_ff = np.asarray(stats[0]).shape[0]
    buckets = [
        topk_bucket(s, int(k), tie_break=tie_break) for s, k in zip(stats, counts, strict=True)
    ]
    return GpuIndex.from_buckets(
        buckets, n_ff, vram_capacity=vram_capacity, block_count=block_count
    )


# --- solving --------------------------------------------------------------------------------------
def solve_index(
    stats: Sequence[npt.ArrayLike],
    capacity: int,
    *,
    vram_capacity: int,
    block_count: int | None = None,
    batch: int = 256,
    threshold: int = 0,
    time_limit: float = 30.0,
    method: str = "auto",
    export_stats: Sequence[npt.ArrayLike] | None = None,
    tie_break: TieBreak = "stable",
) -> tuple[GpuIndex, solver.SolveResult]:
    """Per-layer counts from the solver, then the export rule.

    Args:
        stats: per-layer statistics in numeric order (the solver's input).
        capacity: most GPU neurons summed over all layers.
        vram_capacity: bytes the index is made for (``split.vram_capacity``).
        block_count: defaults to the layer count.
        batch: group size in neurons (divides n_ff).
        threshold: smallest non-zero neuron count per layer.
        time_limit: seconds for the ILP.
        method: ``"auto"``, ``"ilp"``, ``"greedy"`` or ``"dp"`` (``solver.solve``).
        export_stats: statistics for the export step when they differ from ``stats``
            (upstream bug #247).
        tie_break: see :func:`topk_bucket`.

    Returns:
        The index and the solver's result (counts, method, optimality, seconds).

    Raises:
        ValueError: bad arguments, or a solver failure (``solver.SolverError``).
    """
    result = solver.solve(
        stats,
        capacity,
        batch=batch,
        threshold=threshold,
        time_limit=time_limit,
        method=method,  # type: ignore[arg-type]
    )
    index = index_from_counts(
        stats if export_stats is None else export_stats,
        result.counts,
        vram_capacity=vram_capacity,
        block_count=block_count,
        tie_break=tie_break,
    )
    return index, result


def solve_placement(
    base: Placement,
    stats: Sequence[npt.ArrayLike],
    *,
    capacity_mode: CapacityMode = "exact",
    batch: int = 256,
    threshold: int = 0,
    time_limit: float = 30.0,
    method: str = "auto",
    export_stats: Sequence[npt.ArrayLike] | None = None,
    tie_break: TieBreak = "stable",
) -> Placement:
    """Solve a GPU index for a placement's dense pass and apply it.

    ``base.plan.split_budget`` (``R``) becomes a neuron capacity, the solver picks the
    per-layer counts and the export rule the neurons. A budget too small for the dense part or
    for one group gives an empty index and an ``empty_reason`` (not an error). The index's
    ``split.vram_capacity`` is ``R`` (0 when the dense pass stopped); write it with
    ``placement.index.write(path)``.

    Args:
        base: the model's placement (its index, if any, is replaced).
        stats: per-layer statistics in numeric order (``load_activation_stats``).
        capacity_mode: ``"exact"`` (default) or ``"upstream"`` (PowerInfer's 4.5-factor
            formula, a compatibility switch).
        batch: group size in neurons (divides n_ff).
        threshold: smallest non-zero neuron count per layer.
        time_limit: seconds for the ILP.
        method: solver method (``solver.solve``).
        export_stats: statistics for the export step (upstream bug #247).
        tie_break: see :func:`topk_bucket`.

    Returns:
        The placement with the new index, its statistics coverage and a ``SolveSummary``.

    Raises:
        ValueError: statistics that do not match the model, bad arguments, or a solver failure.
    """
    t0 = time.perf_counter()
    n_layer, n_ff, plan = base.n_layer, base.n_ff, base.plan
    arrays = check_stats(stats, n_layer, n_ff, "stats")
    exported = None if export_stats is None else check_stats(export_stats, n_layer, n_ff, "export")
    for l in base.ffn.dense_layers:  # placed whole by the dense pass: no hot rows to solve
        arrays[l] = np.zeros_like(arrays[l])
    if n_ff % batch:
        raise ValueError(
            f"n_ff = {n_ff} is not a multiple of --batch {batch}; pick a batch dividing it"
        )
    split = plan.split_budget
    capacity = hot_capacity(split, base.ffn, capacity_mode) if plan.dense_complete else 0
    reason, result = None, None
    if not plan.dense_complete:
        pass  # the placement states why (the dense pass's stop message)
    elif capacity < batch:
        reason = (
            f"the {split} bytes left after the dense tensors and KV cache hold {capacity} "
            f"neurons ({capacity_mode} mode, {base.ffn.neuron_bytes[0]} bytes each), fewer "
            f"than one group of {batch}"
        )
    else:
        index, result = solve_index(
            arrays,
            capacity,
            vram_capacity=split,
            batch=batch,
            threshold=threshold,
            time_limit=time_limit,
            method=method,
            export_stats=exported,
            tie_break=tie_break,
        )
        if not index.counts.any():
            reason = (
                f"the solver placed no neuron (capacity {capacity}, threshold {threshold}): "
                f"no layer reaches the threshold within the capacity, or all statistics are 0"
            )
    if result is None:
        index = GpuIndex.empty(n_layer, n_ff, vram_capacity=split)
    if reason:
        logger.info("empty GPU placement: %s", reason)
    placed = int(np.dot(index.counts, base.ffn.neuron_bytes))
    if placed > split:  # only possible in upstream mode (its formula can under-charge)
        logger.warning(
            "the %s capacity formula over-commits: the hot rows need %d bytes but only %d are "
            "left; use the exact capacity mode",
            capacity_mode,
            placed,
            split,
        )
    summary = SolveSummary(
        capacity,
        capacity_mode,
        batch,
        threshold,
        None if result is None else result.method,
        result is not None and result.optimal,
        0.0 if result is None else result.seconds,
        time.perf_counter() - t0,
    )
    return base.with_index(index, stats=arrays, solve=summary, empty_reason=reason)
