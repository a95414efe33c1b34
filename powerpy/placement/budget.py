"""VRAM budget arithmetic: dense offload order, KV cache bytes and hot-neuron capacity.

Plain data and integer arithmetic over tensor names and byte sizes; no torch, no device, no file
access (``ModelArgs.from_gguf`` and ``FfnLayout.from_gguf`` read an open ``GGUFFile`` header).
Rules: ``docs/architecture.md#vram-budget`` (budget),
``docs/architecture.md#dense-offload-order`` (offload order) and
``docs/architecture.md#hot-neuron-capacity`` (budget → neuron capacity). The steps, as
``Placement.for_model`` and the GPU-index solver run them::

    budget = budget_bytes(vram_budget_gib, free_vram)                   # bytes
    plan = plan_offload(tensor_sizes, budget=budget, n_layer=..., ...)  # dense pass
    capacity = hot_capacity(plan.split_budget, FfnLayout.from_gguf(f, args))  # neurons
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

from powerpy.config import ModelArgs
from powerpy.errors import PlacementError
from powerpy.formats.constants import TYPE_TRAITS, GGMLType, Names, bias_name
from powerpy.placement.levels import (  # the tensors' levels, re-exported
    ATTN,
    CATEGORY_ORDER,
    DENSE_LEVELS,
    FFN,
    FFN_NORM,
    HOST,
    HOT_FFN,
    KV,
    KV_K,
    KV_V,
    OUTPUT,
    PREDICTOR,
    classify_tensor,
)

if TYPE_CHECKING:
    from powerpy.formats.gguf_reader import GGUFFile

logger = logging.getLogger(__name__)

__all__ = [
    "ATTN",
    "CAPACITY_MODES",
    "CATEGORY_ORDER",
    "DENSE_LEVELS",
    "FFN",
    "FFN_NORM",
    "GIB",
    "HOST",
    "HOT_FFN",
    "KV",
    "KV_K",
    "KV_V",
    "OUTPUT",
    "PREDICTOR",
    "CapacityMode",
    "FfnLayout",
    "OffloadEntry",
    "OffloadPlan",
    "budget_bytes",
    "capacity_exact",
    "capacity_upstream",
    "classify_tensor",
    "hot_capacity",
    "kv_cache_bytes",
    "plan_offload",
]

GIB = 1 << 30
MIB = 1 << 20
VRAM_RESERVE_BYTES = 256 * MIB  # --vram-budget < 0: free VRAM minus this


# --- budget ---------------------------------------------------------------------------------------
def budget_bytes(vram_budget_gib: float, free_vram: int | None = None) -> int:
    """Convert ``--vram-budget`` (GiB) to bytes; the one place that does.

    Args:
        vram_budget_gib: budget in GiB; a negative value means "all free VRAM".
        free_vram: free device bytes (the caller asks the device; this module never touches
            it), or None when there is no device that reports free memory (no CUDA device, or
            the emulated CPU accelerator). Only read when the budget is negative.

    Returns:
        ``int(gib · 2**30)``, not clamped to the device; for a negative budget, ``free_vram``
        minus 256 MiB (at least 0).

    Raises:
        ValueError: a negative budget without ``free_vram``, or a non-finite budget.
    """
    if vram_budget_gib != vram_budget_gib or vram_budget_gib in (float("inf"), float("-inf")):
        raise PlacementError(f"--vram-budget must be a finite number of GiB, got {vram_budget_gib}")
    if vram_budget_gib < 0:
        if free_vram is None:
            raise PlacementError(
                f"--vram-budget {vram_budget_gib:g} means all free VRAM, but no device reports "
                "its free memory (no CUDA device, or the emulated CPU accelerator); give the "
                "budget in GiB"
            )
        return max(0, int(free_vram) - VRAM_RESERVE_BYTES)
    return int(vram_budget_gib * GIB)


def kv_cache_bytes(n_embd_gqa: int, n_layer: int, n_ctx: int, elem_bytes: int = 2) -> int:
    """Bytes of the V cache (or of the K cache; they are equal).

    ``n_embd_gqa · n_layer · n_ctx · elem_bytes``; ``elem_bytes`` is 2 for f16, 4 with
    ``--memory-f32``.
    """
    return n_embd_gqa * n_layer * n_ctx * elem_bytes


# --- the dense offload pass -----------------------------------------------------------------------
class OffloadEntry(NamedTuple):
    """One candidate of the offload pass: a tensor, or ``"kv_v"``/``"kv_k"``."""

    name: str
    category: str
    nbytes: int
    on_gpu: bool


@dataclass(frozen=True)
class OffloadPlan:
    """What the dense pass puts on the GPU, and what is left for the hot neurons.

    Attributes:
        entries: every candidate in offload order (dense tensors, then V and K caches);
            ``on_gpu`` is False from the first one that did not fit on.
        bytes_by_category: bytes placed on the GPU per category (``CATEGORY_ORDER`` keys).
        dense_complete: every dense tensor fit (the KV cache and the split are only tried then).
        remaining: budget minus everything placed (``R`` of the capacity when ``dense_complete``).
        budget: the budget in bytes.
        n_ctx: context length the KV cache candidates were sized for.
        kv_elem_bytes: 2 (f16 cache) or 4 (f32 cache).
        stopped_at: the first entry that did not fit, or None.
        host_only: tensors that never move (token_embd, unknown names).
    """

    entries: list[OffloadEntry]
    bytes_by_category: dict[str, int]
    dense_complete: bool
    remaining: int
    budget: int
    n_ctx: int
    kv_elem_bytes: int
    stopped_at: OffloadEntry | None = None
    host_only: tuple[str, ...] = field(default=())

    @property
    def used(self) -> int:
        """Bytes placed on the GPU."""
        return self.budget - self.remaining

    @property
    def kv_on_gpu(self) -> bool:
        """Both the V and the K cache are on the GPU."""
        return all(e.on_gpu for e in self.entries if e.category in (KV_V, KV_K))

    @property
    def split_budget(self) -> int:
        """Bytes for the hot-neuron split: ``remaining``, or 0 when the dense pass stopped."""
        return self.remaining if self.dense_complete else 0

    @property
    def stop_message(self) -> str | None:
        """Why the pass stopped, and what that leaves on the host; None when all fit.

        The one place that says "the dense part does not fit" (then the KV cache and
        the hot-neuron split stay on the host).
        """
        e = self.stopped_at
        if e is None:
            return None
        where = f"the offload pass stopped at {e.name} ({e.nbytes} bytes, {self.remaining} left)"
        if not self.dense_complete:
            return (
                f"the dense tensors do not all fit in the {self.budget}-byte budget: {where}, "
                "so the KV cache stays on the host and the hot-neuron split is skipped"
            )
        v_only = (
            "; the V cache fit but the K cache did not: both caches stay on the host "
            f"({self.bytes_by_category[KV_V]} bytes of the budget left unused)"
            if e.category == KV_K
            else ""
        )
        return f"the KV cache does not fit in the {self.budget}-byte budget: {where}{v_only}"


def plan_offload(
    tensors: Iterable[tuple[str, int]],
    *,
    budget: int,
    n_layer: int,
    n_embd_gqa: int,
    n_ctx: int,
    kv_elem_bytes: int = 2,
    n_embd_v: int | None = None,
    dense_ffn_layers: Collection[int] = (),
) -> OffloadPlan:
    """Run PowerInfer's dense offload pass (docs/architecture.md#dense-offload-order) over
    tensor sizes.

    Order: ATTN → predictors (fc1, fc2) → ffn_norm → output_norm/output → V cache → K cache.
    Within a level, layers go from 0, each tensor in llama.cpp's creation order. The first
    tensor that does not fit stops the whole pass (nothing later is tried). The KV cache is
    only tried when every dense tensor fit. FFN weights are left to the hot-neuron split
    (except ``dense_ffn_layers``'), and ``token_embd`` and friends never move.

    Args:
        tensors: ``(name, nbytes)`` of the model's tensors, in file order.
        budget: VRAM budget in bytes (``>= 0``).
        n_layer: layer count (for the KV cache).
        n_embd_gqa: KV width (for the KV cache; the K cache's with ``n_embd_v``).
        n_ctx: context length (for the KV cache).
        kv_elem_bytes: 2 (f16 cache) or 4 (``--memory-f32``).
        n_embd_v: the V cache's width when it is not ``n_embd_gqa`` (DeepSeek-2's latent
            cache: 0, its values are a view of its keys).
        dense_ffn_layers: a mixture's leading dense layers: their FFN is placed whole, in the
            predictors' level (every token runs it), like a shared expert.

    Returns:
        An :class:`OffloadPlan`; placed bytes never exceed ``budget``.

    Raises:
        ValueError: a negative budget or size.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0 bytes, got {budget}")
    keyed = []
    host: list[str] = []
    for pos, (name, nbytes) in enumerate(tensors):
        if nbytes < 0:
            raise ValueError(f"tensor {name!r} has negative size {nbytes}")
        cat, layer, rank = classify_tensor(name)
        if layer >= n_layer:  # a NextN layer (glm4moe): loaded by llama.cpp, run by neither
            cat = HOST
        if cat == FFN and layer in dense_ffn_layers:
            cat = PREDICTOR
        if cat in DENSE_LEVELS:
            keyed.append(((DENSE_LEVELS.index(cat), layer, rank, pos), name, cat, int(nbytes)))
        elif cat == HOST:
            host.append(name)
            if rank == 1 << 20:
                logger.debug("tensor %s has no offload level; it stays on the host", name)
    keyed.sort(key=lambda k: k[0])
    kv = kv_cache_bytes(n_embd_gqa, n_layer, n_ctx, kv_elem_bytes)
    kv_v = kv if n_embd_v is None else kv_cache_bytes(n_embd_v, n_layer, n_ctx, kv_elem_bytes)
    candidates = [(name, cat, nb) for _, name, cat, nb in keyed]
    candidates += [(KV_V, KV_V, kv_v), (KV_K, KV_K, kv)]

    remaining = int(budget)
    entries: list[OffloadEntry] = []
    by_cat = dict.fromkeys(CATEGORY_ORDER, 0)
    stopped: OffloadEntry | None = None
    for name, cat, nb in candidates:
        fits = stopped is None and nb <= remaining
        entry = OffloadEntry(name, cat, nb, fits)
        if fits:
            remaining -= nb
            by_cat[cat] += nb
        elif stopped is None:
            stopped = entry
        entries.append(entry)
    dense_complete = stopped is None or stopped.category in (KV_V, KV_K)
    plan = OffloadPlan(
        entries,
        by_cat,
        dense_complete,
        remaining,
        int(budget),
        n_ctx,
        kv_elem_bytes,
        stopped,
        tuple(host),
    )
    if plan.stop_message:
        logger.info("%s", plan.stop_message)
    return plan


# --- what the budget needs from a model header ----------------------------------------------------
# the per-neuron slices a hot row takes to the device: rows of gate (if any), up and down_t,
# and up's bias (OPT) element; the down matrix's bias is one vector, not sliced
_FFN_TEMPLATES = (Names.FFN_GATE, Names.FFN_UP, Names.FFN_DOWN_T, bias_name(Names.FFN_UP))
_OPTIONAL = (Names.FFN_GATE, bias_name(Names.FFN_UP))


@dataclass(frozen=True)
class FfnLayout:
    """The FFN rows the hot-neuron split moves to the GPU
    (docs/architecture.md#hot-neuron-capacity).

    Attributes:
        n_ff: neurons per layer (rows of ffn_gate, ffn_up and ffn_down_t).
        neuron_bytes: ``(n_layer,)`` bytes of one neuron in each layer: a row of gate (if
            any), up and down_t at the file's types, and up's bias element (if any).
        has_gate: the model has ``ffn_gate`` (LLaMA family, Bamboo).
        up_type: ggml type of layer 0's ``ffn_up`` (what upstream's capacity formula reads);
            None when the layout was built from byte sizes alone.
    """

    n_ff: int
    neuron_bytes: tuple[int, ...]
    has_gate: bool
    up_type: GGMLType | None = None
    dense_layers: tuple[int, ...] = ()  # layers without hot rows: a mixture's leading dense
    # layers, whose FFN the dense pass places whole
    groups: tuple[int, ...] = ()  # per layer, neurons placed only together (a mixture's cut
    # groups, so the device and the host each judge whole groups; 0 or absent: any neuron)

    @classmethod
    def from_sizes(
        cls,
        sizes: Mapping[str, int],
        n_layer: int,
        n_ff: int,
        *,
        up_type: GGMLType | None = None,
    ) -> FfnLayout:
        """Bytes per neuron from the FFN matrices' byte sizes: the one place they are computed.

        Args:
            sizes: GGUF tensor name -> bytes (the model's tensors; others are ignored).
            n_layer: layer count.
            n_ff: neurons per layer.
            up_type: layer 0's ``ffn_up`` type, when known.

        Returns:
            The layout.

        Raises:
            ValueError: ``ffn_up``/``ffn_down_t`` missing in a layer, or a matrix whose bytes are
                not whole rows of ``n_ff``.
        """
        per_layer = []
        for layer in range(n_layer):
            total = 0
            for template in _FFN_TEMPLATES:
                name = template.format(l=layer)
                if name not in sizes:
                    if template in _OPTIONAL:
                        continue  # ungated architectures slice up and down_t only
                    raise PlacementError(
                        f"tensor {name!r} is missing: a hybrid split needs neuron-major FFN "
                        f"matrices (a PowerInfer file)"
                    )
                if sizes[name] % n_ff:
                    raise PlacementError(
                        f"{name} has {sizes[name]} bytes, not a multiple of n_ff {n_ff}"
                    )
                total += sizes[name] // n_ff
            per_layer.append(total)
        has_gate = Names.FFN_GATE.format(l=0) in sizes
        return cls(n_ff, tuple(per_layer), has_gate, up_type)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, args: ModelArgs) -> FfnLayout:
        """The layout of an open PowerInfer model from its infos (``args``: its ModelArgs).

        Raises:
            ValueError: no ``blk.0.ffn_up``, or FFN matrices that are not ``(n_ff, n_embd)``
                (the message names the file and the tensor).
        """
        src, n_ff, n_embd = gguf.path, args.n_ff, args.n_embd
        up = gguf.tensors.get(Names.FFN_UP.format(l=0))
        if up is None:
            raise PlacementError(
                f"{src}: no tensor {Names.FFN_UP.format(l=0)!r}; is this a PowerInfer model?"
            )
        for layer in range(args.n_layer):
            for template in _FFN_TEMPLATES[:3]:  # the matrices
                t = gguf.tensors.get(template.format(l=layer))
                if t is not None and t.shape != (n_ff, n_embd):
                    raise PlacementError(
                        f"{src}: {t.name} has shape {t.shape}, expected (n_ff, n_embd) = "
                        f"({n_ff}, {n_embd}); PowerInfer files store ffn_down transposed as "
                        f"ffn_down_t"
                    )
        sizes = {t.name: t.nbytes for t in gguf.tensors.values()}
        return cls.from_sizes(sizes, args.n_layer, n_ff, up_type=up.ggml_type)


