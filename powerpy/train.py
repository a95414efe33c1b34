"""Predictor training (spec §14): one ``fc2·relu(fc1·x)`` MLP per layer, no biases.

Recipe: the query is the pre-norm FFN input ``ffn_inp``; labels are the profiler's "active" rule
(``h != 0`` for ReLU models, ``|h_j| · ‖down_t[j]‖ > t_l`` for SiLU models, see
``powerpy.profile``); loss is BCE
on logits with class weighting ``w = mean(y) + 0.005`` (positives weigh ``1 - w``, negatives
``w``); AdamW (lr 1e-3, weight decay 0.01), batch 1024, at most ``epochs`` epochs; the checkpoint
with the best held-out recall (5% of the samples) is kept, training stops after ``patience``
epochs without improvement or once recall exceeds 0.99.

Two exact reparametrisations make training better conditioned without changing what the runtime
computes:

- Each sample is divided by its RMS. The FFN itself only sees ``rms_norm(ffn_inp)``, so the labels
  depend on ``x / rms(x)`` alone, and the predictor ``fc2·relu(fc1·x)`` is positively homogeneous:
  ``logit(x) = rms(x) · logit(x / rms(x))``. At the runtime threshold 0 the decisions on raw
  ``ffn_inp`` are therefore exactly those on normalised inputs.
- Features are standardised by a per-dimension scale ``s`` that is folded into ``fc1`` on export
  (``fc1 · diag(s)``), so the exported predictor takes raw ``ffn_inp`` as PowerInfer expects.

Metrics are measured after export, on raw held-out inputs, with the runtime threshold.

**Calibration** (optional, :func:`calibrate_predictors`). PowerInfer applies one global threshold
to every layer. To spend a budget of active neurons where it matters, each layer gets its own
threshold ``t_l`` on its held-out logits, chosen by a Lagrangian allocation that minimises the
energy of the skipped contributions (relative to the residual stream) at a mean skipped fraction;
``t_l`` is folded into ``fc2`` (scaled by ``global / t_l > 0``), so the file keeps one global
``sparse_threshold``. Training on sparser labels than the operating point (for SmolLM2:
``--target-sparsity 0.8``, calibrated to skip 20-50%) ranks the important neurons better.

**Packing.** :func:`pack_predictors` stores predictors as int8 rows with fp16 row scales, half
the size of fp16 ``model_{l}.pt``, for shipping them inside the package.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from powerpy.model import Model
from powerpy.profile import (
    KIND_SILU,
    ProfileResult,
    active_mask,
    load_samples,
    profile,
    sample_arrays,
    write_profile,
)

log = logging.getLogger(__name__)

PREDICTOR_FILE = "model_{l}.pt"
PREDICTOR_FILE_RE = re.compile(r"model_(\d+)\.pt")
PREDICTOR_CONFIG = "config.json"
STATS_SUBDIR = "activation"
CONFIG_THRESHOLD = "sparse_threshold"  # read by PowerInfer's convert.py
CONFIG_ACTIVATION = "sparse_activation"  # powerpy: "silu" marks a magnitude-sparsified model
HIDDEN_CHOICES = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass(frozen=True)
class TrainOptions:
    """Hyperparameters of predictor training (defaults: spec §14 with a smaller H)."""

    hidden: int = 128  # H, when not auto
    auto_hidden: bool = False  # smallest H of hidden_choices reaching recall_target, per layer
    hidden_choices: tuple[int, ...] = HIDDEN_CHOICES
    recall_target: float = 0.9  # for auto_hidden
    max_hidden: int = 1024  # auto_hidden never goes above
    epochs: int = 20
    batch: int = 1024
    lr: float = 1e-3
    weight_decay: float = 0.01
    patience: int = 5
    stop_recall: float = 0.99
    val_fraction: float = 0.05
    threshold: float = 0.0  # runtime predictor threshold: metrics, and written to config.json
    weight_eps: float = 0.005  # w = mean(y) + weight_eps
    seed: int = 0


@dataclass
class LayerReport:
    """Held-out metrics of one layer's exported predictor at the runtime threshold."""

    layer: int
    hidden: int
    recall: float
    precision: float
    pred_active: float  # fraction of neurons predicted active per token
    true_active: float  # fraction of neurons labelled active per token
    epochs: int
    n_train: int
    n_val: int


