"""Predictor training: one ``fc2·relu(fc1·x)`` MLP per layer, no biases
(docs/architecture.md#predictor-training).

Recipe: the query is the pre-norm FFN input ``ffn_inp``; labels are the profiler's "active" rule
(``h != 0`` for ReLU models, ``|h_j| · ‖down_t[j]‖ > t_l`` for SiLU models, see
``powerpy.pipeline.profile``); loss is BCE
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

**Calibration** (optional): see :mod:`powerpy.pipeline.calibrate`. **Packing**: see
:mod:`powerpy.pipeline.predictors`.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from powerpy.model.ffn import predict
from powerpy.model.matrices import DenseWeight
from powerpy.model.numerics import DEFAULT as DEFAULT_NUMERICS
from powerpy.model.numerics import Numerics
from powerpy.model.transformer import Model
from powerpy.pipeline.calibrate import calibrate_predictors, split_indices
from powerpy.pipeline.predictors import (
    PREDICTOR_FILE,
    STATS_SUBDIR,
    check_out_dir,
    save_predictor,
    write_config,
)
from powerpy.pipeline.profile import (
    KIND_RELU,
    ProfileResult,
    active_mask,
    load_samples,
    profile,
    sample_arrays,
    write_profile,
)
from powerpy.pipeline.train_report import LayerReport, TrainReport

log = logging.getLogger(__name__)

HIDDEN_CHOICES = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass(frozen=True)
class TrainOptions:
    """Hyperparameters of predictor training (defaults: docs/architecture.md#predictor-training)."""

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


# ----------------------------------------------------------------------------------- one layer
def _rms_normalize(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-12)


def predictor_logits(x: Tensor, fc1: Tensor, fc2: Tensor) -> Tensor:
    """``predict`` for plain tensors: x (N, n_embd), fc1 (H, n_embd), fc2 (n_ff, H) -> (N, n_ff)."""
    return predict(x, DenseWeight(fc1.contiguous()), DenseWeight(fc2.contiguous()))


def _config_of(report: TrainReport, opts: TrainOptions, extra: dict) -> tuple[str | None, dict]:
    """(sparse_activation, further config.json keys) of a training run."""
    meta: dict = {}
    if report.kind != KIND_RELU:
        meta["magnitude_thresholds"] = report.magnitude_thresholds
    meta["powerpy"] = {
        "options": asdict(opts),
        "summary": report.summary(),
        "layers": [asdict(r) for r in report.layers],
        **extra,
    }
    return (None if report.kind == KIND_RELU else report.kind), meta


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
    val, tr = split_indices(n, opts.seed, opts.val_fraction)
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
    check_out_dir(out, n_layer)
    out.mkdir(parents=True, exist_ok=True)
    report = TrainReport(kind, magnitude_thresholds=thr, threshold=opts.threshold)
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
    extra = {"samples": int(meta["n_samples"]), **(extra_config or {})}
    write_config(out, opts.threshold, *_config_of(report, opts, extra))
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
    predictor_cost: float | None = None,
    work_dir: str | os.PathLike[str] | None = None,
    progress: bool = False,
    log_layer: Callable[[LayerReport], None] | None = None,
    numerics: Numerics = DEFAULT_NUMERICS,
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
        predictor_cost: with ``skip_fraction``: a predictor's time in units of its layer's
            dense FFN; layers whose predictor does not pay then run dense.
        work_dir: where the sample dump goes (default: a temporary directory, removed after).
        progress: tqdm bars.
        log_layer: called with each layer's report.
        numerics: how the profiling runs compute (``RunOptions.numerics``).

    Returns:
        ``(training report, profile result)``.
    """
    out = Path(out_dir)
    check_out_dir(out, model.args.n_layer)
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
            numerics=numerics,
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
                out,
                prof.samples_dir,
                out,
                skip_fraction,
                predictor_cost=predictor_cost,
                seed=opts.seed,
                val_fraction=opts.val_fraction,
                progress=progress,
            )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if not math.isfinite(report.summary().get("recall_mean", 0.0)):
        log.warning("some layers have no held-out positives")
    return report, prof
