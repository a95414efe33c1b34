"""GPU index file (``<model>.generated.gpuidx``): which neurons of each layer live on the GPU.

Format: ``docs/formats.md#gpu-index-file``, a PWRI container with three key/values and
interleaved ``blk.{l}.gpu_idx`` / ``blk.{l}.gpu_bucket`` I32 tensors. :class:`GpuIndex` is plain
data: per layer the ascending ids of the GPU neurons (the bucket, the single source of truth)
plus two numbers. The 0/1 mask ``gpu_idx`` the file stores beside each bucket is derived on write
and checked against the bucket on read. Reading takes tensors by position, like the engine, and
validates; writing is byte-compatible with PowerInfer's exporter.

Choosing the neurons (solver, export rule: ``docs/architecture.md#export-rule``) is
``powerpy.placement.solve``; whether an existing file is reused
(``docs/architecture.md#index-lifecycle``) is ``powerpy.placement.lifecycle``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from powerpy.errors import FileFormatError, PlacementError, PowerpyError
from powerpy.formats.constants import (
    GPUIDX_SUFFIX,
    PWRI_MAGIC,
    PWRI_TYPE_IDS,
    GGMLType,
    GGUFValueType,
    Keys,
    Names,
)
from powerpy.formats.gguf_reader import GGUFFile, read_gguf
from powerpy.formats.gguf_writer import write_gguf

logger = logging.getLogger(__name__)

__all__ = ["GPUIDX_VERSION", "GpuIndex", "default_gpuidx_path"]

GPUIDX_VERSION = 3
I32_PWRI_ID = next(i for i, t in PWRI_TYPE_IDS.items() if t is GGMLType.I32)  # 18


def default_gpuidx_path(model_path: str | os.PathLike[str]) -> Path:
    """``<model path>.generated.gpuidx``, where the engine looks for the index."""
    return Path(os.fspath(model_path) + GPUIDX_SUFFIX)


@dataclass(frozen=True, eq=False)
class GpuIndex:
    """Per-layer GPU neuron placement, as stored in ``.generated.gpuidx``.

    Attributes:
        gpu_bucket: per layer, ``(k_l,)`` int32 strictly ascending ids of the GPU neurons.
        n_ff: neurons per layer.
        vram_capacity: bytes the index was made for (``split.vram_capacity``, for the reuse rule).
        block_count: ``generic.gpu_index.block_count`` (activation files loaded; never read by
            the engine).
    """

    gpu_bucket: list[npt.NDArray[np.int32]]
    n_ff: int
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
            PlacementError: ids out of range or repeated.
        """
        bkt = []
        for layer, b in enumerate(buckets):
            ids = np.asarray(b, dtype=np.int64).reshape(-1)
            if ids.size and (ids.min() < 0 or ids.max() >= n_ff):
                raise PlacementError(f"layer {layer}: neuron ids must be in [0, {n_ff})")
            ids = np.sort(ids)
            if np.any(np.diff(ids) == 0):
                raise PlacementError(f"layer {layer}: repeated neuron ids")
            bkt.append(ids.astype(np.int32))
        n_layer = len(bkt)
        count = n_layer if block_count is None else block_count
        index = cls(bkt, int(n_ff), int(vram_capacity), count)
        index.validate(n_layer, n_ff)
        return index

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
    def counts(self) -> npt.NDArray[np.int64]:
        """``(n_layer,)`` neurons on the GPU per layer."""
        return np.array([b.shape[0] for b in self.gpu_bucket], dtype=np.int64)

    def mask(self, layer: int) -> npt.NDArray[np.int32]:
        """``(n_ff,)`` int32, 1 where a neuron of ``layer`` is on the GPU (its ``gpu_idx``)."""
        m = np.zeros(self.n_ff, dtype=np.int32)
        m[self.gpu_bucket[layer]] = 1
        return m

    @property
    def gpu_idx(self) -> list[npt.NDArray[np.int32]]:
        """Per layer, the ``(n_ff,)`` 0/1 mask derived from the bucket (the file stores both)."""
        return [self.mask(layer) for layer in range(self.n_layer)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GpuIndex):
            return NotImplemented
        mine = (self.vram_capacity, self.block_count, self.n_layer, self.n_ff)
        if mine != (other.vram_capacity, other.block_count, other.n_layer, other.n_ff):
            return False
        pairs = zip(self.gpu_bucket, other.gpu_bucket, strict=True)
        return all(np.array_equal(a, b) for a, b in pairs)

    __hash__ = None  # type: ignore[assignment]

    # --- checks
    def validate(self, n_layer: int | None = None, n_ff: int | None = None) -> None:
        """Check the index on its own and against a model (docs/formats.md#gpu-index-file).

        Args:
            n_layer: the model's layer count, or None to skip that check.
            n_ff: the model's neurons per layer, or None to skip that check.

        Raises:
            PlacementError: a layer-count or n_ff mismatch (e.g. "the index holds 80 tensors but a
                32-layer model needs 64"), buckets that are not 1-D, not strictly increasing or
                out of range, or counts that do not fit the file's integer types.
        """
        if n_layer is not None and self.n_layer != n_layer:
            raise PlacementError(
                f"the index holds {2 * self.n_layer} tensors but a {n_layer}-layer model needs "
                f"{2 * n_layer}; regenerate it with `powerpy gen-gpuidx` (or --reset-gpu-index)"
            )
        if n_ff is not None and self.n_ff != n_ff:
            raise PlacementError(
                f"the index is for n_ff = {self.n_ff} neurons per layer but the model has "
                f"n_ff = {n_ff}"
            )
        if not 0 <= self.vram_capacity < 2**64:
            raise PlacementError(f"vram_capacity {self.vram_capacity} does not fit a UINT64")
        if not 0 <= self.block_count < 2**32:
            raise PlacementError(f"block_count {self.block_count} does not fit a UINT32")
        for layer, bucket in enumerate(self.gpu_bucket):
            where = f"layer {layer}"
            if bucket.ndim != 1:
                raise PlacementError(f"{where}: gpu_bucket must be 1-D, got shape {bucket.shape}")
            if not bucket.size:
                continue
            if bucket[0] < 0 or bucket[-1] >= self.n_ff or np.any(bucket < 0):
                raise PlacementError(f"{where}: gpu_bucket has ids outside [0, {self.n_ff})")
            steps = np.flatnonzero(np.diff(bucket.astype(np.int64)) <= 0)
            if steps.size:
                j = int(steps[0])
                raise PlacementError(
                    f"{where}: gpu_bucket is not strictly increasing "
                    f"(bucket[{j}] = {bucket[j]}, bucket[{j + 1}] = {bucket[j + 1]})"
                )

    # --- file I/O
    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the index as PowerInfer does (docs/formats.md#gpu-index-file), atomically.

        PWRI magic, version 3; key/values ``general.architecture = "generic.gpu_index"``,
        ``generic.gpu_index.block_count`` (UINT32), ``split.vram_capacity`` (UINT64), in that
        order; tensors ``blk.{l}.gpu_idx``, ``blk.{l}.gpu_bucket`` interleaved, I32 (id 18).

        Args:
            path: destination (replaced atomically).

        Returns:
            The path.

        Raises:
            PlacementError: the index is inconsistent (see :meth:`validate`).
        """
        self.validate()
        kv = {
            Keys.ARCHITECTURE: (Keys.GPUIDX_ARCH, GGUFValueType.STRING),
            Keys.GPUIDX_BLOCK_COUNT: (int(self.block_count), GGUFValueType.UINT32),
            Keys.SPLIT_VRAM_CAPACITY: (int(self.vram_capacity), GGUFValueType.UINT64),
        }
        tensors = []
        for layer, bucket in enumerate(self.gpu_bucket):
            tensors.append((Names.GPU_IDX.format(l=layer), self.mask(layer), GGMLType.I32))
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
        wrong data in the engine without any error. Each ``gpu_idx`` must be the 0/1 mask of
        its bucket (the engine never checks this).

        Args:
            path: the ``.gpuidx`` file.
            n_layer: the model's layer count, to check ``n_tensors == 2·n_layer``.
            n_ff: the model's neurons per layer (default: the length of layer 0's mask).
            strict_names: raise on a name that does not match its position (default); False
                only logs a warning and loads by position like the engine.

        Returns:
            The validated index (arrays are copies; the file is closed).

        Raises:
            FileNotFoundError: no such file.
            FileFormatError: not a PWRI file, a missing or mistyped ``split.vram_capacity``, a
                tensor that is not 1-D I32 (type id 18), names out of place, masks that are not
                0/1 or disagree with their bucket (``GGUFFormatError`` for malformed containers).
            PlacementError: any check of :meth:`validate` (the message names the file).
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
            raise FileFormatError(
                f"{src}: magic {f.magic!r}; a GPU index is a PWRI file (upstream writes it with "
                f"gguf-py and patches the magic)"
            )
        arch = f.kv.get(Keys.ARCHITECTURE)
        if not isinstance(arch, str) or arch != Keys.GPUIDX_ARCH:
            logger.warning("%s: architecture %r, expected %r", src, arch, Keys.GPUIDX_ARCH)
        if Keys.SPLIT_VRAM_CAPACITY not in f.kv:
            raise FileFormatError(f"{src}: required key {Keys.SPLIT_VRAM_CAPACITY!r} is missing")
        vtype = f.kv_types[Keys.SPLIT_VRAM_CAPACITY]
        if vtype is not GGUFValueType.UINT64:
            raise FileFormatError(
                f"{src}: {Keys.SPLIT_VRAM_CAPACITY} is {vtype.name}, the engine reads a UINT64"
            )
        infos = list(f.tensors.values())
        if len(infos) % 2:
            raise FileFormatError(
                f"{src}: {len(infos)} tensors; an index holds gpu_idx and gpu_bucket per layer"
            )
        if n_layer is not None and len(infos) != 2 * n_layer:
            raise FileFormatError(
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
                    raise FileFormatError(msg + "; the file would load wrong data")
                logger.warning("%s; loading by position as the engine does", msg)
            if info.ggml_type is not GGMLType.I32 or info.file_type_id != I32_PWRI_ID:
                raise FileFormatError(
                    f"{src}: tensor {info.name!r} has type id {info.file_type_id} "
                    f"({info.ggml_type.name}); the engine needs I32 = {I32_PWRI_ID}"
                )
            if len(info.ne) != 1:
                raise FileFormatError(f"{src}: tensor {info.name!r} has ne {info.ne}, expected 1-D")
            arr = np.array(f.array(info.name), dtype=np.int32)  # copy out of the mapping
            (buckets if pos % 2 else masks).append(arr)
        if n_ff is None:
            n_ff = int(masks[0].shape[0]) if masks else 0
        block_count = f.kv.get(Keys.GPUIDX_BLOCK_COUNT, len(masks))
        if isinstance(block_count, bool) or not isinstance(block_count, (int, np.integer)):
            raise FileFormatError(
                f"{src}: {Keys.GPUIDX_BLOCK_COUNT} is {block_count!r:.40}, expected an integer; "
                "regenerate the index with `powerpy gen-gpuidx` (or --reset-gpu-index)"
            )
        index = cls(buckets, n_ff, int(f.kv[Keys.SPLIT_VRAM_CAPACITY]), int(block_count))
        try:
            _check_masks(masks, n_ff)
            index.validate(n_layer, n_ff)
            _check_mask_matches_bucket(masks, buckets)
        except PowerpyError as e:
            raise type(e)(f"{src}: {e}") from None
        return index


def _check_masks(masks: list[npt.NDArray[np.int32]], n_ff: int) -> None:
    """Each stored ``gpu_idx`` is a 1-D 0/1 vector of ``n_ff`` (buckets: see ``validate``)."""
    for layer, mask in enumerate(masks):
        if mask.ndim != 1 or mask.shape[0] != n_ff:
            raise FileFormatError(
                f"layer {layer}: gpu_idx has shape {mask.shape} but the model has n_ff = {n_ff}"
            )
        bad = np.flatnonzero((mask != 0) & (mask != 1))
        if bad.size:
            j = int(bad[0])
            raise FileFormatError(f"layer {layer}: gpu_idx[{j}] = {mask[j]}, expected 0 or 1")


def _check_mask_matches_bucket(
    masks: list[npt.NDArray[np.int32]], buckets: list[npt.NDArray[np.int32]]
) -> None:
    """The stored mask marks exactly the bucket's neurons (the engine never checks it)."""
    for layer, (mask, bucket) in enumerate(zip(masks, buckets, strict=True)):
        off = np.flatnonzero(mask[bucket] != 1)
        if off.size:
            j = int(bucket[off[0]])
            raise FileFormatError(
                f"layer {layer}: gpu_bucket lists neuron {j} but gpu_idx[{j}] = 0"
            )
        total = int(mask.sum())
        if total != bucket.shape[0]:
            raise FileFormatError(
                f"layer {layer}: gpu_idx marks {total} neurons but gpu_bucket lists "
                f"{bucket.shape[0]}"
            )


def _i32(a: npt.NDArray[np.integer]) -> npt.NDArray[np.int32]:
    return np.ascontiguousarray(a, dtype=np.int32)
