"""The cut as one step for a user's own model: profile a text, set each layer's threshold at a
quantile of ``|h_j| · ‖down_j‖``, and write a model file that carries the thresholds as
``powerpy.ffn_down_threshold``.

``powerpy cut`` runs ``down_cuts``, then one of two writers:

- ``write_cut``: a copy of a mixture of experts or a PWRI file with the key (tensors, magic and
  predictors kept). A mixture of experts' score counts the routed experts' neurons only,
  weighted by the routing weight (docs/moe.md#the-cut); its copy stays a GGUF that llama.cpp
  reads too (it ignores the key).
- ``write_cut_model``: a dense GGUF of any GLU model (SwiGLU, GeGLU), whose neurons are not
  naturally sparse, becomes a PWRI file that computes every neuron's gate and up rows and skips
  the down rows of neurons whose contribution is below its layer's cut. It writes the file
  through ``convert``: every layer ungated (``powerpy.dense_layers``), the cuts, the model's own
  activation (``powerpy.sparse_activation``), and placeholder predictors (all zeros, 32 hidden
  units) where the format needs them. They run nowhere in powerpy; a reader that ignores
  ``dense_layers`` and gates every layer finds all neurons active (logit 0 above the file's
  ``sparse_threshold`` of -1), so it runs dense.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from tqdm.auto import tqdm

from powerpy.config import ModelArgs
from powerpy.formats.constants import GGUFValueType, Keys
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.gguf_writer import write_gguf
from powerpy.model.numerics import DEFAULT as DEFAULT_NUMERICS
from powerpy.model.numerics import Numerics
from powerpy.model.options import RunOptions
from powerpy.model.transformer import Model
from powerpy.pipeline.corpus import window_starts
from powerpy.pipeline.predictors import PREDICTOR_FILE, save_predictor, write_config
from powerpy.pipeline.profile import calibrate_thresholds, down_norms, group_score, magnitude_score

log = logging.getLogger(__name__)


PLACEHOLDER_HIDDEN = 32  # hidden units of the placeholder predictors (one Q8_0 block per row)
PLACEHOLDER_THRESHOLD = -1.0  # below their logit 0: a reader that gates finds every neuron on
SCORES_PER_LAYER = 1_000_000  # scores kept per layer for the quantile (a random subset)


def down_cuts(
    model: Model,
    ids: Sequence[int] | npt.NDArray[np.integer],
    share: float,
    *,
    ctx: int = 256,
    max_tokens: int | None = 4096,
    numerics: Numerics = DEFAULT_NUMERICS,
    progress: bool = False,
) -> npt.NDArray[np.float64]:
    """Per-layer cuts: the ``share`` quantile of ``|h_j| · ‖ffn_down_t[j]‖`` over the neurons
    that contribute (``h_j != 0``) in a dense run over ``ids``; in a mixture of experts of
    those scores' sums over each cut group (``Experts.cut_group`` neurons, h weighted by the
    routing weight) of the routed experts.

    Args:
        model: the model (run dense, whatever its file).
        ids: the calibration text's token ids.
        share: the share of down rows to skip, in [0, 1).
        ctx: window length; the windows are spread over the text (``window_starts``).
        max_tokens: tokens to run (None: the whole text).
        numerics: the run's numerics (llama.cpp's by default, as the runs the cuts serve).
        progress: a tqdm bar.

    Returns:
        (n_layer,) cuts >= 0.

    Raises:
        ValueError: ``share`` outside [0, 1), or a text shorter than one window.
    """
    if not 0.0 <= share < 1.0:
        raise ValueError(f"cut share {share} must be in [0, 1), e.g. 0.4")
    arr = np.asarray(ids, dtype=np.int64)
    starts = window_starts(len(arr), ctx, max_tokens)
    dn = down_norms(model)
    per_window = max(1, SCORES_PER_LAYER // len(starts))
    gen = torch.Generator().manual_seed(0)
    scores: list[list[torch.Tensor]] = [[] for _ in dn]

    a = model.args
    dense = [l for l in range(a.n_layer) if a.moe and not a.layer_moe(l)]  # no cut there

    def observer(l: int, x: torch.Tensor, h: torch.Tensor) -> None:
        if l in dense:
            return
        ex = model.weights.blk[l].moe  # a mixture's cut is by groups (docs/moe.md#the-cut)
        score = magnitude_score(h, dn[l].to(h.device))
        if ex is not None:
            score = group_score(score, ex.cut_group)
        v = score[score != 0].cpu()
        if v.numel() > per_window:
            v = v[torch.randint(v.numel(), (per_window,), generator=gen)]
        scores[l].append(v)

    opts = RunOptions(sparse=False, observer=observer, numerics=numerics)
    for s in tqdm(starts, desc="cut", unit="window", disable=not progress):
        model.forward(torch.from_numpy(arr[s : s + ctx].copy()), model.new_cache(ctx), opts)
    for l in dense:  # a leading dense layer of a mixture of experts: a cut of 0
        scores[l].append(torch.zeros(1))
    empty = [l for l, v in enumerate(scores) if not sum(t.numel() for t in v)]
    if empty:
        raise ValueError(f"layers {empty[:8]} computed no neuron on the calibration text")
    cuts = calibrate_thresholds([torch.cat(v) for v in scores], share)
    log.info(
        "cuts at share %.2f over %d tokens: %s",
        share,
        len(starts) * ctx,
        ", ".join(f"{t:.4g}" for t in cuts),
    )
    return np.maximum(cuts, 0.0)


def write_cut_model(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    cuts: Sequence[float],
    *,
    activation: str,
    outtype: str = "auto",
    name: str | None = None,
    extra: dict | None = None,
    progress: bool = False,
) -> Path:
    """Write ``src`` (a dense GGUF, or a PWRI file whose predictors are replaced) as a PWRI file
    with every layer ungated and the per-layer ``cuts`` (module docstring).

    Args:
        src: the model file.
        out: the PWRI file (written atomically; never ``src``).
        cuts: one cut >= 0 per layer.
        activation: the FFN activation the file runs ("silu", "gelu", "relu": the model's own).
        outtype: as ``convert``'s (default "auto": the source's types).
        name: ``general.name`` (default the source's).
        extra: more ``config.json`` entries under ``powerpy`` (how the cuts were made).
        progress: a tqdm bar.

    Returns:
        The output path.

    Raises:
        ValueError: cuts of the wrong count or sign, or what ``convert`` refuses.
    """
    from powerpy.config import ModelArgs
    from powerpy.pipeline.convert import convert

    with read_gguf(src) as gf:
        a = ModelArgs.from_gguf(gf)
    cuts = [float(t) for t in cuts]
    if len(cuts) != a.n_layer or not all(0.0 <= t < float("inf") for t in cuts):
        raise ValueError(f"need {a.n_layer} finite cuts >= 0 (one per layer), got {cuts[:4]}")
    with tempfile.TemporaryDirectory(prefix="powerpy-cut-") as tmp:
        d = Path(tmp)
        fc1 = torch.zeros(PLACEHOLDER_HIDDEN, a.n_embd)
        fc2 = torch.zeros(a.n_ff, PLACEHOLDER_HIDDEN)
        for l in range(a.n_layer):
            save_predictor(d / PREDICTOR_FILE.format(l=l), fc1, fc2)
        meta = {"dense_layers": list(range(a.n_layer)), **(extra or {})}
        write_config(
            d,
            PLACEHOLDER_THRESHOLD,
            None if activation == "relu" else activation,
            {"ffn_down_threshold": cuts, "powerpy": {"calibration": meta}},
        )
        return convert(
            src, d, out, outtype=outtype, activation=activation, name=name, progress=progress
        )


def write_cut(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    thresholds: Sequence[float],
    *,
    progress: bool = False,
) -> Path:
    """A copy of model ``src`` at ``dst`` with ``powerpy.ffn_down_threshold`` = ``thresholds``
    (one per layer, >= 0; replacing any the file had); tensors and other keys as they were;
    ``progress``: a tqdm bar over the bytes copied.

    Raises:
        ValueError: a dense GGUF without experts (``write_cut_model`` writes those); a
            threshold count that is not the layer count, or a negative or non-finite
            threshold; ``dst`` is ``src``.
    """
    if Path(dst).resolve() == Path(src).resolve():
        raise ValueError(f"{dst}: write the cut to a new file, not over the model itself")
    with read_gguf(src) as gf:
        arch = gf.kv.get(Keys.ARCHITECTURE)
        if not gf.sparse and not gf.kv.get(Keys.EXPERT_COUNT.format(arch=arch), 0):
            raise ValueError(
                f"{src}: a dense GGUF without experts has no sparse mode to carry a cut: "
                "`powerpy cut` writes it as a PWRI file with every layer ungated and its cuts"
            )
        n_layer = ModelArgs.from_gguf(gf).n_layer  # the layers run (not a NextN layer)
        cuts = [float(t) for t in thresholds]
        if len(cuts) != n_layer or not all(0 <= t < float("inf") for t in cuts):
            raise ValueError(
                f"{len(cuts)} thresholds for a {n_layer}-layer model, or some negative or "
                f"infinite: {cuts[:4]}"
            )
        kv = gf.typed_kv()
        kv[Keys.FFN_DOWN_THRESHOLD] = (cuts, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
        out = write_gguf(
            dst, kv, gf.tensor_specs(), magic=gf.magic, alignment=gf.alignment, progress=progress
        )
    log.info("wrote %s with per-layer cuts %s", dst, [round(t, 6) for t in cuts])
    return out
