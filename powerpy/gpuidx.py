"""GPU index (``<model>.generated.gpuidx``): which neurons of each layer live on the GPU.

Format: ``powerinfer-format.md`` §7 (a PWRI container with three key/values and interleaved
``blk.{l}.gpu_idx`` / ``blk.{l}.gpu_bucket`` I32 tensors), export rule §8.3, reuse rule §10.3.

- :class:`GpuIndex` is plain data (int32 numpy arrays plus two numbers): build it from solver
  counts (:meth:`GpuIndex.from_counts`), read it (:meth:`GpuIndex.read`, by position like the
  engine, validated) and write it byte-compatible with PowerInfer (:meth:`GpuIndex.write`).
- :func:`generate_gpuidx` is the in-process pipeline shared by ``powerpy gen-gpuidx`` and the
  runtime: model header + statistics + VRAM budget → offload plan → capacity → solver → index.
- :func:`resolve_gpuidx` decides whether an existing index file can be reused.

No torch here (``tie_break="torch"`` imports it on demand); statistics come in as numpy arrays
from ``powerpy.stats``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from powerpy.budget import (
    CapacityMode,
    ModelDims,
    OffloadPlan,
    hot_capacity,
    plan_offload_for_model,
)
from powerpy.constants import (
    GPUIDX_SUFFIX,
    PWRI_MAGIC,
    PWRI_TYPE_IDS,
    GGMLType,
    GGUFValueType,
    Keys,
    Names,
)
from powerpy.gguf_io import GGUFFile, read_gguf, write_gguf
from solver import SolveResult, solve

logger = logging.getLogger(__name__)

__all__ = [
    "GPUIDX_VERSION",
    "GpuIdxDecision",
    "GpuIndex",
    "GpuIndexReport",
    "TieBreak",
    "default_gpuidx_path",
    "generate_gpuidx",
    "resolve_gpuidx",
    "topk_bucket",
]

GPUIDX_VERSION = 3
I32_PWRI_ID = next(i for i, t in PWRI_TYPE_IDS.items() if t is GGMLType.I32)  # 18

TieBreak = Literal["stable", "torch"]


def default_gpuidx_path(model_path: str | os.PathLike[str]) -> Path:
    """``<model path>.generated.gpuidx``, where the engine looks for the index."""
    return Path(os.fspath(model_path) + GPUIDX_SUFFIX)


# --- export rule (§8.3) ---------------------------------------------------------------------------
def topk_bucket(
    stats: npt.ArrayLike, k: int, *, tie_break: TieBreak = "stable"
) -> npt.NDArray[np.int32]:
    """The ``k`` most active neurons of a layer, ascending: its ``gpu_bucket``.

    Upstream takes ``torch.topk(stats, k)`` on the raw statistics and sorts the indices. Which
    of several equal values make the cut is an implementation detail of ``torch.topk``.

    Args:
        stats: 1-D statistics of one layer.
        k: neurons to select, ``0 <= k <= len(stats)``.
        tie_break: ``"stable"`` (default): order by (-value, index), so among equal values the
            lower index wins; deterministic everywhere, no torch. ``"torch"``: call the
            installed ``torch.topk`` as upstream's exporter does, for byte identity with
            upstream files when values tie at the cut (integer counts often do); this is a
            compatibility switch and imports torch.

    Returns:
        ``(k,)`` int32 strictly ascending neuron ids.

    Raises:
        ValueError: ``k`` out of range, stats not 1-D, or unknown ``tie_break``.
    """
    a = np.asarray(stats)
    if a.ndim != 1:
        raise ValueError(f"statistics must be 1-D, got shape {a.shape}")
    if not 0 <= k <= a.shape[0]:
        raise ValueError(f"cannot select {k} of {a.shape[0]} neurons")
    if tie_break == "stable":
        order = np.argsort(-a.astype(np.float64), kind="stable")[:k]
    elif tie_break == "torch":
        import torch

        t = torch.from_numpy(np.ascontiguousarray(a.astype(np.float64, copy=False)))
        # topk is comparison-based, so an order-preserving dtype change keeps its choice
        order = torch.topk(t, int(k)).indices.numpy()
    else:
        raise ValueError(f"tie_break must be 'stable' or 'torch', got {tie_break!r}")
    return np.sort(order).astype(np.int32)


# --- the index ------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class GpuIndex:
    """Per-layer GPU neuron placement, as stored in ``.generated.gpuidx``.

    The bucket is the truth; ``gpu_idx`` is its 0/1 mask, kept because the file stores both.

    Attributes:
        gpu_idx: per layer, ``(n_ff,)`` int32 with 1 where the neuron is on the GPU.
        gpu_bucket: per layer, ``(k_l,)`` int32 strictly ascending ids of those neurons.
        vram_capacity: bytes the index was made for (``split.vram_capacity``, §10.3 reuse).
        block_count: ``generic.gpu_index.block_count`` (activation files loaded; never read by
            the engine).
    """

    gpu_idx: list[npt.NDArray[np.int32]]
    gpu_bucket: list[npt.NDArray[np.int32]]
    vram_capacity: int
    block_count: int

    # --- construction
    @classmethod
    def from_buckets(
        cls,
        buckets: Sequence[npt.ArrayLike],
        n_ff: int,
        *,
        vram_capacity: int,
        block_count: int | None = None,
    ) -> GpuIndex:
        """Build from per-layer neuron ids (any order; duplicates are an error).

        Args:
            buckets: one array of neuron ids per layer.
            n_ff: neurons per layer.
            vram_capacity: bytes the index is made for.
            block_count: defaults to the layer count.

        Returns:
            A validated index.

        Raises:
            ValueError: ids out of range or repeated.
        """
        idx, bkt = [], []
        for layer, b in enumerate(buckets):
            ids = np.asarray(b, dtype=np.int64).reshape(-1)
            if ids.size and (ids.min() < 0 or ids.max() >= n_ff):
                raise ValueError(f"layer {layer}: neuron ids must be in [0, {n_ff})")
            ids = np.sort(ids)
            if np.any(np.diff(ids) == 0):
                raise ValueError(f"layer {layer}: repeated neuron ids")
            mask = np.zeros(n_ff, dtype=np.int32)
            mask[ids] = 1
            idx.append(mask)
            bkt.append(ids.astype(np.int32))
        n_layer = len(idx)
        index = cls(idx, bkt, int(vram_capacity), n_layer if block_count is None else block_count)
        index.validate(n_layer, n_ff)
        return index

    @classmethod
    def from_counts(
        cls,
        stats: Sequence[npt.ArrayLike],
        counts: Sequence[int] | npt.NDArray[np.integer],
        *,
        vram_capacity: int,
        block_count: int | None = None,
        tie_break: TieBreak = "stable",
    ) -> GpuIndex:
        """Export rule of §8.3: layer ``l`` keeps the ``counts[l]`` most active neurons.

        Args:
            stats: per-layer 1-D statistics used for the selection (the raw values, not the
                groups). For upstream's bug #247 pass the lexicographically paired list
                (``powerpy.stats.load_activation_stats(..., compat_lexicographic=True)``).
            counts: neurons per layer (from the solver).
            vram_capacity: bytes the index is made for.
            block_count: defaults to the layer count.
            tie_break: see :func:`topk_bucket`.

        Returns:
            A validated index.

        Raises:
            ValueError: lengths differ, or a count is negative or larger than ``n_ff``.
        """
        counts = np.asarray(counts, dtype=np.int64)
        if len(stats) != counts.shape[0]:
            raise ValueError(f"{len(stats)} layers of statistics but {counts.shape[0]} counts")
        if len(stats) == 0:
            raise ValueError("cannot build a GPU index for 0 layers")
        n_ff = np.asarray(stats[0]).shape[0]
        buckets = [
            topk_bucket(s, int(k), tie_break=tie_break) for s, k in zip(stats, counts, strict=True)
        ]
        return cls.from_buckets(buckets, n_ff, vram_capacity=vram_capacity, block_count=block_count)

    @classmethod
    def empty(cls, n_layer: int, n_ff: int, *, vram_capacity: int = 0) -> GpuIndex:
        """No neuron on the GPU (zero masks, empty buckets).

        Args:
            n_layer: layer count.
            n_ff: neurons per layer.
            vram_capacity: bytes the index is made for.

        Returns:
            The empty index.
        """
        return cls.from_buckets([[]] * n_layer, n_ff, vram_capacity=vram_capacity)

    # --- views
    @property
    def n_layer(self) -> int:
        return len(self.gpu_bucket)

    @property
    def n_ff(self) -> int:
        return int(self.gpu_idx[0].shape[0]) if self.gpu_idx else 0

    @property
    def counts(self) -> npt.NDArray[np.int64]:
        """``(n_layer,)`` neurons on the GPU per layer."""
        return np.array([b.shape[0] for b in self.gpu_bucket], dtype=np.int64)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GpuIndex):
            return NotImplemented
        return (
            self.vram_capacity == other.vram_capacity
            and self.block_count == other.block_count
            and self.n_layer == other.n_layer
            and all(np.array_equal(a, b) for a, b in zip(self.gpu_idx, other.gpu_idx, strict=True))
            and all(
                np.array_equal(a, b) for a, b in zip(self.gpu_bucket, other.gpu_bucket, strict=True)
            )
        )

    __hash__ = None  # type: ignore[assignment]

    # --- checks
    def validate(self, n_layer: int | None = None, n_ff: int | None = None) -> None:
        """Check the index on its own and against a model (§7).

        Args:
            n_layer: the model's layer count, or None to skip that check.
            n_ff: the model's neurons per layer, or None to take layer 0's.

        Raises:
            ValueError: a layer-count or n_ff mismatch (e.g. "the index holds 80 tensors but a
                32-layer model needs 64"), masks that are not 0/1, buckets that are not strictly
                increasing or out of range, ``gpu_idx[bucket] != 1``, ``Σ gpu_idx != len(bucket)``,
                or a negative ``vram_capacity``.
        """
        if len(self.gpu_idx) != len(self.gpu_bucket):
            raise ValueError(
                f"{len(self.gpu_idx)} gpu_idx tensors but {len(self.gpu_bucket)} gpu_bucket tensors"
            )
        if n_layer is not None and self.n_layer != n_layer:
            raise ValueError(
                f"the index holds {2 * self.n_layer} tensors but a {n_layer}-layer model needs "
                f"{2 * n_layer}; regenerate it with `powerpy gen-gpuidx` (or --reset-gpu-index)"
            )
        if not 0 <= self.vram_capacity < 2**64:
            raise ValueError(f"vram_capacity {self.vram_capacity} does not fit a UINT64")
        if not 0 <= self.block_count < 2**32:
            raise ValueError(f"block_count {self.block_count} does not fit a UINT32")
        n_ff = self.n_ff if n_ff is None else n_ff
        for layer, (mask, bucket) in enumerate(zip(self.gpu_idx, self.gpu_bucket, strict=True)):
            where = f"layer {layer}"
            if mask.ndim != 1 or mask.shape[0] != n_ff:
                raise ValueError(
                    f"{where}: gpu_idx has shape {mask.shape} but the model has n_ff = {n_ff}"
                )
            if bucket.ndim != 1:
                raise ValueError(f"{where}: gpu_bucket must be 1-D, got shape {bucket.shape}")
            bad = np.flatnonzero((mask != 0) & (mask != 1))
            if bad.size:
                j = int(bad[0])
                raise ValueError(f"{where}: gpu_idx[{j}] = {mask[j]}, expected 0 or 1")
            if bucket.size:
                if bucket[0] < 0 or bucket[-1] >= n_ff or np.any(bucket < 0):
                    raise ValueError(f"{where}: gpu_bucket has ids outside [0, {n_ff})")
                steps = np.flatnonzero(np.diff(bucket.astype(np.int64)) <= 0)
                if steps.size:
                    j = int(steps[0])
                    raise ValueError(
                        f"{where}: gpu_bucket is not strictly increasing "
                        f"(bucket[{j}] = {bucket[j]}, bucket[{j + 1}] = {bucket[j + 1]})"
                    )
                off = np.flatnonzero(mask[bucket] != 1)
                if off.size:
                    j = int(bucket[off[0]])
                    raise ValueError(f"{where}: gpu_bucket lists neuron {j} but gpu_idx[{j}] = 0")
            total = int(mask.sum())
            if total != bucket.shape[0]:
                raise ValueError(
                    f"{where}: gpu_idx marks {total} neurons but gpu_bucket lists {bucket.shape[0]}"
                )

    # --- file I/O
    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the index as PowerInfer does (§7), atomically.

        PWRI magic, version 3; key/values ``general.architecture = "generic.gpu_index"``,
        ``generic.gpu_index.block_count`` (UINT32), ``split.vram_capacity`` (UINT64), in that
        order; tensors ``blk.{l}.gpu_idx``, ``blk.{l}.gpu_bucket`` interleaved, I32 (id 18).

        Args:
            path: destination (replaced atomically).

        Returns:
            The path.

        Raises:
            ValueError: the index is inconsistent (see :meth:`validate`).
        """
        self.validate()
        kv = {
            Keys.ARCHITECTURE: (Keys.GPUIDX_ARCH, GGUFValueType.STRING),
            Keys.GPUIDX_BLOCK_COUNT: (int(self.block_count), GGUFValueType.UINT32),
            Keys.SPLIT_VRAM_CAPACITY: (int(self.vram_capacity), GGUFValueType.UINT64),
        }
        tensors = []
        for layer, (mask, bucket) in enumerate(zip(self.gpu_idx, self.gpu_bucket, strict=True)):
            tensors.append((Names.GPU_IDX.format(l=layer), _i32(mask), GGMLType.I32))
            tensors.append((Names.GPU_BUCKET.format(l=layer), _i32(bucket), GGMLType.I32))
        out = write_gguf(path, kv, tensors, magic=PWRI_MAGIC, version=GPUIDX_VERSION)
        logger.debug("wrote %s: %d layers, %d GPU neurons", out, self.n_layer, self.counts.sum())
        return out

    @classmethod
    def read(
        cls,
        path: str | os.PathLike[str],
        *,
        n_layer: int | None = None,
        n_ff: int | None = None,
        strict_names: bool = True,
    ) -> GpuIndex:
        """Read and validate an index file.

        Tensors are taken **by position** as the engine does (``2l`` = gpu_idx, ``2l+1`` =
        gpu_bucket); their names are checked too, because a file in another order would load
        wrong data in the engine without any error.

        Args:
            path: the ``.gpuidx`` file.
            n_layer: the model's layer count, to check ``n_tensors == 2·n_layer``.
            n_ff: the model's neurons per layer.
            strict_names: raise on a name that does not match its position (default); False
                only logs a warning and loads by position like the engine.

        Returns:
            The validated index (arrays are copies; the file is closed).

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a PWRI file, a missing or mistyped ``split.vram_capacity``, a tensor
                that is not 1-D I32 (type id 18), names out of place, or any check of
                :meth:`validate` (``GGUFFormatError`` for malformed containers).
        """
        path = Path(path)
        with read_gguf(path) as f:
            return cls._from_file(f, n_layer=n_layer, n_ff=n_ff, strict_names=strict_names)

    @classmethod
    def _from_file(
        cls, f: GGUFFile, *, n_layer: int | None, n_ff: int | None, strict_names: bool
    ) -> GpuIndex:
        src = f.path
        if f.magic != PWRI_MAGIC:
            raise ValueError(
                f"{src}: magic {f.magic!r}; a GPU index is a PWRI file (upstream writes it with "
                f"gguf-py and patches the magic)"
            )
        arch = f.kv.get(Keys.ARCHITECTURE)
        if arch != Keys.GPUIDX_ARCH:
            logger.warning("%s: architecture %r, expected %r", src, arch, Keys.GPUIDX_ARCH)
        if Keys.SPLIT_VRAM_CAPACITY not in f.kv:
            raise ValueError(f"{src}: required key {Keys.SPLIT_VRAM_CAPACITY!r} is missing")
        vtype = f.kv_types[Keys.SPLIT_VRAM_CAPACITY]
        if vtype is not GGUFValueType.UINT64:
            raise ValueError(
                f"{src}: {Keys.SPLIT_VRAM_CAPACITY} is {vtype.name}, the engine reads a UINT64"
            )
        infos = list(f.tensors.values())
        if len(infos) % 2:
            raise ValueError(
                f"{src}: {len(infos)} tensors; an index holds gpu_idx and gpu_bucket per layer"
            )
        if n_layer is not None and len(infos) != 2 * n_layer:
            raise ValueError(
                f"{src}: the index holds {len(infos)} tensors but a {n_layer}-layer model needs "
                f"{2 * n_layer}; regenerate it with `powerpy gen-gpuidx` (or --reset-gpu-index)"
            )
        masks, buckets = [], []
        for pos, info in enumerate(infos):
            layer = pos // 2
            template = Names.GPU_BUCKET if pos % 2 else Names.GPU_IDX
            expected = template.format(l=layer)
            if info.name != expected:
                msg = (
                    f"{src}: tensor {pos} is {info.name!r} but the engine reads position {pos} "
                    f"as {expected!r}"
                )
                if strict_names:
                    raise ValueError(msg + "; the file would load wrong data")
                logger.warning("%s; loading by position as the engine does", msg)
            if info.ggml_type is not GGMLType.I32 or info.file_type_id != I32_PWRI_ID:
                raise ValueError(
                    f"{src}: tensor {info.name!r} has type id {info.file_type_id} "
                    f"({info.ggml_type.name}); the engine needs I32 = {I32_PWRI_ID}"
                )
            if len(info.ne) != 1:
                raise ValueError(f"{src}: tensor {info.name!r} has ne {info.ne}, expected 1-D")
            arr = np.array(f.array(info.name), dtype=np.int32)  # copy out of the mapping
            (buckets if pos % 2 else masks).append(arr)
        block_count = int(f.kv.get(Keys.GPUIDX_BLOCK_COUNT, len(masks)))
        index = cls(masks, buckets, int(f.kv[Keys.SPLIT_VRAM_CAPACITY]), block_count)
        try:
            index.validate(n_layer, n_ff)
        except ValueError as e:
            raise ValueError(f"{src}: {e}") from None
        return index


def _i32(a: npt.NDArray[np.integer]) -> npt.NDArray[np.int32]:
    return np.ascontiguousarray(a, dtype=np.int32)


# --- reuse rule (§10.3) ---------------------------------------------------------------------------
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
    """Apply the engine's reuse rule to ``<model>.generated.gpuidx`` (§10.3).

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
            dims = ModelDims.from_gguf(model)
        n_layer, n_ff = dims.n_layer, dims.n_ff
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


# --- generation pipeline --------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuIndexReport:
    """An index and how it was derived (what ``gen-gpuidx`` prints).

    Attributes:
        index: the placement.
        dims: the model's dimensions.
        plan: the dense offload pass.
        capacity: hot-neuron capacity in neurons (before flooring to groups).
        capacity_mode: ``"exact"`` or ``"upstream"``.
        batch: group size.
        threshold: minimum neurons per used layer.
        solve: the solver's result, or None when nothing was solved.
        reason: why the placement is empty, or None.
        coverage: ``(n_layer,)`` share of each layer's activation mass on the GPU (numeric
            pairing, so the cost of ``compat_lexicographic`` shows here).
    """

    index: GpuIndex
    dims: ModelDims
    plan: OffloadPlan
    capacity: int
    capacity_mode: str
    batch: int
    threshold: int
    solve: SolveResult | None
    reason: str | None
    coverage: npt.NDArray[np.float64]
    total_coverage: float

    @property
    def counts(self) -> npt.NDArray[np.int64]:
        return self.index.counts

    @property
    def bytes_by_layer(self) -> npt.NDArray[np.int64]:
        """GPU bytes of each layer's hot rows (gate, up, down_t)."""
        return self.counts * self.dims.neuron_bytes

    @property
    def split_bytes(self) -> int:
        return int(self.bytes_by_layer.sum())

    @property
    def remaining_after(self) -> int:
        """VRAM left after the dense pass, the KV cache and the hot rows."""
        return self.plan.remaining - self.split_bytes

    def format_table(self) -> str:
        """Per-layer table and totals, as printed by ``powerpy gen-gpuidx``."""
        n_ff = self.dims.n_ff
        lines = [f"{'layer':>5} {'hot':>8} {'% n_ff':>7} {'bytes':>14} {'coverage':>9}"]
        for layer, (k, nb, cov) in enumerate(
            zip(self.counts, self.bytes_by_layer, self.coverage, strict=True)
        ):
            lines.append(
                f"{layer:>5} {int(k):>8} {100 * k / n_ff:>6.1f}% {int(nb):>14} {100 * cov:>8.2f}%"
            )
        total = int(self.counts.sum())
        lines.append(
            f"{'total':>5} {total:>8} {100 * total / (n_ff * self.dims.n_layer):>6.1f}% "
            f"{self.split_bytes:>14} {100 * self.total_coverage:>8.2f}%"
        )
        return "\n".join(lines)


