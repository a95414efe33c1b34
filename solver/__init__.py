"""Hot-neuron placement solver: how many neurons of each layer go to the GPU.

Implements PowerInfer's offline solver (``docs/architecture.md#solver``) on numpy arrays:

    from solver import solve_hot_counts
    counts = solve_hot_counts(stats, capacity=429432, batch=256)  # (n_layer,) int64

This package imports neither torch nor powerpy (``import solver`` pulls in numpy only; pulp is
imported when the ILP runs). Reading ``activation_{i}.pt`` files needs torch and lives in
``powerpy.formats.stats``; ``python -m solver`` is a shim over ``powerpy.commands.solve_gpuidx``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from solver.greedy import solve_greedy, solve_threshold_dp
from solver.ilp import SolverError, solve_ilp

logger = logging.getLogger(__name__)

__all__ = [
    "Method",
    "SolveResult",
    "SolverError",
    "group_masses",
    "solve",
    "solve_hot_counts",
]

Method = Literal["auto", "ilp", "greedy", "dp"]
METHODS: tuple[str, ...] = ("auto", "ilp", "greedy", "dp")


@dataclass(frozen=True)
class SolveResult:
    """Per-layer hot-neuron counts and how they were found.

    Attributes:
        counts: ``(L,)`` int64 neurons per layer, multiples of ``batch``.
        method: ``"greedy"``, ``"dp"`` or ``"ilp"`` (what actually ran).
        optimal: proven optimal (greedy at t = 0 and the DP always are).
        mass: total statistics mass of the chosen groups.
        seconds: wall time of the solve, group masses included.
        cap_groups: ``floor(capacity / batch)``.
        min_groups: ``floor(threshold / batch)``.
    """

    counts: npt.NDArray[np.int64]
    method: str
    optimal: bool
    mass: float
    seconds: float
    cap_groups: int
    min_groups: int


def group_masses(stats: Sequence[npt.ArrayLike], batch: int) -> npt.NDArray[np.float64]:
    """Per-layer statistics sorted descending and summed in groups of ``batch`` neurons.

    Args:
        stats: one 1-D array of length ``n_ff`` per layer.
        batch: group size; must divide ``n_ff``.

    Returns:
        ``(L, G)`` float64 with ``G = n_ff / batch``; each row is non-increasing.

    Raises:
        ValueError: no layers, arrays that are not 1-D or differ in length, values that are not
            finite, or ``n_ff % batch != 0``.
    """
    if len(stats) == 0:
        raise ValueError("no activation statistics (0 layers)")
    if batch <= 0:
        raise ValueError(f"batch must be a positive number of neurons, got {batch}")
    arrays = [np.asarray(s, dtype=np.float64) for s in stats]
    n_ff = arrays[0].shape[0] if arrays[0].ndim == 1 else -1
    for i, a in enumerate(arrays):
        if a.ndim != 1 or a.shape[0] != n_ff:
            raise ValueError(
                f"layer {i}: statistics have shape {a.shape}, expected ({n_ff},) like layer 0"
            )
        if not np.all(np.isfinite(a)):
            j = int(np.flatnonzero(~np.isfinite(a))[0])
            raise ValueError(f"layer {i}: statistic {a[j]} at neuron {j} is not finite")
    if n_ff == 0 or n_ff % batch:
        raise ValueError(
            f"n_ff = {n_ff} neurons per layer is not a multiple of --batch {batch}; "
            f"pick a batch that divides it (e.g. 256, 128, 64 or 32)"
        )
    stacked = np.stack(arrays)  # (L, n_ff)
    sorted_desc = -np.sort(-stacked, axis=1)
    return sorted_desc.reshape(len(arrays), n_ff // batch, batch).sum(axis=2)


def solve(
    stats: Sequence[npt.ArrayLike],
    capacity: int,
    *,
    batch: int = 256,
    threshold: int = 0,
    time_limit: float = 30.0,
    method: Method = "auto",
) -> SolveResult:
    """Choose how many neurons of each layer go to the GPU (PowerInfer's offline solver).

    The objective is the statistics mass on the GPU, in whole groups of ``batch`` neurons taken
    from the top of each layer, with at most ``capacity`` neurons in total and every layer at 0
    or at least ``threshold`` neurons (both floored to whole groups, as upstream does).

    Methods: ``"greedy"`` (global top-CAP groups; exact while ``threshold < 2·batch``), ``"dp"``
    (exact dynamic programme, any threshold), ``"ilp"`` (the ILP with PuLP/CBC, warm-started
    from the DP) and ``"auto"`` (greedy when ``threshold // batch == 0``, else the ILP).

    Args:
        stats: one 1-D array of length ``n_ff`` per layer (activation counts or frequencies).
        capacity: most GPU neurons summed over all layers (``>= 0``).
        batch: group size in neurons; must divide ``n_ff``.
        threshold: smallest non-zero neuron count of a layer (``>= 0``).
        time_limit: seconds for the ILP (CBC's ``-sec``, wall clock).
        method: see above.

    Returns:
        A :class:`SolveResult`; ``counts`` are multiples of ``batch`` summing to at most
        ``capacity``.

    Raises:
        ValueError: bad arguments (``n_ff % batch != 0``, negative capacity, unknown method…).
        SolverError: the ILP found no feasible point in time (a ``ValueError``).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 neurons, got {capacity}")
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0 neurons, got {threshold}")
    t0 = time.perf_counter()
    v = group_masses(stats, batch)
    n_layer, n_groups = v.shape
    cap, t = int(capacity) // batch, int(threshold) // batch
    if threshold % batch:
        logger.warning(
            "threshold %d is not a multiple of batch %d; it is floored to %d groups = %d neurons "
            "(as upstream does)",
            threshold,
            batch,
            t,
            t * batch,
        )
    if t > min(n_groups, cap):
        logger.warning(
            "threshold %d neurons exceeds %s (%d neurons): no layer can be used",
            threshold,
            "n_ff" if n_groups < cap else "the capacity",
            min(n_groups, cap) * batch,
        )
    if method == "auto":
        method = "greedy" if t == 0 else "ilp"
    if method == "greedy":
        if t > 1:  # t = 1 is inert: a used layer has at least one group anyway
            logger.warning(
                "greedy ignores threshold %d; it is exact only below 2 groups", threshold
            )
        groups, optimal = solve_greedy(v, cap), t <= 1
    elif method == "dp":
        groups, optimal = solve_threshold_dp(v, cap, t), True
    else:
        start = solve_threshold_dp(v, cap, t) if t > 0 else solve_greedy(v, cap)
        remaining = time_limit - (time.perf_counter() - t0)
        sol = solve_ilp(v, cap, t, time_limit=max(remaining, 1.0), warm_start=start)
        groups, optimal = sol.groups, sol.optimal
    groups = np.asarray(groups, dtype=np.int64)
    mass = float(sum(v[i, : groups[i]].sum() for i in range(n_layer)))
    seconds = time.perf_counter() - t0
    logger.debug(
        "solved %d layers x %d groups (CAP %d, t %d) by %s in %.3f s: %d groups",
        n_layer,
        n_groups,
        cap,
        t,
        method,
        seconds,
        int(groups.sum()),
    )
    return SolveResult(groups * batch, method, optimal, mass, seconds, cap, t)


def solve_hot_counts(
    stats: Sequence[npt.ArrayLike],
    capacity: int,
    batch: int = 256,
    threshold: int = 0,
    time_limit: float = 30.0,
    method: Method = "auto",
) -> npt.NDArray[np.int64]:
    """Per-layer GPU neuron counts; :func:`solve` without the details.

    Args:
        stats: one 1-D array of length ``n_ff`` per layer.
        capacity: most GPU neurons summed over all layers.
        batch: group size in neurons; must divide ``n_ff``.
        threshold: smallest non-zero neuron count of a layer.
        time_limit: seconds for the ILP.
        method: ``"auto"``, ``"ilp"``, ``"greedy"`` or ``"dp"``.

    Returns:
        ``(L,)`` int64 counts, multiples of ``batch``, summing to at most ``capacity``.

    Raises:
        ValueError: bad arguments. SolverError: no feasible ILP point in time.
    """
    return solve(
        stats, capacity, batch=batch, threshold=threshold, time_limit=time_limit, method=method
    ).counts
