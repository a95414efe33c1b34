"""Hybrid placement as plain data: what goes to the accelerator under a VRAM budget.

A :class:`Placement` combines three decisions (``docs/architecture.md#hybrid-placement``):

1. the dense offload pass (``budget.plan_offload``): attention, predictors, ffn_norm,
   output, then the V and K caches, stopping at the first tensor that does not fit;
2. the KV cache, on the accelerator only when every dense tensor **and** both caches fit;
3. the hot-neuron split: per layer the ``gpu_bucket`` of a
   :class:`~powerpy.formats.gpuidx.GpuIndex`, charged ``k_l · neuron_bytes_l`` (exact rows of
   gate, up and down_t at the file's types) and truncated deterministically when it would
   overrun what is left of the budget.

It holds names, byte counts and int32 numpy arrays only; no torch, no device. The dense pass
runs once per placement: :meth:`Placement.with_index` applies another index to the same pass.
``placement.runtime`` turns a placement into tensors on a device, ``placement.lifecycle`` is the
index lifecycle and ``placement.solve`` makes an index. :meth:`Placement.summary` is the
one report, printed by ``powerpy gen-gpuidx`` and ``powerpy infer``::

    with read_gguf(path) as f:
        placement = Placement.for_model(f, budget_bytes(4.0), GpuIndex.read(idx_path))
    print(placement.summary())
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from powerpy.config import ModelArgs
from powerpy.errors import PlacementError
from powerpy.formats.gpuidx import GpuIndex
from powerpy.placement.budget import (
    DENSE_LEVELS,
    HOT_FFN,
    KV,
    KV_K,
    KV_V,
    FfnLayout,
    OffloadPlan,
    plan_offload,
)
from powerpy.placement.experts import expert_layout
from powerpy.placement.split import check_stats, fit_buckets, mass_coverage, whole_groups

if TYPE_CHECKING:
    from powerpy.formats.gguf_reader import GGUFFile

logger = logging.getLogger(__name__)

__all__ = ["HOT_FFN", "KV", "LayerPlacement", "Placement", "SolveSummary"]


@dataclass(frozen=True, eq=False)
class LayerPlacement:
    """The hot neurons of one layer.

    Attributes:
        n_ff: neurons in the layer.
        gpu_bucket: ``(k,)`` int32, strictly ascending ids of the neurons on the accelerator.
        neuron_bytes: bytes of one neuron's rows (gate, up, down_t) at the file's types.
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


@dataclass(frozen=True)
class SolveSummary:
    """How a GPU index was solved (``placement.solve``), for the summary.

    Attributes:
        capacity: hot-neuron capacity in neurons (before flooring to groups).
        capacity_mode: ``"exact"`` or ``"upstream"`` (docs/architecture.md#hot-neuron-capacity).
        batch: group size in neurons.
        threshold: smallest non-zero neuron count per layer.
        method: the solver method that ran, or None when nothing was solved.
        optimal: the solver proved optimality.
        seconds: solver wall time.
        total_seconds: solver plus export (top-k per layer) wall time.
    """

    capacity: int
    capacity_mode: str
    batch: int
    threshold: int
    method: str | None = None
    optimal: bool = False
    seconds: float = 0.0
    total_seconds: float = 0.0


