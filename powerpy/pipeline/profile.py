"""Activation profiler: per-neuron activation counts and predictor training samples.

The model runs **dense** over non-overlapping windows of a text with an observer, which
hands over, per layer, the pre-norm FFN input ``ffn_inp`` (T, n_embd) and the true activation
``h`` (T, n_ff). A neuron is *active* for a token when

- ReLU-family models (``reglu``/``drelu``): ``h != 0`` (docs/architecture.md#predictor-training);
- SiLU models (``swiglu``): ``|h_j| · ‖down_t[j]‖ > t_l``, a per-layer magnitude threshold on
  the norm of the neuron's contribution to the FFN output (CATS/TEAL-style, weighted by the
  output row so that neurons are ranked by what skipping them costs). ``t_l`` is the
  ``target_sparsity`` quantile of that score in layer ``l``, calibrated on the first windows of
  the run (or given), then fixed for the whole run, so the counts written here and the labels a
  predictor is trained on use the same rule.

Outputs (``write_profile``): ``activation_{i}.pt`` (1-D int64 counts of length n_ff, the input
of ``gen-gpuidx``) and ``profile.json``. With ``dump_samples=N``, ``samples/`` holds per layer
``x_{i}.npy`` (N, n_embd) fp16 (``ffn_inp``) and ``a_{i}.npy`` (N, n_ff) fp16 (``|h|``, where a
nonzero ``h`` is never rounded to 0), as ``.npy`` memmaps, plus ``down_norm.npy`` (n_layer, n_ff)
f32; the N tokens are spread uniformly over the run. Memory stays bounded for any token count:
windows stream through, counts accumulate, and samples go straight to the memmaps.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from tqdm.auto import tqdm

from powerpy._fs import atomic_write
from powerpy.model.ffn import row_norms
from powerpy.model.numerics import DEFAULT as DEFAULT_NUMERICS
from powerpy.model.numerics import Numerics
from powerpy.model.options import RunOptions
from powerpy.model.transformer import Model
from powerpy.pipeline.corpus import window_starts

log = logging.getLogger(__name__)

# relu: active iff h != 0; silu (and gelu, GELU's small negative values are no zeros either):
# |h| · ‖down‖ above a per-layer threshold
KIND_RELU = "relu"
PROFILE_JSON = "profile.json"
SAMPLES_DIR = "samples"
SAMPLES_META = "meta.json"
DOWN_NORM_FILE = "down_norm.npy"
CALIB_TOKENS = 2048  # tokens whose |h| sets the SiLU thresholds when none are given
_CALIB_VALUES = 1_000_000  # score values per layer kept for the quantile
_F16_TINY = float(np.finfo(np.float16).smallest_subnormal)


def activation_kind(model: Model) -> str:
    """Kind "relu" for ReLU FFNs (ReGLU, dReLU, plain ReLU: exact zeros); "silu" or "gelu"
    (SwiGLU, GeGLU, GELU: no exact zeros, magnitude labels)."""
    return model.args.ffn_variant.activation


def down_norms(model: Model) -> list[torch.Tensor]:
    """Per layer, the L2 norm of each neuron's output row ``‖ffn_down_t[j]‖``: (n_ff,) f32
    (a mixture of experts: (n_expert · n_ff_exp,), each expert's down columns)."""
    return [
        row_norms(blk.ffn_down_t) if blk.moe is None else blk.moe.down_norms()
        for blk in model.weights.blk
    ]


def magnitude_score(h: torch.Tensor, down_norm: torch.Tensor) -> torch.Tensor:
    """SiLU ranking score ``|h_j| · ‖down_t[j]‖``: h (T, n_ff), down_norm (n_ff,) -> (T, n_ff)."""
    return h.abs().float() * down_norm


def group_score(score: torch.Tensor, group: int) -> torch.Tensor:
    """A mixture's cut scores (docs/moe.md#the-cut): the sums of ``group`` neurons' scores,
    (T, n) -> (T, n / group); group 1: the scores."""
    return score if group == 1 else score.view(score.shape[0], -1, group).sum(-1)


def active_mask(
    h: torch.Tensor,
    kind: str,
    threshold: float | None,
    down_norm: torch.Tensor | None = None,
    group: int = 1,
) -> torch.Tensor:
    """Which neurons count as active: h (T, n_ff) -> bool (T, n_ff).

    Args:
        h: the true FFN activation (or ``|h|``).
        kind: "relu" (``h != 0``) or "silu" (``|h| · down_norm > threshold``).
        threshold: the layer's magnitude threshold (SiLU only).
        down_norm: (n_ff,) output-row norms (SiLU only).
        group: a mixture's cut groups (``Experts.cut_group``): a neuron is active when its
            group's summed score is over the threshold.
    """
    if kind == KIND_RELU:
        return h != 0
    assert threshold is not None and down_norm is not None, "SiLU labels need a threshold"
    active = group_score(magnitude_score(h, down_norm), group) > threshold
    return active if group == 1 else active.repeat_interleave(group, dim=1)


def abs_f16(h: torch.Tensor) -> torch.Tensor:
    """``|h|`` in fp16 with nonzero values kept nonzero (no underflow to 0): (T, n_ff)."""
    a = h.abs().clamp_max(65504.0)
    return torch.where(h != 0, a.clamp_min(_F16_TINY), a).half()


@dataclass
class ProfileResult:
    """What a profiling run measured."""

    kind: str  # "relu" or "silu"
    n_embd: int
    counts: list[npt.NDArray[np.int64]]  # per layer (n_ff,) active counts
    n_tokens: int  # tokens run
    thresholds: npt.NDArray[np.float64] | None  # (n_layer,) SiLU magnitude thresholds
    target_sparsity: float | None
    n_samples: int = 0  # tokens dumped per layer
    samples_dir: Path | None = None
    model: str = ""  # the model's name, for titles

    def active_fraction(self) -> npt.NDArray[np.float64]:
        """(n_layer,) mean fraction of active neurons per token."""
        n_ff = len(self.counts[0])
        return np.array([c.sum() / (self.n_tokens * n_ff) for c in self.counts])

    def top_coverage(self, fraction: float = 0.1) -> npt.NDArray[np.float64]:
        """(n_layer,) share of each layer's activations carried by its ``fraction`` most
        active neurons (0 for a layer that never fired)."""
        k = max(1, round(fraction * len(self.counts[0])))
        out = []
        for c in self.counts:
            total = c.sum()
            out.append(np.sort(c)[::-1][:k].sum() / total if total else 0.0)
        return np.array(out, dtype=np.float64)

    def __repr__(self) -> str:
        return (
            f"<ProfileResult {self.model or 'model'}: {self.kind}, {len(self.counts)} layers, "
            f"{self.n_tokens} tokens, mean active {100 * self.active_fraction().mean():.1f}%>"
        )

    def _repr_html_(self) -> str:
        from powerpy import _html

        frac, top = self.active_fraction(), self.top_coverage(0.1)
        rows = [
            (l, _html.pct(f), _html.pct(t), int((c > 0).sum()))
            for l, (f, t, c) in enumerate(zip(frac, top, self.counts, strict=True))
        ]
        rule = "h != 0" if self.kind == KIND_RELU else "|h|·‖down‖ above the layer threshold"
        notes = [
            f"{self.n_tokens} tokens; active means {rule}; mean active "
            f"{_html.pct(float(frac.mean()))}, top-10% neurons carry "
            f"{_html.pct(float(top.mean()))} of activations"
        ]
        return _html.table(
            f"{self.model or 'model'}: activation profile",
            ("layer", "active per token", "top-10% coverage", "neurons ever active"),
            rows,
            notes=notes,
        )


class _SampleWriter:
    """Writes the sampled tokens' (ffn_inp, |h|) rows of every layer into .npy memmaps."""

    def __init__(self, directory: Path, n_layer: int, n_embd: int, n_ff: int, picks: np.ndarray):
        directory.mkdir(parents=True, exist_ok=True)
        n = len(picks)
        self.dir = directory
        self.picks = picks  # (n,) ascending global token indices
        self.x = [
            np.lib.format.open_memmap(directory / f"x_{l}.npy", "w+", np.float16, (n, n_embd))
            for l in range(n_layer)
        ]
        self.a = [
            np.lib.format.open_memmap(directory / f"a_{l}.npy", "w+", np.float16, (n, n_ff))
            for l in range(n_layer)
        ]

    def write(self, layer: int, pos0: int, x: torch.Tensor, h: torch.Tensor) -> None:
        """Store the rows of tokens pos0 … pos0+T-1 that were picked: x (T, n_embd), h (T, n_ff)."""
        lo, hi = np.searchsorted(self.picks, [pos0, pos0 + x.shape[0]])
        if lo == hi:
            return
        rows = torch.from_numpy(self.picks[lo:hi] - pos0)
        self.x[layer][lo:hi] = x[rows].half().numpy()
        self.a[layer][lo:hi] = abs_f16(h[rows]).numpy()

    def close(self, meta: dict, down_norm: list[torch.Tensor]) -> None:
        for m in self.x + self.a:
            m.flush()
        self.x, self.a = [], []
        np.save(self.dir / DOWN_NORM_FILE, torch.stack(down_norm).numpy().astype(np.float32))
        _write_json(self.dir / SAMPLES_META, meta)


def _write_json(path: Path, obj: dict) -> None:
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")


def calibrate_thresholds(
    abs_values: Sequence[torch.Tensor], target_sparsity: float
) -> npt.NDArray[np.float64]:
    """Per-layer magnitude thresholds: the ``target_sparsity`` quantile of each layer's ``|h|``.

    Args:
        abs_values: per layer, a 1-D sample of ``|h|`` values.
        target_sparsity: fraction of values that should fall at or below the threshold.

    Returns:
        (n_layer,) thresholds.

    Raises:
        ValueError: the target is not in [0, 1).
    """
    if not 0.0 <= target_sparsity < 1.0:
        raise ValueError(f"target sparsity {target_sparsity} must be in [0, 1)")
    out = []
    for v in abs_values:
        v = v.float().flatten()
        if v.numel() > _CALIB_VALUES:
            v = v[torch.randperm(v.numel(), generator=torch.Generator().manual_seed(0))]
            v = v[:_CALIB_VALUES]
        out.append(float(np.quantile(v.numpy(), target_sparsity)))
    return np.array(out, dtype=np.float64)


def _group(model: Model, l: int) -> int:
    """Layer l's cut groups: a mixture's ``Experts.cut_group``, else 1 (each neuron)."""
    ex = model.weights.blk[l].moe
    return 1 if ex is None else ex.cut_group


def _calibrate_run(
    model: Model,
    arr: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64],
    ctx: int,
    dn: list[torch.Tensor],
    target_sparsity: float,
    numerics: Numerics,
) -> npt.NDArray[np.float64]:
    """SiLU thresholds from a first dense pass over the first ``CALIB_TOKENS`` tokens.

    Only a random subset of each layer's scores is kept (at most ``_CALIB_VALUES`` per layer),
    so memory does not grow with the model; the windows run again in the counting pass.
    """
    calib = starts[: max(1, -(-CALIB_TOKENS // ctx))]
    per_window = max(1, _CALIB_VALUES // len(calib))
    gen = torch.Generator().manual_seed(0)
    values: list[list[torch.Tensor]] = [[] for _ in dn]

    def observer(l: int, x: torch.Tensor, h: torch.Tensor) -> None:
        if model.args.moe and not model.args.layer_moe(l):
            values[l].append(torch.zeros(1))  # a leading dense layer: not counted
            return
        v = group_score(magnitude_score(h, dn[l]), _group(model, l)).flatten()
        if model.args.moe:
            v = v[v > 0]  # the routed experts' groups: the others are not computed at all
        if v.numel() > per_window:
            v = v[torch.randint(v.numel(), (per_window,), generator=gen)]
        values[l].append(v)

    opts = RunOptions(sparse=False, observer=observer, numerics=numerics)
    for s in calib:
        model.forward(torch.from_numpy(arr[s : s + ctx].copy()), model.new_cache(ctx), opts)
    thr = calibrate_thresholds([torch.cat(v) for v in values], target_sparsity)
    log.debug("calibrated thresholds on %d tokens: %s", len(calib) * ctx, thr)
    return thr


def profile(
    model: Model,
    ids: Sequence[int] | npt.NDArray[np.integer],
    *,
    ctx: int = 256,
    max_tokens: int | None = None,
    target_sparsity: float | None = None,
    thresholds: Sequence[float] | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
    dump_samples: int = 0,
    seed: int = 0,
    progress: bool = False,
    numerics: Numerics = DEFAULT_NUMERICS,
) -> ProfileResult:
    """Run the model dense over a text and count active neurons per layer.

    Args:
        model: the model; it runs dense, with an observer (``RunOptions``).
        ids: the text's tokens.
        ctx: window length; windows are non-overlapping, each in a fresh context.
        max_tokens: token budget; windows are spread evenly over the text (None: all).
        target_sparsity: SiLU models: the quantile of the score ``|h| · ‖down_t‖`` that sets
            each layer's threshold, calibrated on the first ``CALIB_TOKENS`` tokens of the run
            (a first pass over those windows). Ignored for ReLU models.
        thresholds: SiLU models: explicit per-layer thresholds (overrides ``target_sparsity``).
        dump_dir: where to write ``samples/`` (required when ``dump_samples`` > 0).
        dump_samples: tokens per layer to dump for predictor training (0: none).
        seed: RNG seed of the sample choice.
        progress: show a tqdm bar.

    Returns:
        A ``ProfileResult``.

    Raises:
        ValueError: a SiLU model without ``target_sparsity`` or ``thresholds``; thresholds of the
            wrong length; bad window settings (see ``corpus.window_starts``).
    """
    a = model.args
    kind = activation_kind(model)
    thr: np.ndarray | None = None
    if kind != KIND_RELU:
        if thresholds is not None:
            thr = np.asarray(thresholds, dtype=np.float64)
            if thr.shape != (a.n_layer,):
                raise ValueError(f"got {thr.size} thresholds for a {a.n_layer}-layer model")
        elif target_sparsity is None:
            raise ValueError(
                f"a {kind} model has no exact zeros: give a target sparsity "
                "(e.g. --target-sparsity 0.5) or per-layer thresholds"
            )
    arr = np.asarray(ids, dtype=np.int64)
    starts = window_starts(len(arr), ctx, max_tokens)
    n_total = len(starts) * ctx
    writer = None
    if dump_samples > 0:
        if dump_dir is None:
            raise ValueError("dump_samples needs a dump directory")
        n = min(dump_samples, n_total)
        picks = np.sort(np.random.default_rng(seed).choice(n_total, n, replace=False))
        writer = _SampleWriter(
            Path(dump_dir) / SAMPLES_DIR, a.n_layer, a.n_embd, a.ffn_neurons, picks
        )

    dn = down_norms(model)
    if kind != KIND_RELU and thr is None:
        assert target_sparsity is not None
        thr = _calibrate_run(model, arr, starts, ctx, dn, target_sparsity, numerics)
    counts = [torch.zeros(a.ffn_neurons, dtype=torch.int64) for _ in range(a.n_layer)]
    state = {"pos": 0}

    def observer(l: int, x: torch.Tensor, h: torch.Tensor) -> None:
        if a.moe and not a.layer_moe(l):
            return  # a leading dense layer: placed whole, its neurons are not counted
        t = None if thr is None else float(thr[l])
        counts[l] += active_mask(h, kind, t, dn[l], _group(model, l)).sum(0)
        if writer is not None:
            writer.write(l, state["pos"], x, h)

    opts = RunOptions(sparse=False, observer=observer, numerics=numerics)
    bar = tqdm(total=n_total, desc="profile", unit="tok", disable=not progress)
    for s in starts:
        model.forward(torch.from_numpy(arr[s : s + ctx].copy()), model.new_cache(ctx), opts)
        state["pos"] += ctx
        bar.update(ctx)
    bar.close()

    result = ProfileResult(
        kind=kind,
        n_embd=a.n_embd,
        counts=[c.numpy() for c in counts],
        n_tokens=n_total,
        thresholds=thr,
        target_sparsity=target_sparsity if kind != KIND_RELU and thresholds is None else None,
    )
    if writer is not None:
        result.n_samples = len(writer.picks)
        result.samples_dir = writer.dir
        writer.close(_meta(result), dn)
    return result


def _meta(r: ProfileResult) -> dict:
    return {
        "kind": r.kind,
        "n_layer": len(r.counts),
        "n_embd": r.n_embd,
        "n_ff": len(r.counts[0]),
        "n_tokens": r.n_tokens,
        "n_samples": r.n_samples,
        "target_sparsity": r.target_sparsity,
        "thresholds": None if r.thresholds is None else [float(t) for t in r.thresholds],
        "active_fraction": [float(f) for f in r.active_fraction()],
    }


def write_profile(result: ProfileResult, directory: str | os.PathLike[str]) -> list[Path]:
    """Write ``activation_{i}.pt`` (int64 counts) and ``profile.json`` into ``directory``.

    Args:
        result: a profiling result.
        directory: created if missing; each file is written atomically.

    Returns:
        The activation files in layer order.
    """
    from powerpy.formats.stats import save_activation_stats

    d = Path(directory)
    paths = save_activation_stats(d, [torch.from_numpy(c) for c in result.counts])
    _write_json(d / PROFILE_JSON, _meta(result))
    return paths


def load_samples(directory: str | os.PathLike[str]) -> dict:
    """The ``meta.json`` of a sample dump, with ``dir`` added.

    Raises:
        FileNotFoundError: the dump or its meta.json is missing.
        ValueError: meta.json is not valid JSON.
    """
    d = Path(directory)
    path = d / SAMPLES_META
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: dump samples with --dump-samples N")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    meta["dir"] = d
    return meta


def sample_arrays(meta: dict, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer of a sample dump: memory-mapped x (N, n_embd) fp16 and |h| (N, n_ff) fp16, and
    the layer's output-row norms (n_ff,) f32."""
    d = Path(meta["dir"])
    return (
        np.load(d / f"x_{layer}.npy", mmap_mode="r"),
        np.load(d / f"a_{layer}.npy", mmap_mode="r"),
        np.load(d / DOWN_NORM_FILE)[layer],
    )
