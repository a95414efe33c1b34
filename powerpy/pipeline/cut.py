"""The cut as one step for a user's own model: profile a text, set each layer's threshold at a
quantile of ``|h_j| · ‖down_j‖``, and write a copy of the model file that carries the thresholds
as ``powerpy.ffn_down_threshold`` (``powerpy profile --target-sparsity S --write-cut OUT``).

For a mixture of experts the score is taken over the routed experts' neurons only, weighted by
the routing weight (docs/moe.md#the-cut); the copy stays a GGUF that llama.cpp reads too (it
ignores the key). A PWRI file keeps its magic and predictors. A dense non-MoE GGUF has no
sparse mode to carry a cut: convert it to PWRI first (``powerpy convert``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from powerpy.formats.constants import GGUFValueType, Keys
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.gguf_writer import write_gguf

log = logging.getLogger(__name__)


def check_cut_target(path: str | os.PathLike[str]) -> None:
    """Raise ``ValueError`` when the file at ``path`` cannot carry a cut (before profiling)."""
    with read_gguf(path) as gf:
        arch = gf.kv.get(Keys.ARCHITECTURE)
        experts = gf.kv.get(Keys.EXPERT_COUNT.format(arch=arch), 0)
        if not gf.sparse and not experts:
            raise ValueError(
                f"{path}: a dense GGUF without experts has no sparse mode to carry a cut: "
                "convert it to a PWRI file (powerpy convert, with ffn_down_threshold in the "
                "predictor directory's config.json)"
            )


def write_cut(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    thresholds: Sequence[float],
) -> Path:
    """A copy of model ``src`` at ``dst`` with ``powerpy.ffn_down_threshold`` = ``thresholds``
    (one per layer, >= 0; replacing any the file had); tensors and other keys as they were.

    Raises:
        ValueError: see :func:`check_cut_target`; a threshold count that is not the layer
            count, or a negative or non-finite threshold; ``dst`` is ``src``.
    """
    check_cut_target(src)
    if Path(dst).resolve() == Path(src).resolve():
        raise ValueError(f"{dst}: write the cut to a new file, not over the model itself")
    with read_gguf(src) as gf:
        arch = gf.kv.get(Keys.ARCHITECTURE)
        n_layer = int(gf.kv[Keys.BLOCK_COUNT.format(arch=arch)])
        cuts = [float(t) for t in thresholds]
        if len(cuts) != n_layer or not all(0 <= t < float("inf") for t in cuts):
            raise ValueError(
                f"{len(cuts)} thresholds for a {n_layer}-layer model, or some negative or "
                f"infinite: {cuts[:4]}"
            )
        kv = gf.typed_kv()
        kv[Keys.FFN_DOWN_THRESHOLD] = (cuts, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
        out = write_gguf(dst, kv, gf.tensor_specs(), magic=gf.magic, alignment=gf.alignment)
    log.info("wrote %s with per-layer cuts %s", dst, [round(t, 6) for t in cuts])
    return out