@dataclass(frozen=True, eq=False)
class Placement:
    """Where every part of a model runs under a VRAM budget; plain data.

    Attributes:
        plan: the dense offload pass, including the V/K candidates, the budget, n_ctx
            and the KV element size.
        ffn: the FFN rows the split moves (bytes per neuron per layer).
        layers: per layer, the hot neurons.
        index: the GPU index applied (before any truncation), or None.
        notes: one line per noteworthy decision (KV cache refused, index truncated, ...).
        empty_reason: why no neuron is on the accelerator, when none is.
        coverage: ``(n_layer,)`` share of each layer's activation mass on the accelerator, when
            statistics were given.
        total_coverage: the same over all layers.
        solve: how the index was solved, when it was solved here.
    """

    plan: OffloadPlan
    ffn: FfnLayout
    layers: tuple[LayerPlacement, ...]
    index: GpuIndex | None = None
    notes: tuple[str, ...] = field(default=())
    empty_reason: str | None = None
    coverage: tuple[float, ...] | None = None
    total_coverage: float | None = None
    solve: SolveSummary | None = None

    def __post_init__(self) -> None:
        # The one invariant everything else relies on.
        if self.used > self.budget:
            raise AssertionError(f"placement uses {self.used} bytes of a {self.budget} budget")

    # --- construction
    @classmethod
    def build(
        cls,
        plan: OffloadPlan,
        ffn: FfnLayout,
        index: GpuIndex | None = None,
        *,
        stats: Sequence[npt.ArrayLike] | None = None,
        solve: SolveSummary | None = None,
        empty_reason: str | None = None,
    ) -> Placement:
        """Apply an index to a dense pass that already ran.

        Args:
            plan: the dense offload pass.
            ffn: the model's FFN layout.
            index: the hot-neuron split, or None for no split (``--disable-gpu-index``, or no
                index could be made).
            stats: per-layer activation statistics: they choose which neurons survive when the
                index must be truncated (the hottest win; without them the lowest ids do) and
                give the coverage.
            solve: how the index was solved, for the summary.
            empty_reason: why the split is empty, when the caller knows better than "no index".

        Returns:
            The placement; ``used <= budget`` always.

        Raises:
            ValueError: an index or statistics that do not match the layer count or n_ff.
        """
        n_layer, n_ff = len(ffn.neuron_bytes), ffn.n_ff
        arrays = None if stats is None else check_stats(stats, n_layer, n_ff)
        notes: list[str] = []
        if plan.dense_complete and plan.stop_message:
            notes.append(plan.stop_message)  # the KV cache did not fit (already logged)
        buckets: list[npt.NDArray[np.int32]] = [np.zeros(0, np.int32)] * n_layer
        if index is not None:
            index.validate(n_layer, n_ff)
            if plan.dense_complete:
                asked = list(index.gpu_bucket)
                if any(len(asked[l]) for l in ffn.dense_layers):
                    note = (
                        f"the index places hot rows in leading dense layers {ffn.dense_layers}, "
                        "whose FFN the dense pass places whole: those rows are left out"
                    )
                    logger.info("%s", note)
                    notes.append(note)
                for l in ffn.dense_layers:
                    asked[l] = np.zeros(0, np.int32)
                buckets, note = fit_buckets(asked, ffn.neuron_bytes, plan.split_budget, arrays)
                buckets, partial = whole_groups(buckets, ffn.groups)
                if partial:
                    notes.append(partial)
                if note is None and index.vram_capacity > plan.split_budget:
                    note = (
                        f"the index was made for {index.vram_capacity} bytes, more than the "
                        f"{plan.split_budget} left, but its rows fit at their exact size"
                    )
                    logger.info("%s", note)
                if note:
                    notes.append(note)
        layers = tuple(
            LayerPlacement(n_ff, b, nb) for b, nb in zip(buckets, ffn.neuron_bytes, strict=True)
        )
        if not plan.dense_complete:
            empty_reason = plan.stop_message
        elif any(lp.k for lp in layers):
            empty_reason = None
        elif empty_reason is None:
            empty_reason = (
                "no GPU index"
                if index is None
                else "the GPU index places no neuron"
                if not index.counts.any()
                else f"no hot row fits in the {plan.split_budget} bytes left"
            )
        coverage, total = (None, None) if arrays is None else mass_coverage(arrays, buckets)
        return cls(plan, ffn, layers, index, tuple(notes), empty_reason, coverage, total, solve)

    def with_index(
        self,
        index: GpuIndex | None,
        *,
        stats: Sequence[npt.ArrayLike] | None = None,
        solve: SolveSummary | None = None,
        empty_reason: str | None = None,
    ) -> Placement:
        """The same dense pass with another index applied (see :meth:`build`)."""
        return Placement.build(
            self.plan, self.ffn, index, stats=stats, solve=solve, empty_reason=empty_reason
        )

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
        ffn: FfnLayout | None = None,
        n_embd_v: int | None = None,
    ) -> Placement:
        """Build a placement from tensor sizes (a model header, or model args plus infos).

        Args:
            tensors: ``(gguf_name, nbytes)`` of the model's tensors in file order.
            n_layer: layer count.
            n_ff: neurons per layer.
            n_embd_gqa: KV width (for the KV cache bytes).
            budget: VRAM budget in bytes (``>= 0``).
            index: the hot-neuron split to apply, or None for no split.
            n_ctx: context length of the KV cache.
            kv_elem_bytes: 2 (f16) or 4 (f32) bytes per cached value.
            stats: per-layer activation statistics (see :meth:`build`).
            ffn: the FFN layout when known (from the header); else computed from ``tensors``.
            n_embd_v: the V cache's width when not ``n_embd_gqa`` (a latent cache: 0).

        Returns:
            The placement; ``used <= budget`` always.

        Raises:
            ValueError: a negative budget, a bad ``n_ctx``/``kv_elem_bytes``, an index that does
                not match ``n_layer``/``n_ff``, or missing FFN tensors.
        """
        _check_kv(n_ctx, kv_elem_bytes)
        sizes = dict(tensors)
        ffn = ffn or FfnLayout.from_sizes(sizes, n_layer, n_ff)
        plan = plan_offload(
            sizes.items(),
            budget=budget,
            n_layer=n_layer,
            n_embd_gqa=n_embd_gqa,
            n_ctx=n_ctx,
            kv_elem_bytes=kv_elem_bytes,
            n_embd_v=n_embd_v,
            dense_ffn_layers=ffn.dense_layers,
        )
        return cls.build(plan, ffn, index, stats=stats)

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
        """:meth:`from_tensors` for an open PowerInfer model or mixture of experts (its header
        only; an expert neuron is counted as ``placement.experts`` says, a latent KV cache
        (DeepSeek-2) as its one row of keys a token and layer).

        Raises:
            ValueError: a dense (GGUF-magic) model without experts, a header without the keys
                or FFN tensors a split needs, or see :meth:`from_tensors`.
        """
        args = ModelArgs.from_gguf(model)
        if not model.sparse and not args.moe:
            raise PlacementError(
                f"{model.path} is a dense GGUF (magic {model.magic!r}); a hybrid placement and "
                f"its GPU index are for PowerInfer (PWRI) models and mixtures of experts"
            )
        _check_kv(n_ctx, kv_elem_bytes)
        if any(t.split and t.field == "ffn_up" for t in args.family.block):  # phi3
            raise PlacementError(
                f"{model.path}: a hybrid placement of {args.arch} models is not supported: their "
                f"ffn_up fuses the gate and up rows; run without a VRAM budget (CPU-only)"
            )
        if args.moe:
            ffn = expert_layout(model, args)
        else:
            ffn = FfnLayout.from_gguf(model, args)
        return cls.from_tensors(
            ((t.name, t.nbytes) for t in model.tensors.values()),
            n_layer=args.n_layer,
            n_ff=args.ffn_neurons,
            n_embd_gqa=args.n_embd_gqa,
            budget=budget,
            index=index,
            n_ctx=n_ctx,
            kv_elem_bytes=kv_elem_bytes,
            stats=stats,
            ffn=ffn,
            n_embd_v=0 if args.kv_lora_rank else None,  # MLA: the values are the latent's
        )

    # --- views
    @property
    def budget(self) -> int:
        """The budget in bytes."""
        return self.plan.budget

    @property
    def n_ctx(self) -> int:
        """Context length the KV cache was charged for."""
        return self.plan.n_ctx

    @property
    def kv_elem_bytes(self) -> int:
        """2 (f16 cache) or 4 (f32 cache)."""
        return self.plan.kv_elem_bytes

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def n_ff(self) -> int:
        return self.ffn.n_ff

    @property
    def index_capacity(self) -> int | None:
        """``split.vram_capacity`` of the index applied, or None without one."""
        return None if self.index is None else self.index.vram_capacity

    @property
    def gpu_tensors(self) -> tuple[str, ...]:
        """Names of the dense tensors on the accelerator, in offload order."""
        return tuple(e.name for e in self.plan.entries if e.on_gpu and e.category in DENSE_LEVELS)

    @property
    def kv_on_gpu(self) -> bool:
        """Both caches on the accelerator (only when every dense tensor fit)."""
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
        """The placement report ``powerpy gen-gpuidx`` and ``powerpy infer`` print.

        Budget by category, the index and how it was solved, notes, then per layer the hot
        neurons, their bytes and (with statistics) the activation mass they cover.
        """
        from powerpy.placement.report import summary_text

        return summary_text(self, device)

    def __repr__(self) -> str:
        return (
            f"<Placement: budget {self.budget} B, used {self.used} B, "
            f"{self.n_hot}/{self.n_layer * self.n_ff} neurons hot>"
        )

    def _repr_html_(self) -> str:
        from powerpy.placement.report import summary_html

        return summary_html(self)


def _check_kv(n_ctx: int, kv_elem_bytes: int) -> None:
    if kv_elem_bytes not in (2, 4):
        raise ValueError(f"kv_elem_bytes must be 2 (f16) or 4 (f32), got {kv_elem_bytes}")
    if n_ctx <= 0:
        raise ValueError(f"n_ctx must be > 0, got {n_ctx}")