def generate_gpuidx(
    model: GGUFFile,
    stats: Sequence[npt.ArrayLike],
    budget: int,
    *,
    n_ctx: int = 2048,
    kv_elem_bytes: int = 2,
    capacity_mode: CapacityMode = "exact",
    batch: int = 256,
    threshold: int = 0,
    time_limit: float = 30.0,
    method: str = "auto",
    export_stats: Sequence[npt.ArrayLike] | None = None,
    tie_break: TieBreak = "stable",
) -> GpuIndexReport:
    """Model header + activation statistics + VRAM budget → GPU index, in process.

    Steps: the dense offload pass (§10.2) gives the split budget ``R``; ``R`` becomes a neuron
    capacity (§8.4); the solver (§8.2) picks per-layer counts; the export rule (§8.3) picks the
    neurons. A budget too small for the dense part or for one group gives an empty index and a
    ``reason`` (not an error). ``split.vram_capacity`` is ``R`` (0 when the dense pass stopped).

    Args:
        model: an open PowerInfer model (header only is read).
        stats: per-layer statistics in numeric order (``powerpy.stats.load_activation_stats``).
        budget: VRAM budget in bytes (``powerpy.budget.budget_bytes``).
        n_ctx: KV cache context length.
        kv_elem_bytes: 2 (f16 cache) or 4 (``--memory-f32``).
        capacity_mode: ``"exact"`` (default) or ``"upstream"`` (PowerInfer's 4.5-factor formula,
            a compatibility switch).
        batch: group size in neurons (divides n_ff).
        threshold: smallest non-zero neuron count per layer.
        time_limit: seconds for the ILP.
        method: solver method (``solver.solve``).
        export_stats: statistics for the export step when they differ from ``stats`` (upstream
            bug #247: ``load_activation_stats(..., compat_lexicographic=True)``).
        tie_break: see :func:`topk_bucket`.

    Returns:
        A :class:`GpuIndexReport` (write it with ``report.index.write(path)``).

    Raises:
        ValueError: a dense model, statistics that do not match the model, bad arguments, or a
            solver failure (``solver.SolverError``).
    """
    if not model.sparse:
        raise ValueError(
            f"{model.path} is a dense GGUF (magic {model.magic!r}); a GPU index is for "
            f"PowerInfer (PWRI) models"
        )
    dims = ModelDims.from_gguf(model)
    arrays = _check_stats(stats, dims, "stats")
    exported = arrays if export_stats is None else _check_stats(export_stats, dims, "export_stats")
    if dims.n_ff % batch:
        raise ValueError(
            f"n_ff = {dims.n_ff} is not a multiple of --batch {batch}; pick a batch dividing it"
        )
    plan = plan_offload_for_model(model, budget, n_ctx=n_ctx, kv_elem_bytes=kv_elem_bytes)
    split_budget = plan.split_budget
    capacity = hot_capacity(split_budget, dims, capacity_mode) if plan.dense_complete else 0

    reason: str | None = None
    result = None
    if not plan.dense_complete:
        stop = plan.stopped_at
        assert stop is not None
        reason = (
            f"the dense tensors do not all fit in the {budget}-byte budget: the offload pass "
            f"stopped at {stop.name} ({stop.nbytes} bytes, {plan.remaining} left), so the "
            f"hot-neuron split is skipped"
        )
    elif capacity < batch:
        reason = (
            f"the {split_budget} bytes left after the dense tensors and KV cache hold {capacity} "
            f"neurons ({capacity_mode} mode, {dims.neuron_bytes} bytes each), fewer than one "
            f"group of {batch}"
        )
    else:
        result = solve(
            arrays,
            capacity,
            batch=batch,
            threshold=threshold,
            time_limit=time_limit,
            method=method,  # type: ignore[arg-type]
        )
        if int(result.counts.sum()) == 0:
            reason = (
                f"the solver placed no neuron (capacity {capacity}, threshold {threshold}): "
                f"no layer reaches the threshold within the capacity, or all statistics are 0"
            )
    if result is None:
        index = GpuIndex.empty(dims.n_layer, dims.n_ff, vram_capacity=split_budget)
    else:
        index = GpuIndex.from_counts(
            exported, result.counts, vram_capacity=split_budget, tie_break=tie_break
        )
    if reason:
        logger.info("empty GPU placement: %s", reason)
    placed = int(index.counts.sum()) * dims.neuron_bytes
    if placed > split_budget:  # only possible in upstream mode (its formula can under-charge)
        logger.warning(
            "the %s capacity formula over-commits: the hot rows need %d bytes but only %d are "
            "left; use the exact capacity mode",
            capacity_mode,
            placed,
            split_budget,
        )

    covered = np.array([float(a[m == 1].sum()) for a, m in zip(arrays, index.gpu_idx, strict=True)])
    totals = np.array([float(a.sum()) for a in arrays])
    with np.errstate(invalid="ignore", divide="ignore"):
        coverage = np.where(totals > 0, covered / np.where(totals > 0, totals, 1), 0.0)
    total_cov = float(covered.sum() / totals.sum()) if totals.sum() > 0 else 0.0
    return GpuIndexReport(
        index,
        dims,
        plan,
        capacity,
        capacity_mode,
        batch,
        threshold,
        result,
        reason,
        coverage,
        total_cov,
    )


def _check_stats(
    stats: Sequence[npt.ArrayLike], dims: ModelDims, what: str
) -> list[npt.NDArray[np.float64]]:
    if len(stats) != dims.n_layer:
        raise ValueError(
            f"{what}: {len(stats)} layers of statistics for a {dims.n_layer}-layer model"
        )
    arrays = [np.asarray(s, dtype=np.float64) for s in stats]
    for layer, a in enumerate(arrays):
        if a.shape != (dims.n_ff,):
            raise ValueError(
                f"{what}: layer {layer} has shape {a.shape}, the model has n_ff = {dims.n_ff}"
            )
    return arrays