@dataclass
class TrainReport:
    kind: str
    layers: list[LayerReport] = field(default_factory=list)
    magnitude_thresholds: list[float] | None = None

    def summary(self) -> dict[str, float]:
        """Mean recall/precision/active fractions over layers, and the min recall."""
        if not self.layers:
            return {}
        rec = [r.recall for r in self.layers]
        return {
            "recall_mean": float(np.mean(rec)),
            "recall_min": float(np.min(rec)),
            "precision_mean": float(np.mean([r.precision for r in self.layers])),
            "pred_active_mean": float(np.mean([r.pred_active for r in self.layers])),
            "true_active_mean": float(np.mean([r.true_active for r in self.layers])),
        }


# ----------------------------------------------------------------------------------- one layer
def _rms_normalize(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-12)


def predictor_logits(x: Tensor, fc1: Tensor, fc2: Tensor) -> Tensor:
    """``fc2·relu(fc1·x)``: x (N, n_embd), fc1 (H, n_embd), fc2 (n_ff, H) -> (N, n_ff)."""
    return F.relu(x @ fc1.T) @ fc2.T


def _metrics(
    x: Tensor, y: Tensor, fc1: Tensor, fc2: Tensor, thr: float, chunk: int = 4096
) -> tuple[float, float, float, float]:
    """(recall, precision, predicted-active, true-active) over (N, n_ff) pairs."""
    tp = fp = fn = pos = 0
    for s in range(0, x.shape[0], chunk):
        pred = predictor_logits(x[s : s + chunk], fc1, fc2) >= thr
        yy = y[s : s + chunk]
        tp += int((pred & yy).sum())
        fp += int((pred & ~yy).sum())
        fn += int((~pred & yy).sum())
        pos += int(pred.sum())
    n = y.numel()
    recall = tp / (tp + fn) if tp + fn else 1.0
    precision = tp / (tp + fp) if tp + fp else 1.0
    return recall, precision, pos / n, (tp + fn) / n


