"""PuLP statement of PowerInfer's hot-neuron ILP (``docs/architecture.md#solver``), solved by CBC.

Every PuLP call of powerpy lives in this module. numpy in, per-layer group counts out; no torch.
pulp itself is imported on first use, so ``import solver`` stays cheap.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

__all__ = ["IlpSolution", "SolverError", "UPSTREAM_BIG_M", "solve_ilp"]

# Upstream writes constraint (3) with M = 1000000. Any M >= G (a layer has at most G groups) is
# equivalent on integer points; powerpy uses M = G, the tightest valid value (a better LP bound).
UPSTREAM_BIG_M = 1_000_000

# CBC options. Measured on the 70B shape (80 x 112 groups, t = 2): "preprocess off" solves in
# 0.25 s instead of 0.6 s (0.9 s instead of 1.3 s at batch 64) and never changes the optimum.
# Wall-clock time mode, so a busy shared machine cannot stretch the limit.
CBC_OPTIONS = ("preprocess off",)


class SolverError(ValueError):
    """The split could not be solved (no feasible point found in time, or solver failure)."""


@dataclass(frozen=True)
class IlpSolution:
    """Result of :func:`solve_ilp`.

    Attributes:
        groups: ``(L,)`` int64 groups per layer.
        optimal: CBC proved optimality (False: best feasible point at the time limit).
        objective: ``Σ v·x`` of the returned point (the mass placed on the GPU).
        status: CBC's status text, e.g. ``"Optimal"``.
        seconds: wall time of model building plus CBC.
    """

    groups: npt.NDArray[np.int64]
    optimal: bool
    objective: float
    status: str
    seconds: float


def solve_ilp(
    masses: npt.NDArray[np.float64],
    cap_groups: int,
    min_groups: int,
    *,
    time_limit: float = 30.0,
    warm_start: npt.NDArray[np.int64] | None = None,
) -> IlpSolution:
    """Solve PowerInfer's split ILP with PuLP + CBC.

    With ``v[i, g]`` the mass of group ``g`` of layer ``i`` (rows sorted descending),
    ``CAP = floor(capacity / batch)`` and ``t = floor(threshold / batch)``::

        variables   x[i,g] ∈ {0,1}   group g of layer i is on the GPU
                    y[i]   ∈ {0,1}   layer i has any GPU group
        minimize    Σ_{i,g} -v[i,g]·x[i,g]
        subject to  (1)      Σ_{i,g} x[i,g]         ≤ CAP
                    (2) ∀i:  t·y[i] - Σ_g x[i,g]    ≤ 0     used layers hold at least t groups
                    (3) ∀i:  Σ_g x[i,g] - M·y[i]    ≤ 0     only used layers hold groups

    ``M = G`` (at most G groups per layer); upstream's ``M = 1000000`` is equivalent on integer
    points and looser in the LP relaxation.

    CBC gets ``time_limit`` minus the model-building time, in wall-clock mode. With ``t > 0``
    the big-M relaxation is weak, and for large ``t`` CBC may not prove optimality in time; a
    ``warm_start`` incumbent (e.g. the exact DP of ``solver.greedy``) then guarantees the returned
    point is at least that good. It does not change the model.

    Args:
        masses: ``(L, G)`` group masses, rows non-increasing.
        cap_groups: ``CAP >= 0``.
        min_groups: ``t >= 0``.
        time_limit: seconds for the whole call (> 0).
        warm_start: optional ``(L,)`` feasible groups per layer, given to CBC as a start.

    Returns:
        An :class:`IlpSolution`. ``optimal`` is False when CBC stopped at the time limit with a
        feasible point (a warning is logged).

    Raises:
        SolverError: CBC failed, or found no feasible point within the time limit.
        ValueError: bad arguments.
    """
    import pulp

    v = np.asarray(masses, dtype=np.float64)
    if v.ndim != 2:
        raise ValueError(f"masses must be (n_layer, n_groups), got shape {v.shape}")
    if cap_groups < 0 or min_groups < 0:
        raise ValueError(f"cap_groups and min_groups must be >= 0, got {cap_groups}, {min_groups}")
    if not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds, got {time_limit}")
    t_start = time.perf_counter()
    n_layer, n_groups = v.shape
    layers, groups = range(n_layer), range(n_groups)
    CAP, t, M = int(cap_groups), int(min_groups), n_groups  # named as in the formula; M = G

    prob = pulp.LpProblem("powerinfer_gpu_split", pulp.LpMinimize)
    x = {(i, g): prob.add_variable(f"x_{i}_{g}", cat=pulp.LpBinary) for i in layers for g in groups}
    y = {i: prob.add_variable(f"y_{i}", cat=pulp.LpBinary) for i in layers}
    layer_groups = {i: pulp.lpSum(x[i, g] for g in groups) for i in layers}  # Σ_g x[i,g]

    # objective: minimize Σ_{i,g} -v[i,g]·x[i,g]  (y costs nothing)
    prob += pulp.LpAffineExpression((x[i, g], -float(v[i, g])) for i in layers for g in groups)
    prob += pulp.lpSum(x.values()) <= CAP, "capacity"  # (1)
    for i in layers:
        prob += t * y[i] - layer_groups[i] <= 0, f"min_groups_{i}"  # (2)
        prob += layer_groups[i] - M * y[i] <= 0, f"use_layer_{i}"  # (3)

    if warm_start is not None:
        ws = np.asarray(warm_start, dtype=np.int64)
        if ws.shape != (n_layer,):
            raise ValueError(f"warm_start must have shape ({n_layer},), got {ws.shape}")
        for i in layers:
            y[i].setInitialValue(int(ws[i] > 0))
            for g in groups:
                x[i, g].setInitialValue(int(g < ws[i]))

    cbc_limit = max(1.0, time_limit - (time.perf_counter() - t_start))
    with warnings.catch_warnings():
        # PuLP 3.3 flags the bundled-CBC command as going away in 4.0; pyproject pins <3.4
        warnings.simplefilter("ignore", DeprecationWarning)
        cmd = pulp.PULP_CBC_CMD(
            msg=False,
            timeLimit=cbc_limit,
            timeMode="elapsed",
            warmStart=warm_start is not None,
            options=list(CBC_OPTIONS),
        )
    try:
        prob.solve(cmd)
    except pulp.PulpSolverError as e:
        raise SolverError(f"CBC failed on the split ILP: {e}") from e
    seconds = time.perf_counter() - t_start

    status = pulp.LpStatus[prob.status]
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise SolverError(
            f"CBC found no feasible split in {time_limit:g} s (status {status!r}, "
            f"{n_layer} layers x {n_groups} groups, t = {t}); raise --batch to shrink the "
            f"problem, drop --threshold (0 uses the exact greedy), or raise --time-limit"
        )
    chosen = np.array(
        [[round(x[i, g].varValue or 0.0) for g in groups] for i in layers], dtype=np.int64
    ).reshape(n_layer, n_groups)
    result = chosen.sum(axis=1)
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    objective = float((v * chosen).sum())
    if not optimal:
        logger.warning(
            "CBC stopped at the %.0f s time limit without proving optimality; using its best "
            "feasible split (GPU mass %.6g)",
            time_limit,
            objective,
        )
    # what CBC returned must satisfy (1)-(3)
    if result.sum() > CAP or np.any((result > 0) & (result < t)):
        raise SolverError(f"CBC returned an infeasible split {result.tolist()} (CAP {CAP}, t {t})")
    return IlpSolution(result, optimal, objective, status, seconds)
