"""Per-layer predictor thresholds under one global threshold (calibration).

PowerInfer applies one global threshold
to every layer. To spend a budget of active neurons where it matters, each layer gets its own
threshold ``t_l`` on its held-out logits, chosen by a Lagrangian allocation that minimises the
energy of the skipped contributions (relative to the residual stream) at a mean skipped fraction;
``t_l`` is folded into ``fc2`` (scaled by ``global / t_l > 0``), so the file keeps one global
``sparse_threshold``. Training on sparser labels than the operating point (for SmolLM2:
``--target-sparsity 0.8``, calibrated to skip 20-50%) ranks the important neurons better.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor
from tqdm.auto import tqdm

from powerpy._fs import read_json
from powerpy.model.ffn import predict
from powerpy.model.matrices import DenseWeight
from powerpy.pipeline.predictors import (
    CONFIG_THRESHOLD,
    PREDICTOR_CONFIG,
    PREDICTOR_FILE,
    load_predictor_file,
    save_predictor,
    write_json,
)
from powerpy.pipeline.profile import load_samples, sample_arrays

log = logging.getLogger(__name__)


def split_indices(n: int, seed: int = 0, val_fraction: float = 0.05) -> tuple[Tensor, Tensor]:
    """(held-out, training) sample indices: a seeded permutation, the first 5% held out."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(n * val_fraction)))
    return perm[:n_val], perm[n_val:]


@dataclass
class LayerCurve:
    """Held-out trade-off of one layer's predictor: active fraction and lost energy per threshold.

    ``lost[k]`` is the energy of the skipped contributions, ``Σ_j (|h_j| ‖down_t[j]‖)²`` over
    the neurons the predictor skips at threshold ``thr[k]``, relative to the token's
    residual-stream energy ``‖ffn_inp‖²`` and averaged over tokens, so that layers compare on
    one scale (and a few attention-sink tokens with huge norms do not dominate).
    """

    thr: npt.NDArray[np.float64]  # (K,) descending runtime-logit thresholds
    active: npt.NDArray[np.float64]  # (K,) predicted-active fraction, ascending
    lost: npt.NDArray[np.float64]  # (K,) relative lost energy, descending


def layer_curve(
    x: Tensor, score: Tensor, fc1: Tensor, fc2: Tensor, *, points: int = 256, sign: float = -1.0
) -> LayerCurve:
    """The trade-off curve of one predictor on held-out samples.

    Args:
        x: (N, n_embd) raw ``ffn_inp``.
        score: (N, n_ff) ``|h| · ‖down_t‖``.
        fc1, fc2: the predictor as the runtime computes it.
        points: curve resolution.
        sign: only thresholds of this sign are usable (the global threshold's sign).

    Returns:
        The curve, restricted to thresholds of ``sign`` (strictly nonzero).
    """
    w1, w2 = DenseWeight(fc1.float().contiguous()), DenseWeight(fc2.float().contiguous())
    r = predict(x.float(), w1, w2).flatten()  # (N * n_ff,)
    resid = x.float().pow(2).sum(-1, keepdim=True)  # (N, 1) residual energy per token
    e = (score.float().pow(2) / resid).flatten()  # per-token relative energy
    order = torch.argsort(r, descending=True)
    r_sorted = r[order].double()
    lost_tail = e[order].double().flip(0).cumsum(0).flip(0)  # energy of ranks k.. (skipped)
    n = r.numel()
    resid = float(x.shape[0])  # mean over tokens
    ks = torch.linspace(1, n - 1, points).round().long().unique()  # keep the top k
    thr = r_sorted[ks - 1]  # keep r >= thr: exactly the first k (ties aside)
    lost = lost_tail[ks] / resid
    keep = (thr * sign) > 0
    if not bool(keep.any()):  # no usable threshold: the closest one to zero
        keep = torch.zeros_like(keep)
        keep[-1 if sign < 0 else 0] = True
    return LayerCurve(
        thr=thr[keep].numpy(), active=(ks[keep].double() / n).numpy(), lost=lost[keep].numpy()
    )


def plan_cost(
    curves: Sequence[LayerCurve], picks: Sequence[int | None], predictor_cost: float = 0.0
) -> float:
    """Mean FFN cost of a plan, in units of a dense FFN: ``predictor_cost + active`` for a gated
    layer, 1 for an ungated one (None)."""
    pairs = zip(curves, picks, strict=True)
    return float(np.mean([1.0 if k is None else predictor_cost + c.active[k] for c, k in pairs]))


def allocate(
    curves: Sequence[LayerCurve], target: float, predictor_cost: float | None = None
) -> list[int | None]:
    """Per-layer curve points minimising total lost energy at a mean FFN cost.

    Lagrangian allocation: each layer takes the choice minimising ``lost + λ·cost``; ``λ`` is
    bisected until the mean cost over layers is at most ``target`` (or as close as the usable
    thresholds allow). Without ``predictor_cost`` a layer's cost is its active fraction. With
    it, a gated layer costs ``predictor_cost + active`` (the predictor's time in units of the
    layer's dense FFN) and a layer may also run ungated (dense: cost 1, nothing lost), so the
    skipping goes to the layers whose predictors pay for themselves.

    Returns:
        One index into each curve, or None for a layer that runs ungated.
    """
    c0 = 0.0 if predictor_cost is None else float(predictor_cost)

    def pick(lam: float) -> list[int | None]:
        out: list[int | None] = []
        for c in curves:
            k = int(np.argmin(c.lost + lam * (c0 + c.active)))
            gated = c.lost[k] + lam * (c0 + c.active[k])
            out.append(None if predictor_cost is not None and lam <= gated else k)
        return out

    lo, hi = 0.0, 1.0
    while plan_cost(curves, pick(hi), c0) > target and hi < 1e6:
        hi *= 4
    for _ in range(60):
        mid = (lo + hi) / 2
        if plan_cost(curves, pick(mid), c0) > target:
            lo = mid
        else:
            hi = mid
    return pick(hi)


