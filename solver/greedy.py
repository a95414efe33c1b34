"""Combinatorial solvers for the hot-neuron split: greedy top-CAP and an exact threshold DP.

Both work on the group masses of ``docs/architecture.md#solver``: per layer, the statistics sorted
descending and summed in consecutive groups of ``batch`` neurons, so ``v[i, 0] >= v[i, 1] >= …``.

Because every layer's groups are sorted, any selection can be replaced by the top ``k_i`` groups
of each layer (same counts, mass at least as large). The problem therefore reduces to choosing
one count per layer:

    maximize  Σ_i P_i(k_i)     P_i(k) = v[i, 0] + … + v[i, k-1]
    s.t.      Σ_i k_i ≤ CAP,   k_i ∈ {0} ∪ [t, G]

- ``t = 0``: each ``P_i`` is concave, so the optimum is the global top-CAP groups by mass
  (:func:`solve_greedy`). This is the fast path and the oracle for the ILP at ``t = 0``.
- ``t > 0``: :func:`solve_threshold_dp` solves it exactly by dynamic programming over layers
  and used groups in ``O(L · CAP · G)`` vectorised steps. The ILP uses it as a warm start, and
  the tests use it as an oracle beyond brute-force sizes.

numpy only; importing this module never imports torch or pulp.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["solve_greedy", "solve_threshold_dp"]


def solve_greedy(masses: npt.NDArray[np.float64], cap_groups: int) -> npt.NDArray[np.int64]:
    """Global top-CAP groups by mass (the exact optimum when there is no threshold).

    Ties are broken deterministically by (layer, group): lower layers first, and inside a layer
    earlier groups first, so each layer's selection is a prefix of its sorted groups. Groups of
    zero (or negative) mass are never selected: they add nothing to the objective and would only
    spend VRAM on neurons that were never seen active (the ILP may or may not pick them).

    Args:
        masses: ``(L, G)`` group masses, each row non-increasing.
        cap_groups: most groups in total (``CAP = floor(capacity / batch)``), ``>= 0``.

    Returns:
        ``(L,)`` int64 number of groups per layer, summing to at most ``cap_groups``.

    Raises:
        ValueError: ``masses`` is not 2-D or ``cap_groups`` is negative.
    """
    v = _check_masses(masses, cap_groups)
    n_layer, n_groups = v.shape
    layer = np.repeat(np.arange(n_layer), n_groups)
    group = np.tile(np.arange(n_groups), n_layer)
    flat = v.reshape(-1)
    # lexsort: the last key is the primary one -> order by -mass, then layer, then group
    order = np.lexsort((group, layer, -flat))
    chosen = order[: min(cap_groups, flat.size)]
    chosen = chosen[flat[chosen] > 0]
    return np.bincount(layer[chosen], minlength=n_layer).astype(np.int64)


def solve_threshold_dp(
    masses: npt.NDArray[np.float64], cap_groups: int, min_groups: int
) -> npt.NDArray[np.int64]:
    """Exact optimum with a per-layer minimum, by dynamic programming over layers.

    ``best[c]`` is the largest mass reachable with at most ``c`` groups in the layers seen so
    far; adding layer ``i`` with ``k`` groups (``k = 0`` or ``min_groups <= k <= G``) gives
    ``best'[c] = max_k best[c - k] + P_i(k)``. Ties keep the smaller ``k``, so zero-mass groups
    are only taken when the minimum forces them.

    Args:
        masses: ``(L, G)`` group masses, each row non-increasing.
        cap_groups: most groups in total, ``>= 0``.
        min_groups: ``t``, the fewest groups of a layer that is used at all, ``>= 0``.

    Returns:
        ``(L,)`` int64 groups per layer: each 0 or ``>= min_groups``, summing to at most
        ``cap_groups``.

    Raises:
        ValueError: bad shapes or negative arguments.
    """
    v = _check_masses(masses, cap_groups)
    if min_groups < 0:
        raise ValueError(f"min_groups must be >= 0, got {min_groups}")
    n_layer, n_groups = v.shape
    cap = min(cap_groups, n_layer * n_groups)
    prefix = np.zeros((n_layer, n_groups + 1))  # prefix[i, k] = P_i(k)
    np.cumsum(v, axis=1, out=prefix[:, 1:])
    best = np.zeros(cap + 1)
    choice = np.zeros((n_layer, cap + 1), dtype=np.int32)  # k taken by layer i at budget c
    k_lo, k_hi = max(min_groups, 1), min(n_groups, cap)
    for i in range(n_layer):
        new = best.copy()
        for k in range(k_lo, k_hi + 1):
            cand = best[: cap + 1 - k] + prefix[i, k]
            better = cand > new[k:]
            new[k:][better] = cand[better]
            choice[i, k:][better] = k
        best = new
    counts = np.zeros(n_layer, dtype=np.int64)
    c = cap
    for i in range(n_layer - 1, -1, -1):
        counts[i] = choice[i, c]
        c -= counts[i]
    return counts


def _check_masses(masses: npt.NDArray[np.float64], cap_groups: int) -> npt.NDArray[np.float64]:
    v = np.asarray(masses, dtype=np.float64)
    if v.ndim != 2:
        raise ValueError(f"masses must be (n_layer, n_groups), got shape {v.shape}")
    if cap_groups < 0:
        raise ValueError(f"cap_groups must be >= 0, got {cap_groups}")
    return v