def split_indices(n: int, opts: TrainOptions) -> tuple[Tensor, Tensor]:
    """(held-out, training) sample indices: a seeded permutation, the first 5% held out."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(opts.seed))
    n_val = max(1, int(round(n * opts.val_fraction)))
    return perm[:n_val], perm[n_val:]


def train_layer(
    x: Tensor,
    y: Tensor,
    hidden: int,
    opts: TrainOptions,
    *,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[Tensor, Tensor, LayerReport]:
    """Train one predictor.

    Args:
        x: (N, n_embd) raw ``ffn_inp`` samples (any float dtype).
        y: (N, n_ff) bool labels.
        hidden: H.
        opts: training options.
        progress: called after each epoch with (epoch, held-out recall).

    Returns:
        ``(fc1 (H, n_embd), fc2 (n_ff, H), report)``, float32, ready for raw ``ffn_inp``.

    Raises:
        ValueError: fewer than 20 samples, or x and y disagree in length.
    """
    # Training needs autograd whatever the caller's mode (a global no_grad, an inference block).
    with torch.inference_mode(False), torch.enable_grad():
        return _train_layer(x.clone(), y.clone(), hidden, opts, progress)


def _train_layer(
    x: Tensor,
    y: Tensor,
    hidden: int,
    opts: TrainOptions,
    progress: Callable[[int, float], None] | None,
) -> tuple[Tensor, Tensor, LayerReport]:
    n, d = x.shape
    n_ff = y.shape[1]
    if y.shape[0] != n:
        raise ValueError(f"{n} inputs but {y.shape[0]} label rows")
    if n < 20:
        raise ValueError(f"{n} samples are too few to train a predictor (need at least 20)")
    g = torch.Generator().manual_seed(opts.seed)
    val, tr = split_indices(n, opts)
    x32 = x.float()
    xn = _rms_normalize(x32)
    scale = 1.0 / (xn[tr].std(0) + 1e-3)  # (n_embd,) folded into fc1 on export
    xs = xn * scale
    x_tr, y_tr = xs[tr], y[tr]
    w = float(y_tr.float().mean()) + opts.weight_eps
    w_pos, w_neg = 1.0 - w, w

    torch.manual_seed(opts.seed)
    fc1 = torch.nn.Linear(d, hidden, bias=False)
    fc2 = torch.nn.Linear(hidden, n_ff, bias=False)
    params = list(fc1.parameters()) + list(fc2.parameters())
    optim = torch.optim.AdamW(params, lr=opts.lr, weight_decay=opts.weight_decay)

    def export() -> tuple[Tensor, Tensor]:
        return (fc1.weight.detach() * scale).clone(), fc2.weight.detach().clone()

    best: tuple[float, Tensor, Tensor, int] | None = None
    stale, epoch = 0, 0
    for epoch in range(1, opts.epochs + 1):
        order = torch.randperm(x_tr.shape[0], generator=g)
        for s in range(0, len(order), opts.batch):
            idx = order[s : s + opts.batch]
            z = fc2(F.relu(fc1(x_tr[idx])))  # (B, n_ff)
            t = y_tr[idx].float()
            loss = -(w_pos * t * F.logsigmoid(z) + w_neg * (1 - t) * F.logsigmoid(-z)).mean()
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
        with torch.no_grad():
            e1, e2 = export()
            recall = _metrics(x32[val], y[val], e1, e2, opts.threshold)[0]
        if progress is not None:
            progress(epoch, recall)
        if best is None or recall > best[0]:
            best, stale = (recall, e1, e2, epoch), 0
        else:
            stale += 1
        if recall > opts.stop_recall or stale >= opts.patience:
            break
    assert best is not None
    _, b1, b2, _ = best
    with torch.no_grad():
        rec, prec, pa, ta = _metrics(x32[val], y[val], b1, b2, opts.threshold)
    report = LayerReport(-1, hidden, rec, prec, pa, ta, epoch, len(tr), len(val))
    return b1, b2, report


def train_layer_auto(
    x: Tensor, y: Tensor, opts: TrainOptions, **kwargs
) -> tuple[Tensor, Tensor, LayerReport]:
    """``train_layer`` with the smallest H of ``opts.hidden_choices`` reaching the recall target.

    Falls back to the best recall seen when no size up to ``opts.max_hidden`` reaches it.
    """
    best = None
    for h in [c for c in opts.hidden_choices if c <= opts.max_hidden]:
        out = train_layer(x, y, h, opts, **kwargs)
        if out[2].recall >= opts.recall_target:
            return out
        if best is None or out[2].recall > best[2].recall:
            best = out
    assert best is not None, "no hidden size to try"
    return best


# ----------------------------------------------------------------------------------- calibration
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
    r = predictor_logits(x.float(), fc1.float(), fc2.float()).flatten()  # (N * n_ff,)
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


def allocate(curves: Sequence[LayerCurve], target_active: float) -> list[int]:
    """Per-layer curve points minimising total lost energy at a mean active fraction.

    Lagrangian allocation: each layer takes the point minimising ``lost + λ·active``; ``λ`` is
    bisected until the mean active fraction over layers is at most ``target_active`` (or as close
    as the usable thresholds allow).

    Returns:
        One index into each curve.
    """

    def pick(lam: float) -> list[int]:
        return [int(np.argmin(c.lost + lam * c.active)) for c in curves]

    def mean_active(idx: list[int]) -> float:
        return float(np.mean([c.active[i] for c, i in zip(curves, idx, strict=True)]))

    lo, hi = 0.0, 1.0
    while mean_active(pick(hi)) > target_active and hi < 1e6:
        hi *= 4
    for _ in range(60):
        mid = (lo + hi) / 2
        if mean_active(pick(mid)) > target_active:
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
    opts: TrainOptions = TrainOptions(),
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
        opts: the training options (for the held-out split).
        progress: a tqdm bar.

    Returns:
        Per-layer records (threshold, scale, planned active fraction, lost energy).

    Raises:
        ValueError: ``skip_fraction`` outside [0, 1) or a zero ``global_threshold``.
    """
    from powerpy.convert import load_predictor_file

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
        val, _ = split_indices(len(xa), opts)
        idx = np.sort(val.numpy())
        x = torch.from_numpy(np.asarray(xa[idx], dtype=np.float32))
        score = torch.from_numpy(np.asarray(aa[idx], dtype=np.float32)) * torch.from_numpy(dn)
        fc1, fc2 = sd["fc1.weight"].float(), sd["fc2.weight"].float()
        preds.append((fc1, fc2))
        curves.append(layer_curve(x, score, fc1, fc2, sign=float(np.sign(global_threshold))))
    picks = allocate(curves, 1.0 - skip_fraction)
    planned = float(np.mean([c.active[k] for c, k in zip(curves, picks, strict=True)]))
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
                "active": float(c.active[k]),
                "lost": float(c.lost[k]),
            }
        )
    cfg_path = src / PREDICTOR_CONFIG
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    cfg[CONFIG_THRESHOLD] = float(global_threshold)
    cfg.setdefault("powerpy", {})["calibration"] = {
        "skip_fraction": skip_fraction,
        "planned_active": float(np.mean([r["active"] for r in records])),
        "layers": records,
    }
    _atomic_json(cfg, out / PREDICTOR_CONFIG)
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