def calibrate_predictors(
    pred_dir: str | os.PathLike[str],
    samples_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    skip_fraction: float,
    *,
    global_threshold: float = -1.0,
    predictor_cost: float | None = None,
    seed: int = 0,
    val_fraction: float = 0.05,
    progress: bool = False,
) -> list[dict]:
    """Give each layer its own operating point for a mean skipped fraction, folded into fc2.

    PowerInfer has one global threshold. A layer's threshold ``t_l`` (same sign as the global
    one) is folded into its predictor by scaling ``fc2`` by ``global_threshold / t_l > 0``, which
    turns ``logit >= t_l`` into ``scaled logit >= global_threshold`` exactly. The ``t_l`` come from
    :func:`allocate` over the held-out split of the training samples (the same split training
    kept out), spending active neurons where skipping them loses most energy.

    Args:
        pred_dir: trained predictors (``model_{l}.pt``; may be calibrated already).
        samples_dir: the profiler dump they were trained on.
        out_dir: where the calibrated predictors and ``config.json`` go (may be ``pred_dir``).
        skip_fraction: mean fraction of neurons to skip per token, over layers.
        global_threshold: the runtime threshold written as ``sparse_threshold`` (nonzero).
        predictor_cost: the time of a layer's predictor in units of its dense FFN (measured,
            e.g. with ``powerpy bench``). Given, ``skip_fraction`` is the mean FFN time saved
            net of the predictors, and layers whose predictor does not pay run dense: they
            are listed as ``dense_layers`` in ``config.json`` (the converter writes them as
            ``powerpy.dense_layers``) and keep their most permissive point for readers that
            gate every layer. None: every layer is gated (PowerInfer's behaviour).
        seed, val_fraction: the held-out split of the samples (as in training).
        progress: a tqdm bar.

    Returns:
        Per-layer records (threshold, scale, planned active fraction, lost energy).

    Raises:
        ValueError: ``skip_fraction`` outside [0, 1) or a zero ``global_threshold``.
    """

    if not 0.0 <= skip_fraction < 1.0:
        raise ValueError(f"skip fraction {skip_fraction} must be in [0, 1)")
    if global_threshold == 0.0:
        raise ValueError("calibration needs a nonzero global threshold (its sign matters)")
    meta = load_samples(samples_dir)
    src, out = Path(pred_dir), Path(out_dir)
    n_layer = int(meta["n_layer"])
    preds, curves = [], []
    for l in tqdm(range(n_layer), desc="calibrate", unit="layer", disable=not progress):
        sd = load_predictor_file(src / PREDICTOR_FILE.format(l=l))
        xa, aa, dn = sample_arrays(meta, l)
        val, _ = split_indices(len(xa), seed, val_fraction)
        idx = np.sort(val.numpy())
        x = torch.from_numpy(np.asarray(xa[idx], dtype=np.float32))
        score = torch.from_numpy(np.asarray(aa[idx], dtype=np.float32)) * torch.from_numpy(dn)
        fc1, fc2 = sd["fc1.weight"].float(), sd["fc2.weight"].float()
        preds.append((fc1, fc2))
        curves.append(layer_curve(x, score, fc1, fc2, sign=float(np.sign(global_threshold))))
    if predictor_cost is not None and not 0.0 <= predictor_cost < 1.0:
        raise ValueError(f"predictor cost {predictor_cost} must be in [0, 1)")
    picks = allocate(curves, 1.0 - skip_fraction, predictor_cost)
    planned = plan_cost(curves, picks, predictor_cost or 0.0)
    if planned > 1.0 - skip_fraction + 0.01:
        log.warning(
            "skip fraction %.3f is out of reach with a %s global threshold: planned %.3f (train "
            "with a higher --target-sparsity)",
            skip_fraction,
            "negative" if global_threshold < 0 else "positive",
            1.0 - planned,
        )
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for l, (c, k) in enumerate(zip(curves, picks, strict=True)):
        dense = k is None
        if k is None:  # ungated here; other readers gate it at its most permissive point
            k = int(np.argmax(c.active))
        t = float(c.thr[k])
        scale = global_threshold / t
        fc1, fc2 = preds[l]
        if not math.isfinite(scale) or float(fc2.abs().max()) * scale > 60000.0:
            raise ValueError(
                f"layer {l}: threshold {t:g} needs fc2 scale {scale:g} (fp16 overflow)"
            )
        save_predictor(out / PREDICTOR_FILE.format(l=l), fc1, fc2 * scale)
        records.append(
            {
                "layer": l,
                "threshold": t,
                "scale": scale,
                "active": 1.0 if dense else float(c.active[k]),
                "lost": 0.0 if dense else float(c.lost[k]),
                "dense": dense,
            }
        )
    cfg_path = src / PREDICTOR_CONFIG
    cfg = read_json(cfg_path)
    cfg[CONFIG_THRESHOLD] = float(global_threshold)
    cfg.setdefault("powerpy", {})["calibration"] = {
        "skip_fraction": skip_fraction,
        "planned_active": float(np.mean([r["active"] for r in records])),
        "predictor_cost": predictor_cost,
        "dense_layers": [r["layer"] for r in records if r["dense"]],
        "layers": records,
    }
    write_json(cfg, out / PREDICTOR_CONFIG)
    for r in records:
        log.debug(
            "layer %2d: threshold %+.4f scale %.3f planned active %.3f lost energy %.5f",
            r["layer"],
            r["threshold"],
            r["scale"],
            r["active"],
            r["lost"],
        )
    return records
