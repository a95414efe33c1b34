"""The GPU index lifecycle at load: reuse ``<model>.generated.gpuidx`` or make it
(docs/architecture.md#index-lifecycle).

:func:`resolve_placement` is the engine's placement at load, used by the API and the CLI alike
(through ``placement.runtime.place``): one dense offload pass, then the index is reused
when :func:`resolve_gpuidx` allows it, or solved in process from ``activation/`` and written.
Failures to make an index are logged and leave the hot-neuron split empty; they are not fatal.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from powerpy.config import ModelArgs
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.gpuidx import GpuIndex, default_gpuidx_path
from powerpy.placement.budget import CapacityMode
from powerpy.placement.placement import Placement
from powerpy.placement.solve import solve_placement

if TYPE_CHECKING:
    from powerpy.formats.gguf_reader import GGUFFile

logger = logging.getLogger(__name__)

__all__ = ["GpuIdxDecision", "resolve_gpuidx", "resolve_placement"]


@dataclass(frozen=True)
class GpuIdxDecision:
    """Whether to reuse an existing index file.

    Attributes:
        action: ``"reuse"`` or ``"regenerate"``.
        path: the index path (``<model>.generated.gpuidx`` unless given).
        reason: one line saying why.
        index: the loaded index when reused, else None.
    """

    action: Literal["reuse", "regenerate"]
    path: Path
    reason: str
    index: GpuIndex | None = None


def resolve_gpuidx(
    model_path: str | os.PathLike[str],
    remaining_bytes: int,
    *,
    reset: bool = False,
    n_layer: int | None = None,
    n_ff: int | None = None,
    path: str | os.PathLike[str] | None = None,
) -> GpuIdxDecision:
    """Apply the engine's reuse rule to ``<model>.generated.gpuidx``.

    Reuse iff the file exists, ``--reset-gpu-index`` is absent, it reads and validates, it holds
    ``2·n_layer`` tensors and ``split.vram_capacity <= remaining_bytes``. So an index made for a
    smaller budget is reused under a larger one; a hint is logged that ``--reset-gpu-index``
    would use the extra VRAM.

    Args:
        model_path: the model file.
        remaining_bytes: ``R``, the bytes left for the split now.
        reset: ``--reset-gpu-index``: always regenerate.
        n_layer: the model's layer count; read from the model header when None.
        n_ff: the model's neurons per layer; read from the header when ``n_layer`` is None.
        path: the index path, default ``<model>.generated.gpuidx``.

    Returns:
        A :class:`GpuIdxDecision`.

    Raises:
        FileNotFoundError: ``n_layer`` is None and the model does not exist.
        ValueError: ``n_layer`` is None and the model header lacks the needed keys.
    """
    idx_path = default_gpuidx_path(model_path) if path is None else Path(path)
    if reset:
        return GpuIdxDecision("regenerate", idx_path, "--reset-gpu-index was given")
    if not idx_path.exists():
        return GpuIdxDecision("regenerate", idx_path, f"no index at {idx_path}")
    if n_layer is None:
        with read_gguf(model_path) as model:
            args = ModelArgs.from_gguf(model)
        n_layer, n_ff = args.n_layer, args.n_ff
    try:
        index = GpuIndex.read(idx_path, n_layer=n_layer, n_ff=n_ff)
    except ValueError as e:
        reason = f"the previous split could not be applied: {e}"
        logger.info("%s", reason)
        return GpuIdxDecision("regenerate", idx_path, reason)
    if index.vram_capacity > remaining_bytes:
        reason = (
            f"the previous split was made for {index.vram_capacity} bytes but only "
            f"{remaining_bytes} are available"
        )
        logger.info("%s; regenerating", reason)
        return GpuIdxDecision("regenerate", idx_path, reason)
    reason = f"reusing {idx_path} (made for {index.vram_capacity} bytes)"
    if index.vram_capacity < remaining_bytes:
        logger.info(
            "%s: it was made for %d bytes but %d are available now; --reset-gpu-index would "
            "regenerate it to use the extra %d bytes",
            idx_path,
            index.vram_capacity,
            remaining_bytes,
            remaining_bytes - index.vram_capacity,
        )
    return GpuIdxDecision("reuse", idx_path, reason, index)


def resolve_placement(
    model: GGUFFile,
    budget: int,
    *,
    n_ctx: int = 2048,
    kv_elem_bytes: int = 2,
    reset_gpu_index: bool = False,
    disable_gpu_index: bool = False,
    activation_dir: str | os.PathLike[str] | None = None,
    index_path: str | os.PathLike[str] | None = None,
    capacity_mode: CapacityMode = "exact",
    batch: int = 256,
    write_index: bool = True,
) -> Placement:
    """The engine's placement at load: dense pass, then the GPU index lifecycle.

    1. The dense offload pass (run once) gives ``R`` (0 when it stopped early: no split then).
    2. ``--disable-gpu-index`` skips the split.
    3. ``<model>.generated.gpuidx`` is reused when it validates and its
       ``split.vram_capacity <= R`` (unless ``reset_gpu_index``); otherwise it is regenerated in
       process from ``activation_dir`` (default ``dirname(model)/activation``) and written.
    4. A missing activation directory or a failed generation logs an error and leaves the split
       empty; neither is fatal.

    Args:
        model: the open PowerInfer model (header only is read here).
        budget: VRAM budget in bytes (``budget.budget_bytes``).
        n_ctx: KV cache context length (also what a generated index is made for).
        kv_elem_bytes: 2 (f16 cache) or 4 (f32).
        reset_gpu_index: ``--reset-gpu-index``: regenerate even when the file could be reused.
        disable_gpu_index: ``--disable-gpu-index``: no FFN split.
        activation_dir: statistics directory (default ``dirname(model)/activation``).
        index_path: index file (default ``<model>.generated.gpuidx``).
        capacity_mode: ``"exact"`` or ``"upstream"`` for a generated index
            (docs/architecture.md#hot-neuron-capacity).
        batch: solver group size (must divide n_ff).
        write_index: write a regenerated index to ``index_path``.

    Returns:
        The :class:`Placement`.

    Raises:
        ValueError: a dense (GGUF-magic) model, or a header without the keys/tensors needed.
    """
    dense = Placement.for_model(model, budget, n_ctx=n_ctx, kv_elem_bytes=kv_elem_bytes)
    if disable_gpu_index:
        reason = "--disable-gpu-index: all FFN rows stay on the CPU"
        logger.info("%s", reason)
        return dense.with_index(None, empty_reason=reason)
    if not dense.plan.dense_complete:
        return dense  # the dense pass logged where it stopped; the split is skipped
    decision = resolve_gpuidx(
        model.path,
        dense.plan.split_budget,
        reset=reset_gpu_index,
        n_layer=dense.n_layer,
        n_ff=dense.n_ff,
        path=index_path,
    )
    if decision.action == "reuse":
        logger.info("%s", decision.reason)
        return dense.with_index(decision.index)
    logger.info("generating the GPU index: %s", decision.reason)
    act_dir = Path(activation_dir) if activation_dir else Path(model.path).parent / "activation"
    if not act_dir.is_dir():
        reason = (
            f"activation directory {act_dir} not found (expected activation_0.pt … "
            f"activation_{dense.n_layer - 1}.pt): the hot-neuron split is empty; pass its "
            f"location or run `powerpy gen-gpuidx --activation DIR`"
        )
        logger.error("%s", reason)
        return dense.with_index(None, empty_reason=reason)
    try:
        from powerpy.formats.stats import load_activation_stats  # imports torch

        stats = load_activation_stats(act_dir, dense.n_layer, dense.n_ff)
        placement = solve_placement(dense, stats, capacity_mode=capacity_mode, batch=batch)
    except (ValueError, OSError) as e:
        reason = f"GPU index generation failed ({e}): the hot-neuron split is empty"
        logger.error("%s", reason)
        return dense.with_index(None, empty_reason=reason)
    assert placement.index is not None
    if write_index:
        try:
            placement.index.write(decision.path)
            logger.info("wrote %s", decision.path)
        except OSError as e:
            logger.warning("could not write %s (%s); using the index in memory", decision.path, e)
    return placement
