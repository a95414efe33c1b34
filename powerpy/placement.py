"""Hybrid placement as plain data: what goes to the accelerator under a VRAM budget.

A :class:`Placement` combines three decisions (``powerinfer-format.md`` §10):

1. the dense offload pass of §10.2 (``budget.plan_offload``): attention, predictors, ffn_norm,
   output, then the V and K caches, stopping at the first tensor that does not fit;
2. the KV cache, on the accelerator only when every dense tensor **and** both caches fit;
3. the hot-neuron split (§9.3): per layer the ``gpu_bucket`` of a :class:`~powerpy.gpuidx.GpuIndex`,
   charged ``k_l · neuron_bytes_l`` (exact rows of gate, up and down_t at the file's dtype) and
   truncated deterministically when it would overrun what is left of the budget.

It holds names, byte counts and int32 numpy arrays only; no torch, no device. ``runtime``
turns it into tensors on a device. :func:`resolve_placement` is the index lifecycle of §10.3
(reuse ``<model>.generated.gpuidx``, or generate it in process from ``activation/``).

    with read_gguf(path) as f:
        placement = Placement.for_model(f, budget_bytes(4.0), GpuIndex.read(idx_path))
    print(placement.summary())
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from powerpy.budget import (
    ATTN,
    DENSE_LEVELS,
    FFN_NORM,
    KV_K,
    KV_V,
    OUTPUT,
    PREDICTOR,
    CapacityMode,
    ModelDims,
    OffloadPlan,
    plan_offload,
)
from powerpy.constants import Names
from powerpy.gpuidx import GpuIndex, generate_gpuidx, resolve_gpuidx

if TYPE_CHECKING:
    from powerpy.gguf_io import GGUFFile

logger = logging.getLogger(__name__)

__all__ = ["HOT_FFN", "KV", "LayerPlacement", "Placement", "fmt_bytes", "resolve_placement"]

KV = "kv"  # both caches (V and K)
HOT_FFN = "hot_ffn"  # compact hot rows of gate/up/down_t
SUMMARY_CATEGORIES = (ATTN, PREDICTOR, FFN_NORM, OUTPUT, KV, HOT_FFN)
_FFN_TEMPLATES = (Names.FFN_GATE, Names.FFN_UP, Names.FFN_DOWN_T)


# ----------------------------------------------------------------------------------- one layer
@dataclass(frozen=True, eq=False)
class LayerPlacement:
    """The hot neurons of one layer.

    Attributes:
        n_ff: neurons in the layer.
        gpu_bucket: ``(k,)`` int32, strictly ascending ids of the neurons on the accelerator.
        neuron_bytes: bytes of one neuron's rows (gate, up, down_t) at the file's dtype.
    """

    n_ff: int
    gpu_bucket: npt.NDArray[np.int32]
    neuron_bytes: int

    @property
    def k(self) -> int:
        """Neurons on the accelerator."""
        return int(self.gpu_bucket.shape[0])

    @property
    def hot_bytes(self) -> int:
        return self.k * self.neuron_bytes

    @property
    def share(self) -> float:
        """Fraction of the layer's neurons on the accelerator."""
        return self.k / self.n_ff if self.n_ff else 0.0

    def gpu_idx(self) -> npt.NDArray[np.int32]:
        """``(n_ff,)`` int32 mask, 1 where the neuron is on the accelerator."""
        mask = np.zeros(self.n_ff, dtype=np.int32)
        mask[self.gpu_bucket] = 1
        return mask


