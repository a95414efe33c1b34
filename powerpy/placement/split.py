"""The hot-neuron split's arithmetic: fit an index into the bytes left
(docs/architecture.md#split-and-merge).

Plain numpy over per-layer buckets and statistics; :class:`~powerpy.placement.placement.Placement`
applies it, and ``placement.solve`` checks its statistics with the same function.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

__all__ = ["check_stats", "fit_buckets", "mass_coverage", "whole_groups"]


def check_stats(
    stats: Sequence[npt.ArrayLike], n_layer: int, n_ff: int, what: str = "stats"
) -> list[npt.NDArray[np.float64]]:
    """Per-layer activation statistics as float64 arrays, checked against the model.

    Raises:
        ValueError: not ``n_layer`` arrays of shape ``(n_ff,)``.
    """
    if len(stats) != n_layer:
        raise ValueError(f"{what}: {len(stats)} layers of statistics for a {n_layer}-layer model")
    arrays = [np.asarray(s, dtype=np.float64) for s in stats]
    for layer, a in enumerate(arrays):
        if a.shape != (n_ff,):
            raise ValueError(
                f"{what}: layer {layer} has shape {a.shape}, the model has n_ff = {n_ff}"
            )
    return arrays


def fit_buckets(
    buckets: Sequence[npt.NDArray[np.int32]],
    neuron_bytes: Sequence[int],
    split_budget: int,
    stats: Sequence[npt.NDArray[np.float64]] | None,
) -> tuple[list[npt.NDArray[np.int32]], str | None]:
    """Truncate the buckets so their rows fit ``split_budget`` bytes.

    Deterministic rule: every layer keeps ``floor(k_l · R / needed)`` neurons, then the bytes
    left over go back layer by layer from layer 0 (the offload order). Within a layer the
    hottest neurons by ``stats`` survive (ties: lower id), or the lowest ids without stats.
    """
    ks = [int(b.shape[0]) for b in buckets]
    need = sum(k * nb for k, nb in zip(ks, neuron_bytes, strict=True))
    if need <= split_budget:
        return [np.asarray(b, dtype=np.int32) for b in buckets], None
    keep = [k * split_budget // need for k in ks]
    left = split_budget - sum(k * nb for k, nb in zip(keep, neuron_bytes, strict=True))
    for layer, (k, nb) in enumerate(zip(ks, neuron_bytes, strict=True)):
        extra = min(k - keep[layer], left // nb) if nb else 0
        keep[layer] += extra
        left -= extra * nb
    out = []
    for layer, (b, k) in enumerate(zip(buckets, keep, strict=True)):
        b = np.asarray(b, dtype=np.int32)
        if stats is not None and k < b.shape[0]:
            vals = stats[layer][b]
            b = np.sort(b[np.argsort(-vals, kind="stable")[:k]])
        else:
            b = b[:k]
        out.append(b.astype(np.int32))
    kept = sum(keep)
    note = (
        f"the index places {sum(ks)} neurons ({need} bytes) but only {split_budget} bytes are "
        f"left for hot rows: truncated to {kept} neurons per layer "
        f"({', '.join(map(str, keep))})"
    )
    logger.warning("%s", note)
    return out, note


def whole_groups(
    buckets: Sequence[npt.NDArray[np.int32]], groups: Sequence[int]
) -> tuple[list[npt.NDArray[np.int32]], str | None]:
    """The buckets with only whole groups of ``groups[l]`` neurons (0: any): a mixture's cut
    judges a group's neurons together, so a group is hot or cold as a whole; the members of a
    partly placed group stay on the host (and a note says how many)."""
    out, dropped = [], 0
    for layer, b in enumerate(buckets):
        g = groups[layer] if layer < len(groups) else 0
        b = np.asarray(b, dtype=np.int32)
        if g > 1 and b.size:
            gid = b // g
            full = np.bincount(gid)[gid] == g
            dropped += int((~full).sum())
            b = b[full]
        out.append(b)
    note = None
    if dropped:
        note = f"{dropped} hot neurons of partly placed cut groups stay on the host"
        logger.info("%s", note)
    return out, note


def mass_coverage(
    stats: Sequence[npt.NDArray[np.float64]], buckets: Sequence[npt.NDArray[np.int32]]
) -> tuple[tuple[float, ...], float]:
    """Per layer and in all, the share of the activation mass the buckets cover."""
    covered = np.array([a[b].sum() for a, b in zip(stats, buckets, strict=True)])
    totals = np.array([a.sum() for a in stats])
    per_layer = np.where(totals > 0, covered / np.where(totals > 0, totals, 1), 0.0)
    total = float(covered.sum() / totals.sum()) if totals.sum() > 0 else 0.0
    return tuple(float(c) for c in per_layer), total