# --- capacity (docs/architecture.md#hot-neuron-capacity) -----------------------------------------
CapacityMode = Literal["exact", "upstream"]
CAPACITY_MODES: tuple[str, ...] = ("exact", "upstream")


def capacity_exact(remaining: int, bytes_per_neuron: int) -> int:
    """Neurons that fit in ``remaining`` bytes at their true size (powerpy's default).

    Args:
        remaining: bytes left for the split (``R``); negative counts as 0.
        bytes_per_neuron: ``FfnLayout.neuron_bytes`` of a layer.

    Returns:
        ``floor(R / bytes_per_neuron)``.

    Raises:
        ValueError: ``bytes_per_neuron <= 0``.
    """
    if bytes_per_neuron <= 0:
        raise ValueError(f"bytes per neuron must be > 0, got {bytes_per_neuron}")
    return max(0, int(remaining)) // bytes_per_neuron


def capacity_upstream(remaining: int, n_ff: int, ggml_type: GGMLType, *, has_gate: bool) -> int:
    """Upstream's capacity formula (``llm_load_gpu_split_with_budget``), for parity.

    ``slice = int(n_ff·size/blck)``, ``per_slice = int(slice · (4.5 if gate else 2))`` (C
    truncation), ``capacity = floor(R / per_slice) · 4``. This charges ``1.125·n_ff·esize``
    bytes per neuron with a gate instead of ``3·n_embd·esize`` (the 4.5 is an upstream TODO).

    Args:
        remaining: ``R`` in bytes; negative counts as 0.
        n_ff: neurons per layer (``ne1`` of layer 0's ``ffn_up``).
        ggml_type: type of layer 0's ``ffn_up``.
        has_gate: the model has ``ffn_gate``.

    Returns:
        The capacity in neurons, summed over layers.
    """
    tr = TYPE_TRAITS[ggml_type]
    slice_size = n_ff * tr.type_size // tr.block_size
    per_slice = slice_size * 9 // 2 if has_gate else slice_size * 2  # int(slice * 4.5)
    if per_slice <= 0:
        return 0
    return max(0, int(remaining)) // per_slice * 4


def hot_capacity(remaining: int, ffn: FfnLayout, mode: CapacityMode = "exact") -> int:
    """Hot-neuron capacity of a model for ``remaining`` bytes.

    Args:
        remaining: bytes for the split (``OffloadPlan.split_budget``).
        ffn: the model's FFN layout (layer 0's bytes per neuron, as upstream).
        mode: ``"exact"`` (true bytes per neuron; the default) or ``"upstream"`` (the 4.5-factor
            formula, a compatibility switch for parity with PowerInfer's engine).

    Returns:
        Neurons summed over layers (the solver floors it to whole groups).

    Raises:
        ValueError: unknown mode, or upstream mode without the FFN type.
    """
    if mode == "exact":
        return capacity_exact(remaining, ffn.neuron_bytes[0])
    if mode == "upstream":
        if ffn.up_type is None:
            raise ValueError("the upstream capacity formula needs the FFN type (a model header)")
        return capacity_upstream(remaining, ffn.n_ff, ffn.up_type, has_gate=ffn.has_gate)
    raise ValueError(f"capacity mode must be one of {', '.join(CAPACITY_MODES)}, got {mode!r}")