# ----------------------------------------------------------------------------------- files
def _atomic_save(obj: object, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _atomic_json(obj: object, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def save_predictor(path: str | os.PathLike[str], fc1: Tensor, fc2: Tensor) -> None:
    """Write one ``model_{l}.pt``: a state dict of fp16 ``fc1.weight`` and ``fc2.weight``."""
    sd = {"fc1.weight": fc1.detach().half().contiguous(), "fc2.weight": fc2.detach().half()}
    _atomic_save({k: v.contiguous() for k, v in sd.items()}, Path(path))


def _check_out_dir(out: Path, n_layer: int) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"predictor output {out} exists and is not a directory")
    if out.is_dir():
        stale = [
            p.name
            for p in out.iterdir()
            if (m := PREDICTOR_FILE_RE.fullmatch(p.name)) and int(m.group(1)) >= n_layer
        ]
        if stale:
            raise ValueError(
                f"{out} holds predictors of another model ({', '.join(sorted(stale)[:4])} for a "
                f"{n_layer}-layer model); use an empty directory"
            )


def write_config(
    out: Path, report: TrainReport, opts: TrainOptions, extra: dict | None = None
) -> Path:
    """Write ``config.json``: ``sparse_threshold``, the SiLU marker and training metadata."""
    cfg: dict = {CONFIG_THRESHOLD: float(opts.threshold)}
    if report.kind == KIND_SILU:
        cfg[CONFIG_ACTIVATION] = KIND_SILU
        cfg["magnitude_thresholds"] = report.magnitude_thresholds
    cfg["powerpy"] = {
        "options": asdict(opts),
        "summary": report.summary(),
        "layers": [asdict(r) for r in report.layers],
        **(extra or {}),
    }
    path = out / PREDICTOR_CONFIG
    _atomic_json(cfg, path)
    return path


# ----------------------------------------------------------------------------------- packing
PACK_FILE = "predictors.q8.safetensors"


def pack_predictors(pred_dir: str | os.PathLike[str], out_file: str | os.PathLike[str]) -> Path:
    """Store a predictor directory's weights compactly: int8 rows with one fp16 scale per row.

    The pack is a safetensors file (no pickle) with ``blk.{l}.fc{1,2}.q`` (int8) and
    ``blk.{l}.fc{1,2}.scale`` (fp16, ``absmax / 127`` per row); it halves the size of fp16
    ``model_{l}.pt`` files, for shipping predictors inside the package.

    Args:
        pred_dir: ``model_0.pt`` … (read with ``weights_only=True``).
        out_file: the pack (written atomically).

    Returns:
        The pack path.

    Raises:
        ValueError: no predictors, or an unsafe/malformed file (named).
    """
    from safetensors.torch import save_file

    from powerpy.convert import load_predictor_file

    src, out = Path(pred_dir), Path(out_file)
    tensors: dict[str, Tensor] = {}
    l = 0
    while (src / PREDICTOR_FILE.format(l=l)).is_file():
        sd = load_predictor_file(src / PREDICTOR_FILE.format(l=l))
        for key in ("fc1", "fc2"):
            w = sd[f"{key}.weight"].float()  # (rows, cols)
            scale = w.abs().amax(dim=1, keepdim=True) / 127.0  # (rows, 1)
            scale = scale.half().float().clamp_min(1e-12)
            tensors[f"blk.{l}.{key}.q"] = (w / scale).round().clamp(-127, 127).to(torch.int8)
            tensors[f"blk.{l}.{key}.scale"] = scale.squeeze(1).half()
        l += 1
    if l == 0:
        raise ValueError(f"{src}: no predictors (model_0.pt) to pack")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"n_layer": str(l), "format": "powerpy-q8-rows"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates 0600 files
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def unpack_predictors(pack: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> int:
    """Expand a pack written by :func:`pack_predictors` into fp16 ``model_{l}.pt`` files.

    Returns:
        The number of layers written.

    Raises:
        ValueError: the pack is malformed (missing layers or tensors).
    """
    from safetensors import safe_open

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with safe_open(str(pack), framework="pt") as f:
        meta = f.metadata() or {}
        try:
            n_layer = int(meta["n_layer"])
            for l in range(n_layer):
                w = {
                    k: f.get_tensor(f"blk.{l}.{k}.q").float()
                    * f.get_tensor(f"blk.{l}.{k}.scale").float()[:, None]
                    for k in ("fc1", "fc2")
                }
                save_predictor(out / PREDICTOR_FILE.format(l=l), w["fc1"], w["fc2"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise ValueError(f"{pack}: not a powerpy predictor pack ({e})") from None
    return n_layer


# ----------------------------------------------------------------------------------- pipeline
def labels_for(
    a: np.ndarray, kind: str, threshold: float | None, down_norm: np.ndarray | None = None
) -> Tensor:
    """Bool labels (N, n_ff) from a dumped ``|h|`` array (fp16, nonzero kept nonzero), by the
    profiler's rule (``profile.active_mask``)."""
    t = torch.from_numpy(np.array(a))
    dn = None if down_norm is None else torch.from_numpy(np.asarray(down_norm, np.float32))
    return active_mask(t, kind, threshold, dn)


def train_from_samples(
    samples_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    opts: TrainOptions = TrainOptions(),
    *,
    layers: Sequence[int] | None = None,
    progress: bool = False,
    log_layer: Callable[[LayerReport], None] | None = None,
    extra_config: dict | None = None,
) -> TrainReport:
    """Train and write the predictors of every layer from a profiler sample dump.

    Args:
        samples_dir: a ``samples/`` directory written by ``profile(..., dump_samples=N)``.
        out_dir: the predictor directory (created); gets ``model_{l}.pt`` and ``config.json``.
        opts: training options.
        layers: train only these layers (for experiments; the config then covers them only).
        progress: tqdm bars.
        log_layer: called with each layer's report as soon as it is done.
        extra_config: more fields for ``config.json``'s ``powerpy`` section.

    Returns:
        The report with per-layer metrics.

    Raises:
        FileNotFoundError: no sample dump. ValueError: an output directory of another model.
    """
    meta = load_samples(samples_dir)
    n_layer, kind = int(meta["n_layer"]), meta["kind"]
    thr = meta.get("thresholds")
    out = Path(out_dir)
    _check_out_dir(out, n_layer)
    out.mkdir(parents=True, exist_ok=True)
    report = TrainReport(kind, magnitude_thresholds=thr)
    todo = list(range(n_layer)) if layers is None else list(layers)
    for l in tqdm(todo, desc="train", unit="layer", disable=not progress):
        xa, aa, dn = sample_arrays(meta, l)
        x = torch.from_numpy(np.array(xa))
        y = labels_for(aa, kind, None if thr is None else thr[l], dn)
        bar = tqdm(
            total=opts.epochs, desc=f"layer {l}", unit="ep", leave=False, disable=not progress
        )

        def tick(epoch: int, recall: float, bar=bar) -> None:
            bar.update(1)
            bar.set_postfix(recall=f"{recall:.4f}")

        if opts.auto_hidden:
            fc1, fc2, r = train_layer_auto(x, y, opts, progress=tick)
        else:
            fc1, fc2, r = train_layer(x, y, opts.hidden, opts, progress=tick)
        bar.close()
        r.layer = l
        save_predictor(out / PREDICTOR_FILE.format(l=l), fc1, fc2)
        report.layers.append(r)
        if log_layer is not None:
            log_layer(r)
        log.debug(
            "layer %2d: H %4d recall %.4f precision %.4f predicted-active %.3f true-active %.3f",
            l,
            r.hidden,
            r.recall,
            r.precision,
            r.pred_active,
            r.true_active,
        )
    write_config(out, report, opts, {"samples": int(meta["n_samples"]), **(extra_config or {})})
    return report


def train_predictors(
    model: Model,
    ids: Sequence[int] | npt.NDArray[np.integer],
    out_dir: str | os.PathLike[str],
    opts: TrainOptions = TrainOptions(),
    *,
    tokens: int | None = 100_000,
    samples: int | None = None,
    ctx: int = 256,
    target_sparsity: float = 0.5,
    skip_fraction: float | None = None,
    work_dir: str | os.PathLike[str] | None = None,
    progress: bool = False,
    log_layer: Callable[[LayerReport], None] | None = None,
) -> tuple[TrainReport, ProfileResult]:
    """Profile a model on a text (dumping samples), then train its predictors.

    Args:
        model: the model (run dense).
        ids: the training text's tokens.
        out_dir: the predictor directory; also gets ``activation/activation_{l}.pt``.
        opts: training options.
        tokens: tokens to run (spread over the text); None: the whole text.
        samples: tokens per layer to train on (default: all tokens run).
        ctx: profiling window.
        target_sparsity: SiLU models: the per-layer score quantile labelled inactive.
        skip_fraction: when set, calibrate per-layer operating points for this mean fraction
            of skipped neurons (:func:`calibrate_predictors`).
        work_dir: where the sample dump goes (default: a temporary directory, removed after).
        progress: tqdm bars.
        log_layer: called with each layer's report.

    Returns:
        ``(training report, profile result)``.
    """
    out = Path(out_dir)
    _check_out_dir(out, model.args.n_layer)
    tmp = None
    if work_dir is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".powerpy-samples-", dir=out.parent)
        work_dir = tmp
    try:
        n_run = tokens if tokens is not None else len(ids)
        prof = profile(
            model,
            ids,
            ctx=ctx,
            max_tokens=tokens,
            target_sparsity=target_sparsity,
            dump_dir=work_dir,
            dump_samples=samples if samples is not None else n_run,
            seed=opts.seed,
            progress=progress,
        )
        out.mkdir(parents=True, exist_ok=True)
        write_profile(prof, out / STATS_SUBDIR)
        assert prof.samples_dir is not None
        extra = {"profile_tokens": prof.n_tokens, "target_sparsity": prof.target_sparsity}
        report = train_from_samples(
            prof.samples_dir,
            out,
            opts,
            progress=progress,
            log_layer=log_layer,
            extra_config=extra,
        )
        if skip_fraction is not None:
            calibrate_predictors(
                out, prof.samples_dir, out, skip_fraction, opts=opts, progress=progress
            )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if not math.isfinite(report.summary().get("recall_mean", 0.0)):
        log.warning("some layers have no held-out positives")
    return report, prof