# ----------------------------------------------------------------------------------- the whole
@dataclass(frozen=True, eq=False)
class Placement:
    """Where every part of a model runs under a VRAM budget; plain data.

    Attributes:
        budget: the budget in bytes.
        n_ctx: context length the KV cache was charged for.
        kv_elem_bytes: 2 (f16 cache) or 4 (f32 cache).
        plan: the dense offload pass (§10.2), including the V/K candidates.
        layers: per layer, the hot neurons.
        index_capacity: ``split.vram_capacity`` of the index applied, or None without one.
        notes: one line per noteworthy decision (split skipped, index truncated, ...).
    """

    budget: int
    n_ctx: int
    kv_elem_bytes: int
    plan: OffloadPlan
    layers: tuple[LayerPlacement, ...]
    index_capacity: int | None = None
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        # The one invariant everything else relies on.
        if self.used > self.budget:
            raise AssertionError(f"placement uses {self.used} bytes of a {self.budget} budget")

    # --- construction
    @classmethod
    def from_tensors(
        cls,
        tensors: Iterable[tuple[str, int]],
        *,
        n_layer: int,
        n_ff: int,
        n_embd_gqa: int,
        budget: int,
        index: GpuIndex | None = None,
        n_ctx: int = 2048,
        kv_elem_bytes: int = 2,
        stats: Sequence[npt.ArrayLike] | None = None,
    ) -> Placement:
        """Build a placement from tensor sizes (a model header, or model args plus infos).

        Args:
            tensors: ``(gguf_name, nbytes)`` of the model's tensors in file order.
            n_layer: layer count.
            n_ff: neurons per layer.
            n_embd_gqa: KV width (for the KV cache bytes).
            budget: VRAM budget in bytes (``>= 0``).
            index: the hot-neuron split to apply, or None for no split
                (``--disable-gpu-index``, or no index could be made).
            n_ctx: context length of the KV cache.
            kv_elem_bytes: 2 (f16) or 4 (f32) bytes per cached value.
            stats: per-layer activation statistics; only used to choose which neurons survive
                when the index must be truncated (the hottest win; without them the lowest
                ids do).

        Returns:
            The placement; ``used <= budget`` always.

        Raises:
            ValueError: a negative budget, an index that does not match ``n_layer``/``n_ff``,
                or missing FFN tensors (``ffn_gate``/``ffn_up``/``ffn_down_t``).
        """
        if kv_elem_bytes not in (2, 4):
            raise ValueError(f"kv_elem_bytes must be 2 (f16) or 4 (f32), got {kv_elem_bytes}")
        if n_ctx <= 0:
            raise ValueError(f"n_ctx must be > 0, got {n_ctx}")
        sizes = dict(tensors)
        plan = plan_offload(
            sizes.items(),
            budget=budget,
            n_layer=n_layer,
            n_embd_gqa=n_embd_gqa,
            n_ctx=n_ctx,
            kv_elem_bytes=kv_elem_bytes,
        )
        nb = _neuron_bytes(sizes, n_layer, n_ff)
        notes: list[str] = []
        if plan.stopped_at is not None and plan.stopped_at.category == KV_K:
            notes.append(
                "the V cache fit but the K cache did not: both caches stay on the host "
                f"({plan.bytes_by_category[KV_V]} bytes of the budget left unused)"
            )
        buckets: list[npt.NDArray[np.int32]] = [np.zeros(0, np.int32)] * n_layer
        capacity = None
        if index is not None:
            index.validate(n_layer, n_ff)
            capacity = index.vram_capacity
            if not plan.dense_complete:
                stop = plan.stopped_at
                assert stop is not None
                notes.append(
                    f"hot-neuron split skipped: the dense pass stopped at {stop.name} "
                    f"({stop.nbytes} bytes, {plan.remaining} left)"
                )
            else:
                buckets, note = _fit_buckets(index.gpu_bucket, nb, plan.split_budget, stats)
                if note:
                    notes.append(note)
                elif capacity > plan.split_budget:
                    notes.append(
                        f"the index was made for {capacity} bytes, more than the "
                        f"{plan.split_budget} left, but its rows fit at their exact size"
                    )
        layers = tuple(
            LayerPlacement(n_ff, b, n) for b, n in zip(buckets, nb, strict=True)
        )  # fmt: skip
        for note in notes:
            logger.info("%s", note)
        return cls(int(budget), n_ctx, kv_elem_bytes, plan, layers, capacity, tuple(notes))

    @classmethod
    def for_model(
        cls,
        model: GGUFFile,
        budget: int,
        index: GpuIndex | None = None,
        *,
        n_ctx: int = 2048,
        kv_elem_bytes: int = 2,
        stats: Sequence[npt.ArrayLike] | None = None,
    ) -> Placement:
        """:meth:`from_tensors` for an open PowerInfer model (its header only).

        Raises:
            ValueError: see :meth:`from_tensors` and ``ModelDims.from_gguf``.
        """
        dims = ModelDims.from_gguf(model)
        return cls.from_tensors(
            ((t.name, t.nbytes) for t in model.tensors.values()),
            n_layer=dims.n_layer,
            n_ff=dims.n_ff,
            n_embd_gqa=dims.n_embd_gqa,
            budget=budget,
            index=index,
            n_ctx=n_ctx,
            kv_elem_bytes=kv_elem_bytes,
            stats=stats,
        )

    # --- views
    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def n_ff(self) -> int:
        return self.layers[0].n_ff if self.layers else 0

    @property
    def gpu_tensors(self) -> tuple[str, ...]:
        """Names of the dense tensors on the accelerator, in offload order."""
        return tuple(e.name for e in self.plan.entries if e.on_gpu and e.category in DENSE_LEVELS)

    @property
    def kv_on_gpu(self) -> bool:
        """Both caches on the accelerator (only when every dense tensor fit, §10.2)."""
        return self.plan.dense_complete and self.plan.kv_on_gpu

    @property
    def kv_bytes(self) -> int:
        """Accelerator bytes of the V and K caches (0 when they stay on the host)."""
        by_cat = self.plan.bytes_by_category
        return by_cat[KV_V] + by_cat[KV_K] if self.kv_on_gpu else 0

    @property
    def n_hot(self) -> int:
        """Neurons on the accelerator, all layers."""
        return sum(layer.k for layer in self.layers)

    @property
    def hot_bytes(self) -> int:
        return sum(layer.hot_bytes for layer in self.layers)

    @property
    def bytes_by_category(self) -> dict[str, int]:
        """Accelerator bytes per category: attn, predictor, ffn_norm, output, kv, hot_ffn."""
        by_cat = self.plan.bytes_by_category
        out = {cat: by_cat.get(cat, 0) for cat in DENSE_LEVELS}
        out[KV] = self.kv_bytes
        out[HOT_FFN] = self.hot_bytes
        return out

    @property
    def used(self) -> int:
        """Accelerator bytes of everything placed."""
        return sum(self.bytes_by_category.values())

    @property
    def remaining(self) -> int:
        """Budget left after the placement."""
        return self.budget - self.used

    @property
    def gpu_share(self) -> npt.NDArray[np.float64]:
        """``(n_layer,)`` fraction of each layer's neurons on the accelerator."""
        return np.array([layer.share for layer in self.layers], dtype=np.float64)

    def gpu_buckets(self) -> list[npt.NDArray[np.int32]]:
        """Per layer, the ascending neuron ids on the accelerator."""
        return [layer.gpu_bucket for layer in self.layers]

    # --- report
    def summary(self, device: str | None = None) -> str:
        """A table: bytes by category, budget left, and the per-layer GPU share of neurons."""
        where = f" on {device}" if device else ""
        lines = [
            f"placement{where}: budget {fmt_bytes(self.budget)}, used {fmt_bytes(self.used)}, "
            f"left {fmt_bytes(self.remaining)}"
        ]
        counts: dict[str, tuple[int, int]] = {}
        for e in self.plan.entries:
            if e.category in DENSE_LEVELS:
                placed, total = counts.get(e.category, (0, 0))
                counts[e.category] = (placed + e.on_gpu, total + 1)
        by_cat = self.bytes_by_category
        for cat in SUMMARY_CATEGORIES:
            if cat == KV:
                what = "on the accelerator" if self.kv_on_gpu else "host"
                detail = f"{what}, n_ctx {self.n_ctx}, {self.kv_elem_bytes} B/value"
            elif cat == HOT_FFN:
                total = self.n_ff * self.n_layer
                detail = f"{self.n_hot}/{total} neurons ({100 * self.n_hot / max(total, 1):.1f}%)"
            else:
                placed, total = counts.get(cat, (0, 0))
                detail = f"{placed}/{total} tensors"
            lines.append(f"  {cat:<10} {fmt_bytes(by_cat[cat]):>11}  {detail}")
        if self.plan.stopped_at is not None:
            e = self.plan.stopped_at
            lines.append(f"  offload stopped at {e.name} ({fmt_bytes(e.nbytes)}): did not fit")
        if self.index_capacity is not None:
            lines.append(
                f"  index made for {fmt_bytes(self.index_capacity)}; split budget "
                f"{fmt_bytes(self.plan.split_budget)}"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        share = [f"{100 * s:.0f}" for s in self.gpu_share]
        per_line = 16
        for s in range(0, len(share), per_line):
            chunk = " ".join(f"{v:>3}" for v in share[s : s + per_line])
            last = min(s + per_line, len(share)) - 1
            lines.append(f"  GPU % of neurons, layers {s:>3}-{last:<3} {chunk}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------- helpers
def _neuron_bytes(sizes: dict[str, int], n_layer: int, n_ff: int) -> list[int]:
    """Per layer, the exact bytes of one neuron: a row of gate, up and down_t each."""
    out = []
    for layer in range(n_layer):
        total = 0
        for template in _FFN_TEMPLATES:
            name = template.format(l=layer)
            if name not in sizes:
                if template is Names.FFN_GATE:
                    continue  # ungated architectures slice up and down_t only
                raise ValueError(
                    f"tensor {name!r} is missing: a hybrid split needs neuron-major FFN "
                    f"matrices (a PowerInfer file)"
                )
            if sizes[name] % n_ff:
                raise ValueError(f"{name} has {sizes[name]} bytes, not a multiple of n_ff {n_ff}")
            total += sizes[name] // n_ff
        out.append(total)
    return out


def _fit_buckets(
    buckets: Sequence[npt.NDArray[np.int32]],
    neuron_bytes: Sequence[int],
    split_budget: int,
    stats: Sequence[npt.ArrayLike] | None,
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
            vals = np.asarray(stats[layer], dtype=np.float64)[b]
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


def fmt_bytes(n: int) -> str:
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if abs(n) >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


# ----------------------------------------------------------------------------------- lifecycle
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
    """The engine's placement at load: dense pass, then the GPU index lifecycle of §10.3.

    1. The dense offload pass gives ``R`` (0 when it stopped early: no split then).
    2. ``--disable-gpu-index`` skips the split.
    3. ``<model>.generated.gpuidx`` is reused when it validates and its
       ``split.vram_capacity <= R`` (unless ``reset_gpu_index``); otherwise it is regenerated in
       process from ``activation_dir`` (default ``dirname(model)/activation``) and written.
    4. A missing activation directory or a failed generation logs an error and leaves the split
       empty; neither is fatal.

    Args:
        model: the open PowerInfer model (header only is read here).
        budget: VRAM budget in bytes.
        n_ctx: KV cache context length (also what a generated index is made for).
        kv_elem_bytes: 2 (f16 cache) or 4 (f32).
        reset_gpu_index: ``--reset-gpu-index``: regenerate even when the file could be reused.
        disable_gpu_index: ``--disable-gpu-index``: no FFN split.
        activation_dir: statistics directory (default ``dirname(model)/activation``).
        index_path: index file (default ``<model>.generated.gpuidx``).
        capacity_mode: ``"exact"`` or ``"upstream"`` (§8.4) for a generated index.
        batch: solver group size (must divide n_ff).
        write_index: write a regenerated index to ``index_path``.

    Returns:
        The :class:`Placement`.

    Raises:
        ValueError: a dense (GGUF-magic) model, or a header without the keys/tensors needed.
    """
    if not model.sparse:
        raise ValueError(
            f"{model.path} is a dense GGUF; a hybrid placement needs a PowerInfer (PWRI) model"
        )
    dims = ModelDims.from_gguf(model)

    def build(index: GpuIndex | None, stats=None) -> Placement:
        return Placement.for_model(
            model, budget, index, n_ctx=n_ctx, kv_elem_bytes=kv_elem_bytes, stats=stats
        )

    dense = build(None)
    if disable_gpu_index:
        logger.info("--disable-gpu-index: all FFN rows stay on the CPU")
        return dense
    if not dense.plan.dense_complete:
        return dense  # the dense pass logged where it stopped; the split is skipped (§10.2)
    r = dense.plan.split_budget
    decision = resolve_gpuidx(
        model.path, r, reset=reset_gpu_index, n_layer=dims.n_layer, n_ff=dims.n_ff, path=index_path
    )
    if decision.action == "reuse":
        logger.info("%s", decision.reason)
        return build(decision.index)
    logger.info("generating the GPU index: %s", decision.reason)
    act_dir = Path(activation_dir) if activation_dir else Path(model.path).parent / "activation"
    if not act_dir.is_dir():
        logger.error(
            "activation directory %s not found (expected activation_0.pt … activation_%d.pt): "
            "the hot-neuron split is empty; pass its location or run `powerpy gen-gpuidx "
            "--activation DIR`",
            act_dir,
            dims.n_layer - 1,
        )
        return dense
    try:
        from powerpy.stats import load_activation_stats  # imports torch

        stats = load_activation_stats(act_dir, dims.n_layer, dims.n_ff)
        report = generate_gpuidx(
            model,
            stats,
            budget,
            n_ctx=n_ctx,
            kv_elem_bytes=kv_elem_bytes,
            capacity_mode=capacity_mode,
            batch=batch,
        )
    except (ValueError, OSError) as e:
        logger.error("GPU index generation failed (%s): the hot-neuron split is empty", e)
        return dense
    if write_index:
        try:
            report.index.write(decision.path)
            logger.info("wrote %s", decision.path)
        except OSError as e:
            logger.warning("could not write %s (%s); using the index in memory", decision.path, e)
    return build(report.index, stats)
