"""GGUF and PowerInfer (PWRI) containers: a validating memory-mapped reader and an atomic writer.

Format: ``powerinfer-format.md`` §1-3. A PWRI file is GGUF v3 with ``b"PWRI"`` as magic and
PowerInfer's ggml type ids (I32 = 18); a GGUF file uses upstream ids (I32 = 26, BF16 = 30) and
its ids 16..23 (IQ quants) are rejected. Both map onto powerpy's ``GGMLType``.

Reading never trusts a count: every length is checked against the bytes left in the file before
anything is allocated or looped over, and every problem raises ``GGUFFormatError`` naming the
file, the byte offset and the offending value. Tensor data stays in the file: ``raw``/``array``
return zero-copy views of one ``mmap``.

Writing goes through ``gguf.GGUFWriter`` (raw type ids and shapes) into a temporary file beside
the target; the magic is patched there, then the file atomically replaces the target.

Typical use::

    with read_gguf("model.powerinfer.gguf") as f:
        w = f.dequantize("blk.0.ffn_up.weight")  # (n_ff, n_embd) float32
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import mmap
import os
import secrets
import struct
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from powerpy import quants
from powerpy.constants import (
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_TYPE_IDS,
    GGUF_VERSIONS,
    PWRI_MAGIC,
    PWRI_TYPE_IDS,
    TYPE_TRAITS,
    GGMLType,
    GGUFValueType,
    Keys,
)

logger = logging.getLogger(__name__)

__all__ = [
    "GGUFFile",
    "GGUFFormatError",
    "TensorInfo",
    "patch_magic",
    "read_gguf",
    "tensor_nbytes",
    "write_gguf",
]

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME - 1; llama.cpp rejects longer tensor names
_MAX_ELEMENTS = 1 << 56  # product of the non-zero dims; numpy refuses shapes near 2**63 bytes
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_IQ_IDS = range(16, 24)  # upstream ggml IQ2_XXS .. IQ4_XS
_F32_MAX = float(np.finfo(np.float32).max)

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# numpy dtype of array items; BOOL items are read as bytes and turned into np.bool_
_ARRAY_DTYPES: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "u1",
    GGUFValueType.INT8: "i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
_INT_RANGES: dict[GGUFValueType, tuple[int, int]] = {
    GGUFValueType.UINT8: (0, 2**8 - 1),
    GGUFValueType.INT8: (-(2**7), 2**7 - 1),
    GGUFValueType.UINT16: (0, 2**16 - 1),
    GGUFValueType.INT16: (-(2**15), 2**15 - 1),
    GGUFValueType.UINT32: (0, 2**32 - 1),
    GGUFValueType.INT32: (-(2**31), 2**31 - 1),
    GGUFValueType.UINT64: (0, 2**64 - 1),
    GGUFValueType.INT64: (-(2**63), 2**63 - 1),
}
# array(): typed views; BF16 is returned as its raw uint16 bits (widen with quants.dequantize)
_VIEW_DTYPES: dict[GGMLType, str] = {
    GGMLType.F32: "<f4",
    GGMLType.F16: "<f2",
    GGMLType.BF16: "<u2",
    GGMLType.I8: "i1",
    GGMLType.I16: "<i2",
    GGMLType.I32: "<i4",
}


# --- errors and records -------------------------------------------------------------------------
class GGUFFormatError(ValueError):
    """A malformed or unsupported GGUF/PWRI file.

    The message names the file, the byte offset and the offending value. The parts are also
    available as ``path``, ``offset`` and ``reason``.
    """

    def __init__(self, path: str | os.PathLike[str], offset: int, reason: str, hint: str = ""):
        self.path = str(path)
        self.offset = offset
        self.reason = reason
        message = f"{self.path}: {reason} (at byte offset {offset})"
        if hint:
            message += f"; {hint}"
        super().__init__(message)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor-info record.

    ``ne`` is in ggml order (``ne[0]`` contiguous); ``shape`` is the numpy order. ``offset`` is
    absolute (data start + the relative offset stored in the file).
    """

    name: str
    ne: tuple[int, ...]
    ggml_type: GGMLType
    file_type_id: int
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (``ne[0]`` elements); 1-element row for a 0-dim tensor."""
        tr = TYPE_TRAITS[self.ggml_type]
        return (self.ne[0] if self.ne else 1) // tr.block_size * tr.type_size

    @property
    def n_rows(self) -> int:
        return math.prod(self.ne[1:])


def tensor_nbytes(ne: Sequence[int], ggml_type: GGMLType | int) -> int:
    """Bytes of a tensor with ggml dims ``ne`` (unpadded).

    Args:
        ne: ggml dimension order (``ne[0]`` contiguous).
        ggml_type: powerpy type.

    Returns:
        ``n_elements / block_size * type_size``.

    Raises:
        ValueError: ``ne[0]`` is not a multiple of the type's block size, or a negative dim.
    """
    gt = GGMLType(ggml_type)
    tr = TYPE_TRAITS[gt]
    if any(int(d) < 0 for d in ne):
        raise ValueError(f"negative dimension in ne={tuple(ne)}")
    ne0 = int(ne[0]) if len(ne) else 1
    if ne0 % tr.block_size:
        raise ValueError(
            f"{gt.name}: ne[0] = {ne0} is not a multiple of the block size {tr.block_size}"
        )
    return math.prod(int(d) for d in ne) // tr.block_size * tr.type_size


def _type_table(magic: bytes) -> dict[int, GGMLType]:
    return PWRI_TYPE_IDS if magic == PWRI_MAGIC else GGUF_TYPE_IDS


def _file_type_id(ggml_type: GGMLType, magic: bytes) -> int:
    """powerpy type -> the id written in a file of this magic."""
    for fid, gt in _type_table(magic).items():
        if gt is ggml_type:
            return fid
    raise ValueError(
        f"ggml type {ggml_type.name} has no type id in {magic.decode()} files "
        f"(PowerInfer's ggml has no BF16; convert it to F32 or F16 first)"
    )


# --- the reader ---------------------------------------------------------------------------------
# Every open GGUFFile, so write_gguf can refuse to replace a file that is still mapped.
_OPEN_FILES: weakref.WeakSet[GGUFFile] = weakref.WeakSet()


class _Parser:
    """Bounds-checked little-endian cursor over the mapped file."""

    def __init__(self, path: Path, buf: mmap.mmap, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def error(self, reason: str, offset: int | None = None, hint: str = "") -> GGUFFormatError:
        return GGUFFormatError(self.path, self.pos if offset is None else offset, reason, hint)

    def need(self, n: int, what: str) -> None:
        left = self.size - self.pos
        if n > left:
            raise self.error(
                f"truncated file: {what} needs {n} bytes but only {left} remain "
                f"(file size {self.size})",
                hint="the file is incomplete or corrupt; download or convert it again",
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def raw_string(self, what: str) -> bytes:
        start = self.pos
        n = self.u64(f"length of {what}")
        left = self.size - self.pos
        if n > left:
            raise self.error(
                f"{what} has length {n} but only {left} bytes remain (file size {self.size})",
                offset=start,
                hint="the length field is corrupt or the file is truncated",
            )
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data

    def name(self, what: str) -> str:
        start = self.pos
        data = self.raw_string(what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            reason = f"{what} is not valid UTF-8: {data[:64]!r} ({e.reason})"
            raise self.error(reason, start) from None

    def value_type(self, what: str) -> GGUFValueType:
        start = self.pos
        raw = self.u32(what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.error(
                f"unknown {what} {raw} (valid: 0..12)",
                start,
                hint="the file is corrupt or from a newer GGUF revision",
            ) from None


def _decode_value_string(data: bytes) -> str:
    # Values are not required to be UTF-8 by ggml; surrogateescape keeps the exact bytes, and
    # write_gguf encodes them back the same way.
    return data.decode("utf-8", errors="surrogateescape")


class GGUFFile:
    """A parsed GGUF or PWRI file whose tensor data stays memory-mapped.

    Attributes:
        path: the file.
        magic: ``b"GGUF"`` or ``b"PWRI"``.
        version: 2 or 3.
        sparse: ``magic == b"PWRI"`` (the PowerInfer engine path).
        alignment: data alignment (``general.alignment`` or 32).
        data_offset: absolute offset of the tensor data section.
        kv: key -> value in file order. Scalars are Python int/float/bool/str, string arrays are
            ``list[str]``, numeric arrays are numpy arrays (copies, little-endian dtypes), bool
            arrays are numpy bool. Strings that are not UTF-8 keep their bytes as surrogates.
        kv_types: key -> value type.
        kv_array_types: key -> item type, for ARRAY keys only.
        tensors: name -> ``TensorInfo`` in file order.

    Views from ``raw``/``array`` are read-only (unless opened with ``writable=True``, which maps
    copy-on-write) and keep the mapping alive after ``close()``.
    """

    def __init__(self, path: str | os.PathLike[str], *, writable: bool = False):
        self.path = Path(path)
        self.magic: bytes = b""
        self.version = 0
        self.alignment = GGUF_DEFAULT_ALIGNMENT
        self.data_offset = 0
        self.kv: dict[str, Any] = {}
        self.kv_types: dict[str, GGUFValueType] = {}
        self.kv_array_types: dict[str, GGUFValueType] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._mm: mmap.mmap | None = None
        self._data: np.ndarray | None = None  # (file_size,) uint8 view of _mm
        self._open(writable)
        _OPEN_FILES.add(self)

    @property
    def sparse(self) -> bool:
        return self.magic == PWRI_MAGIC

    @property
    def closed(self) -> bool:
        return self._data is None

    # --- opening and parsing
    def _open(self, writable: bool) -> None:
        path = self.path
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory, expected a GGUF/PWRI file")
        try:
            fh = open(path, "rb")  # noqa: SIM115 - closed below; the mapping outlives it
        except FileNotFoundError:
            raise FileNotFoundError(f"GGUF file not found: {path}") from None
        with fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                raise GGUFFormatError(path, 0, "file is empty (0 bytes)", "not a GGUF file")
            access = mmap.ACCESS_COPY if writable else mmap.ACCESS_READ
            self._mm = mmap.mmap(fh.fileno(), 0, access=access)
        try:
            self._parse(_Parser(path, self._mm, size))
        except BaseException:
            mm, self._mm = self._mm, None
            with contextlib.suppress(BufferError):  # a view may still be alive in a traceback
                mm.close()
            raise
        self._data = np.frombuffer(self._mm, dtype=np.uint8)

    def _parse(self, p: _Parser) -> None:
        p.need(4, "magic")
        magic = bytes(p.buf[0:4])
        if magic not in (GGUF_MAGIC, PWRI_MAGIC):
            raise p.error(
                f"bad magic {magic!r}, expected b'GGUF' or b'PWRI'",
                hint="this is not a GGUF or PowerInfer model/index file",
            )
        p.pos = 4
        self.magic = magic
        version = p.u32("version")
        if version not in GGUF_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in GGUF_VERSIONS:
                hint = "this is a big-endian GGUF, which powerpy does not read"
            elif version == 1:
                hint = "GGUF v1 is obsolete; convert the model again with a current converter"
            else:
                hint = "the file is corrupt or from a newer GGUF revision"
            raise p.error(f"unsupported GGUF version {version} (supported: 2, 3)", 4, hint)
        self.version = version
        n_tensors = p.u64("tensor count")
        n_kv = p.u64("key/value count")
        left = p.size - p.pos
        if n_kv > left // _MIN_KV_BYTES:
            raise p.error(
                f"key/value count {n_kv} cannot fit in the {left} bytes after the header "
                f"(each record takes at least {_MIN_KV_BYTES} bytes)",
                16,
                "the header is corrupt",
            )
        if n_tensors > (left - n_kv * _MIN_KV_BYTES) // _MIN_TENSOR_INFO_BYTES:
            raise p.error(
                f"tensor count {n_tensors} cannot fit in the {left} bytes after the header "
                f"(each tensor-info record takes at least {_MIN_TENSOR_INFO_BYTES} bytes)",
                8,
                "the header is corrupt",
            )
        kv_offsets = self._parse_kv(p, n_kv)
        records = self._parse_tensor_infos(p, n_tensors)
        self._set_alignment(p, kv_offsets)
        self.data_offset = -(-p.pos // self.alignment) * self.alignment
        self._place_tensors(p, records)

    def _parse_kv(self, p: _Parser, n_kv: int) -> dict[str, int]:
        offsets: dict[str, int] = {}
        for i in range(n_kv):
            start = p.pos
            key = p.name(f"key of key/value record {i}")
            if key in self.kv:
                raise p.error(
                    f"duplicate key {key!r} (first at offset {offsets[key]})", start, "corrupt file"
                )
            offsets[key] = start
            vtype = p.value_type(f"value type of key {key!r}")
            if vtype is GGUFValueType.ARRAY:
                value, item_type = self._parse_array(p, key)
                self.kv_array_types[key] = item_type
            else:
                value = self._parse_scalar(p, vtype, f"value of key {key!r}")
            self.kv[key] = value
            self.kv_types[key] = vtype
        return offsets

    @staticmethod
    def _parse_scalar(p: _Parser, vtype: GGUFValueType, what: str) -> Any:
        if vtype is GGUFValueType.STRING:
            return _decode_value_string(p.raw_string(what))
        return p.scalar(_SCALAR_FORMATS[vtype], what)

    @staticmethod
    def _parse_array(p: _Parser, key: str) -> tuple[Any, GGUFValueType]:
        type_offset = p.pos
        item_type = p.value_type(f"array item type of key {key!r}")
        if item_type is GGUFValueType.ARRAY:
            raise p.error(
                f"key {key!r} is an array of arrays, which PowerInfer's reader asserts on",
                type_offset,
            )
        count_offset = p.pos
        count = p.u64(f"array length of key {key!r}")
        item_bytes = (
            8 if item_type is GGUFValueType.STRING else struct.calcsize(_SCALAR_FORMATS[item_type])
        )
        left = p.size - p.pos
        if count > left // item_bytes:
            raise p.error(
                f"array {key!r} claims {count} {item_type.name} items but only {left} bytes "
                f"remain (at least {item_bytes} bytes per item)",
                count_offset,
                "the array length is corrupt or the file is truncated",
            )
        if item_type is GGUFValueType.STRING:
            what = f"string item of array {key!r}"
            return [_decode_value_string(p.raw_string(what)) for _ in range(count)], item_type
        dtype = np.dtype(_ARRAY_DTYPES[item_type])
        values = np.frombuffer(p.buf, dtype=dtype, count=count, offset=p.pos).copy()
        p.pos += count * dtype.itemsize
        if item_type is GGUFValueType.BOOL:
            values = values.astype(np.bool_)
        return values, item_type

    def _parse_tensor_infos(self, p: _Parser, n_tensors: int) -> list[tuple[Any, ...]]:
        table = _type_table(self.magic)
        records = []
        first_at: dict[str, int] = {}
        for i in range(n_tensors):
            start = p.pos
            name = p.name(f"name of tensor {i}")
            n_name = len(name.encode("utf-8"))
            if n_name > MAX_NAME_BYTES:
                raise p.error(
                    f"tensor name {name[:80]!r} is {n_name} bytes, longer than the "
                    f"{MAX_NAME_BYTES} bytes ggml allows",
                    start,
                )
            if name in first_at:
                raise p.error(
                    f"duplicate tensor name {name!r} (first at offset {first_at[name]})", start
                )
            first_at[name] = start
            dims_offset = p.pos
            n_dims = p.u32(f"n_dims of tensor {name!r}")
            if n_dims > MAX_DIMS:
                raise p.error(
                    f"tensor {name!r} has n_dims = {n_dims}, more than ggml's {MAX_DIMS}",
                    dims_offset,
                )
            ne = tuple(p.u64(f"ne[{j}] of tensor {name!r}") for j in range(n_dims))
            if math.prod(max(1, d) for d in ne) >= _MAX_ELEMENTS:
                raise p.error(f"tensor {name!r} has absurd dimensions ne = {ne}", dims_offset + 4)
            type_offset = p.pos
            type_id = p.u32(f"type of tensor {name!r}")
            ggml_type = table.get(type_id)
            if ggml_type is None:
                raise p.error(self._bad_type_message(name, type_id), type_offset)
            block = TYPE_TRAITS[ggml_type].block_size
            ne0 = ne[0] if ne else 1
            if ne0 % block:
                raise p.error(
                    f"tensor {name!r} of type {ggml_type.name} has ne[0] = {ne0} elements per "
                    f"row, not a multiple of the block size {block}",
                    dims_offset + 4,
                )
            rel_offset_at = p.pos
            rel_offset = p.u64(f"data offset of tensor {name!r}")
            records.append((name, ne, ggml_type, type_id, rel_offset, rel_offset_at))
        return records

    def _bad_type_message(self, name: str, type_id: int) -> str:
        if self.magic == GGUF_MAGIC and type_id in _IQ_IDS:
            return (
                f"tensor {name!r} has ggml type id {type_id}, an upstream IQ quant type; "
                f"powerpy does not support IQ quants (if this is a PowerInfer file whose I8/I16/"
                f"I32 ids 16-18 were meant, its magic must be b'PWRI')"
            )
        if self.magic == PWRI_MAGIC:
            return (
                f"tensor {name!r} has ggml type id {type_id}, unknown to PowerInfer "
                f"(valid ids: {sorted(PWRI_TYPE_IDS)})"
            )
        return (
            f"tensor {name!r} has ggml type id {type_id}, which powerpy does not support "
            f"(valid ids: {sorted(GGUF_TYPE_IDS)})"
        )

    def _set_alignment(self, p: _Parser, kv_offsets: dict[str, int]) -> None:
        key = Keys.ALIGNMENT
        if key not in self.kv:
            return
        vtype, value = self.kv_types[key], self.kv[key]
        if vtype is not GGUFValueType.UINT32:
            raise p.error(f"{key} has type {vtype.name}, expected UINT32", kv_offsets[key])
        if value == 0 or value & (value - 1):
            raise p.error(f"{key} = {value} is not a power of two", kv_offsets[key])
        self.alignment = value

    def _place_tensors(self, p: _Parser, records: list[tuple[Any, ...]]) -> None:
        if records and self.data_offset > p.size:
            raise p.error(
                f"tensor data would start at offset {self.data_offset}, past the end of the "
                f"file ({p.size} bytes)",
                p.pos,
                "the file is truncated",
            )
        for name, ne, ggml_type, type_id, rel, rel_at in records:
            if rel % self.alignment:
                raise p.error(
                    f"tensor {name!r} has data offset {rel}, not a multiple of the alignment "
                    f"{self.alignment}",
                    rel_at,
                )
            nbytes = tensor_nbytes(ne, ggml_type)
            start = self.data_offset + rel
            if start + nbytes > p.size:
                raise p.error(
                    f"data of tensor {name!r} ({ggml_type.name}, {nbytes} bytes at offset "
                    f"{start}) extends past the end of the file ({p.size} bytes)",
                    rel_at,
                    "the file is truncated or the offset is corrupt",
                )
            self.tensors[name] = TensorInfo(name, ne, ggml_type, type_id, start, nbytes)
        # no two tensors may share bytes (empty tensors take none)
        spans = sorted((t.offset, t.nbytes, t.name) for t in self.tensors.values() if t.nbytes)
        for (a_off, a_len, a_name), (b_off, _, b_name) in zip(spans, spans[1:], strict=False):
            if b_off < a_off + a_len:
                raise p.error(
                    f"data of tensor {b_name!r} (offset {b_off}) overlaps tensor {a_name!r} "
                    f"({a_len} bytes at offset {a_off})",
                    b_off,
                )
        if spans:
            end = max(off + -(-n // self.alignment) * self.alignment for off, n, _ in spans)
            if end > p.size:
                logger.warning(
                    "%s: the last tensor lacks its trailing padding (file ends at %d, padded "
                    "data ends at %d); PowerInfer's non-mmap loader would reject it",
                    self.path,
                    p.size,
                    end,
                )

    # --- access
    def _tensor(self, name: str) -> TensorInfo:
        if self._data is None:
            raise ValueError(f"{self.path}: file is closed")
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def raw(self, name: str) -> npt.NDArray[np.uint8]:
        """Zero-copy view of a tensor's bytes.

        Args:
            name: tensor name.

        Returns:
            uint8 array ``(n_rows, row_bytes)`` with ``n_rows = prod(ne[1:])`` (1 for 1-D
            tensors); row ``i`` is numpy row ``i`` of the flattened leading dims.

        Raises:
            KeyError: no such tensor. ValueError: the file is closed.
        """
        t = self._tensor(name)
        assert self._data is not None
        view = self._data[t.offset : t.offset + t.nbytes]
        return view.reshape(t.n_rows, t.row_bytes)

    def array(self, name: str) -> np.ndarray:
        """Zero-copy typed view with the numpy shape, for unquantized tensors.

        Args:
            name: tensor name.

        Returns:
            float32/float16/int8/int16/int32 array of ``shape``. BF16 tensors come back as their
            raw ``uint16`` bits (use ``dequantize`` for float32 values).

        Raises:
            ValueError: a block-quantized tensor (use ``dequantize`` or ``raw``), or closed file.
            KeyError: no such tensor.
        """
        t = self._tensor(name)
        dtype = _VIEW_DTYPES.get(t.ggml_type)
        if dtype is None:
            raise ValueError(
                f"{self.path}: tensor {name!r} is {t.ggml_type.name}, which has no element view; "
                f"use dequantize() or raw()"
            )
        assert self._data is not None
        return self._data[t.offset : t.offset + t.nbytes].view(dtype).reshape(t.shape)

    def dequantize(self, name: str) -> npt.NDArray[np.float32]:
        """Decode a tensor into a new float32 array of its numpy shape.

        Args:
            name: tensor name.

        Returns:
            float32 array of ``shape`` (see ``quants.dequantize``).

        Raises:
            ValueError: unsupported type (e.g. Q8_K), or closed file. KeyError: no such tensor.
        """
        t = self._tensor(name)
        return quants.dequantize(self.raw(name), t.ggml_type, t.shape)

    def typed_kv(self) -> dict[str, tuple[Any, ...]]:
        """The key/values with their types, in the form ``write_gguf`` takes.

        Returns:
            key -> ``(value, type)`` for scalars and ``(value, ARRAY, item_type)`` for arrays,
            in file order.
        """
        out: dict[str, tuple[Any, ...]] = {}
        for key, value in self.kv.items():
            vtype = self.kv_types[key]
            if vtype is GGUFValueType.ARRAY:
                out[key] = (value, vtype, self.kv_array_types[key])
            else:
                out[key] = (value, vtype)
        return out

    def tensor_specs(self) -> list[tuple[str, np.ndarray, GGMLType, tuple[int, ...]]]:
        """The tensors in the form ``write_gguf`` takes: ``(name, raw bytes, type, shape)``."""
        return [(n, self.raw(n), t.ggml_type, t.shape) for n, t in self.tensors.items()]

    # --- lifetime
    def close(self) -> None:
        """Release the mapping. Views handed out earlier stay valid and keep it alive."""
        self._data = None
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # views still exported: freed with them
                mm.close()
        _OPEN_FILES.discard(self)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self.closed else ""
        return (
            f"GGUFFile({self.path.name!r}, {self.magic.decode(errors='replace')} "
            f"v{self.version}, {len(self.kv)} kv, {len(self.tensors)} tensors{state})"
        )


def read_gguf(path: str | os.PathLike[str], *, writable: bool = False) -> GGUFFile:
    """Open and validate a GGUF or PWRI file; tensor data stays memory-mapped.

    Args:
        path: the file.
        writable: map copy-on-write so views are writable (changes never reach the file);
            useful for ``torch.from_numpy``, which warns on read-only arrays.

    Returns:
        A ``GGUFFile`` (also a context manager).

    Raises:
        FileNotFoundError: the path does not exist (the message names it).
        IsADirectoryError: the path is a directory.
        GGUFFormatError: anything malformed or unsupported: bad magic, version other than 2/3,
            a count or length larger than the rest of the file, unknown value or tensor type
            (IQ types in GGUF files), n_dims > 4, tensor names over 63 bytes, duplicate keys or
            names, ne[0] not whole blocks, misaligned, overlapping or out-of-file tensor data, a
            ``general.alignment`` that is not a UINT32 power of two.
    """
    return GGUFFile(path, writable=writable)


# --- the writer ---------------------------------------------------------------------------------
def _infer_item_type(values: Sequence[Any] | np.ndarray, key: str) -> GGUFValueType:
    if isinstance(values, np.ndarray):
        for vtype, dt in _ARRAY_DTYPES.items():
            if vtype is not GGUFValueType.BOOL and np.dtype(dt) == values.dtype.newbyteorder("<"):
                return vtype
        if values.dtype == np.bool_:
            return GGUFValueType.BOOL
        if values.dtype.kind in "US":
            return GGUFValueType.STRING
        raise ValueError(f"key {key!r}: cannot store a numpy {values.dtype} array in GGUF")
    if len(values) == 0:
        raise ValueError(f"key {key!r}: give the item type of an empty array: (value, ARRAY, type)")
    if all(isinstance(v, (str, bytes)) for v in values):
        return GGUFValueType.STRING
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return GGUFValueType.BOOL
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        lo, hi = min(values), max(values)
        return GGUFValueType.INT32 if -(2**31) <= lo and hi < 2**31 else GGUFValueType.INT64
    if all(isinstance(v, (int, float, np.integer, np.floating)) for v in values):
        return GGUFValueType.FLOAT32
    raise ValueError(f"key {key!r}: array items must all be strings, bools or numbers")


def _infer_type(value: Any, key: str) -> GGUFValueType:
    if isinstance(value, (bool, np.bool_)):
        return GGUFValueType.BOOL
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if 0 <= v < 2**32:
            return GGUFValueType.UINT32
        if -(2**31) <= v < 0:
            return GGUFValueType.INT32
        return GGUFValueType.UINT64 if v > 0 else GGUFValueType.INT64
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32
    if isinstance(value, (str, bytes)):
        return GGUFValueType.STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        return GGUFValueType.ARRAY
    raise ValueError(f"key {key!r}: cannot infer a GGUF type for {type(value).__name__}")


def _string_bytes(value: Any, key: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", errors="surrogateescape")
    raise ValueError(f"key {key!r}: expected a string, got {type(value).__name__}")


def _check_scalar(value: Any, vtype: GGUFValueType, key: str) -> Any:
    """Validate a scalar and return it in the form GGUFWriter packs."""
    if vtype is GGUFValueType.STRING:
        return _string_bytes(value, key)
    if vtype is GGUFValueType.BOOL:
        if not isinstance(value, (bool, np.bool_)) and value not in (0, 1):
            raise ValueError(f"key {key!r}: {value!r} is not a bool")
        return bool(value)
    if vtype in _INT_RANGES:
        lo, hi = _INT_RANGES[vtype]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"key {key!r}: {value!r} is not an integer for {vtype.name}")
        if not lo <= int(value) <= hi:
            raise ValueError(f"key {key!r}: {value} is out of range for {vtype.name}")
        return int(value)
    if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
            raise ValueError(f"key {key!r}: {value!r} is not a number for {vtype.name}")
        v = float(value)
        if vtype is GGUFValueType.FLOAT32 and math.isfinite(v) and abs(v) > _F32_MAX:
            raise ValueError(f"key {key!r}: {value} is out of range for FLOAT32")
        return v
    raise ValueError(f"key {key!r}: {vtype!r} is not a scalar value type")


def _pack_array_items(values: Any, item_type: GGUFValueType, key: str) -> tuple[bytes, int]:
    """Item bytes and count of an ARRAY value (numbers packed in bulk, strings one by one)."""
    if item_type is GGUFValueType.STRING:
        out = bytearray()
        for v in values:
            data = _string_bytes(v, key)
            out += struct.pack("<Q", len(data)) + data
        return bytes(out), len(values)
    if item_type is GGUFValueType.ARRAY:
        raise ValueError(f"key {key!r}: arrays of arrays break PowerInfer's reader")
    if item_type is GGUFValueType.BOOL:
        flags = np.asarray(values, dtype=np.bool_).reshape(-1)
        return flags.astype(np.uint8).tobytes(), flags.size
    src = np.asarray(values).reshape(-1)
    if src.size and src.dtype.kind not in "biuf":
        raise ValueError(f"key {key!r}: {item_type.name} array holds {src.dtype} values")
    if item_type in _INT_RANGES and src.size:
        lo, hi = _INT_RANGES[item_type]
        if src.dtype.kind == "f" or int(src.min()) < lo or int(src.max()) > hi:
            raise ValueError(f"key {key!r}: values do not fit {item_type.name} items")
    dtype = np.dtype(_ARRAY_DTYPES[item_type])
    return np.ascontiguousarray(src.astype(dtype, copy=False)).tobytes(), src.size


def _normalize_kv(
    kv: Mapping[str, Any] | Iterable[tuple[str, Any]],
) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
    items = kv.items() if isinstance(kv, Mapping) else kv
    out: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]] = []
    seen: set[str] = set()
    for key, spec in items:
        if not isinstance(key, str):
            raise ValueError(f"key/value keys must be str, got {key!r}")
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen.add(key)
        item_type: GGUFValueType | None = None
        if isinstance(spec, tuple) and len(spec) in (2, 3) and isinstance(spec[1], GGUFValueType):
            value, vtype = spec[0], spec[1]
            if len(spec) == 3:
                item_type = GGUFValueType(spec[2])
        else:
            value, vtype = spec, _infer_type(spec, key)
        if vtype is GGUFValueType.ARRAY:
            item_type = item_type if item_type is not None else _infer_item_type(value, key)
            out.append((key, _pack_array_items(value, item_type, key), vtype, item_type))
        else:
            out.append((key, _check_scalar(value, vtype, key), vtype, None))
    return out


def _normalize_tensor(
    spec: Sequence[Any], magic: bytes
) -> tuple[str, np.ndarray, tuple[int, ...], GGMLType]:
    """-> (name, contiguous 1-D int8 byte view, numpy shape, type)."""
    if len(spec) not in (3, 4):
        raise ValueError(f"tensor spec must be (name, data, type[, shape]), got {len(spec)} items")
    name, data, ggml_type = spec[0], np.asarray(spec[1]), GGMLType(spec[2])
    shape = tuple(int(s) for s in spec[3]) if len(spec) == 4 and spec[3] is not None else None
    if not isinstance(name, str) or len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise ValueError(f"tensor name {name!r} must be a str of at most {MAX_NAME_BYTES} bytes")
    tr = TYPE_TRAITS[ggml_type]
    if data.dtype == np.uint8:  # raw bytes, whatever the type (I8 included)
        if shape is None:  # bytes (..., row_bytes) -> elements (..., n_cols)
            if data.ndim == 0 or data.shape[-1] % tr.type_size:
                raise ValueError(f"tensor {name!r}: give the numpy shape of the raw bytes")
            shape = (*data.shape[:-1], data.shape[-1] // tr.type_size * tr.block_size)
    else:
        expected = _VIEW_DTYPES.get(ggml_type)
        if expected is None or data.dtype != np.dtype(expected):
            raise ValueError(
                f"tensor {name!r}: {ggml_type.name} data must be "
                f"{np.dtype(expected) if expected else 'raw uint8 bytes'}, got {data.dtype}"
            )
        if shape is None:
            shape = data.shape
        elif math.prod(shape) != data.size:
            raise ValueError(f"tensor {name!r}: shape {shape} does not match {data.shape}")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"tensor {name!r}: {len(shape)} dims, ggml allows {MAX_DIMS}")
    nbytes = tensor_nbytes(tuple(reversed(shape)), ggml_type)
    if data.nbytes != nbytes:
        raise ValueError(
            f"tensor {name!r}: {ggml_type.name} of shape {shape} needs {nbytes} bytes, "
            f"data has {data.nbytes}"
        )
    flat = np.ascontiguousarray(data).reshape(-1).view(np.int8)  # bytes, any element type
    _file_type_id(ggml_type, magic)  # raises for a type with no id under this magic
    return name, flat, shape, ggml_type


def _check_not_mapped(path: Path) -> None:
    if not path.exists():
        return
    for f in list(_OPEN_FILES):
        if not f.closed and f.path.exists() and os.path.samefile(f.path, path):
            raise ValueError(
                f"{path} is open and memory-mapped by {f!r}; close it first or pass "
                f"overwrite_mapped=True (on POSIX the old mapping stays valid, on Windows the "
                f"replace fails)"
            )


@contextlib.contextmanager
def _quiet_gguf_logs() -> Iterator[None]:
    # GGUFWriter logs endianness and a file plan at INFO for every file; keep the CLI quiet.
    log = logging.getLogger("gguf.gguf_writer")
    old = log.level
    log.setLevel(max(old, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(old)


@functools.cache
def _writer_class() -> type:
    import gguf  # imported on first write only: it costs ~0.1 s and the reader does not need it

    class _Writer(gguf.GGUFWriter):
        """GGUFWriter taking ARRAY values pre-packed as (item bytes, count): numbers are packed
        in bulk, and empty arrays (which GGUFWriter refuses) are allowed."""

        def _pack_val(self, val, vtype, add_vtype, sub_type=None):  # type: ignore[no-untyped-def]
            if vtype != gguf.GGUFValueType.ARRAY:
                return super()._pack_val(val, vtype, add_vtype, sub_type=sub_type)
            items, count = val
            head = struct.pack("<I", int(vtype)) if add_vtype else b""
            return head + struct.pack("<IQ", int(sub_type), count) + items

    return _Writer


def write_gguf(
    path: str | os.PathLike[str],
    kv: Mapping[str, Any] | Iterable[tuple[str, Any]],
    tensors: Iterable[Sequence[Any]],
    *,
    magic: bytes = GGUF_MAGIC,
    alignment: int | None = None,
    version: int = 3,
    overwrite_mapped: bool = False,
) -> Path:
    """Write a GGUF or PWRI file atomically (temp file in the same directory + ``os.replace``).

    Key/values are written exactly in the order given; nothing is added except
    ``general.alignment`` (appended last) when ``alignment`` is not 32 and the key is absent.
    Tensors are packed in order at aligned offsets, and every tensor (the last included) is
    zero-padded to the alignment. Type ids come from the PWRI table for ``magic=b"PWRI"``
    (I32 -> 18) and the upstream table otherwise (I32 -> 26, BF16 -> 30).

    Args:
        path: destination. A partial file is never left behind.
        kv: mapping or ``(key, spec)`` pairs; a spec is a value (type inferred: bool -> BOOL,
            int -> UINT32 if it fits else INT32/UINT64/INT64, float -> FLOAT32, str -> STRING,
            list/tuple/ndarray -> ARRAY with items inferred: strings, bools, INT32/INT64,
            FLOAT32, or the ndarray's dtype), or ``(value, GGUFValueType)``, or
            ``(value, GGUFValueType.ARRAY, item_type)`` (needed for empty arrays).
        tensors: ``(name, data, GGMLType)`` or ``(name, data, GGMLType, shape)`` in file order.
            ``data`` is a typed array (float32 F32, float16 F16, uint16 BF16, int8/16/32
            I8/I16/I32), or raw ``uint8`` bytes of any type; ``shape`` is the numpy shape and
            is required for raw bytes unless the data is ``(..., row_bytes)`` shaped.
        magic: ``b"GGUF"`` or ``b"PWRI"``.
        alignment: data alignment (power of two); defaults to ``general.alignment`` or 32.
        version: header version, 3 (default) or 2.
        overwrite_mapped: allow replacing a file that an open ``GGUFFile`` still maps.

    Returns:
        The destination path.

    Raises:
        ValueError: bad magic/version/alignment, a value that does not fit its type, duplicate
            keys or tensor names, data whose dtype or size does not match, a type with no id in
            this magic (BF16 in PWRI), or a destination that is still mapped.
        IsADirectoryError: the destination is a directory.
    """
    specs = [_normalize_tensor(spec, magic) for spec in tensors]
    infos = [(name, shape, ggml_type) for name, _, shape, ggml_type in specs]
    with GGUFStreamWriter(
        path,
        kv,
        infos,
        magic=magic,
        alignment=alignment,
        version=version,
        overwrite_mapped=overwrite_mapped,
    ) as writer:
        for name, flat, shape, _ in specs:
            writer.write(name, flat.view(np.uint8), shape)
    return Path(path)


class GGUFStreamWriter:
    """Writes a GGUF or PWRI file whose tensor table is known up front, one tensor's data at a
    time, so only one tensor needs to be in memory (converters, synthetic models).

    Atomic like ``write_gguf`` (which is built on it): data goes to a temp file in the same
    directory, renamed over ``path`` by ``close()``; ``abort()`` (or an exception inside a
    ``with`` block) removes it. Tensors must be written in table order.

        with GGUFStreamWriter(path, kv, [(name, numpy_shape, GGMLType), ...], magic=b"PWRI") as w:
            for name, ... in ...:
                w.write(name, array)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        kv: Mapping[str, Any] | Iterable[tuple[str, Any]],
        tensors: Sequence[tuple[str, Sequence[int], GGMLType]],
        *,
        magic: bytes = GGUF_MAGIC,
        alignment: int | None = None,
        version: int = 3,
        overwrite_mapped: bool = False,
    ) -> None:
        """See ``write_gguf`` for ``kv``, ``magic``, ``alignment``, ``version`` and
        ``overwrite_mapped``; ``tensors`` gives each tensor's name, numpy shape and type.

        Raises:
            ValueError: as ``write_gguf``, for the header.
            IsADirectoryError: the destination is a directory.
        """
        path = Path(path)
        if magic not in (GGUF_MAGIC, PWRI_MAGIC):
            raise ValueError(f"magic must be b'GGUF' or b'PWRI', got {magic!r}")
        if version not in GGUF_VERSIONS:
            raise ValueError(f"version must be one of {GGUF_VERSIONS}, got {version}")
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory")
        if not path.parent.is_dir():
            raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
        if not overwrite_mapped:
            _check_not_mapped(path)

        entries = _normalize_kv(kv)
        kv_alignment = next((v for k, v, _, _ in entries if k == Keys.ALIGNMENT), None)
        if kv_alignment is not None:
            if next(t for k, _, t, _ in entries if k == Keys.ALIGNMENT) is not GGUFValueType.UINT32:
                raise ValueError(f"{Keys.ALIGNMENT} must be UINT32")
            if alignment is not None and alignment != kv_alignment:
                raise ValueError(
                    f"alignment={alignment} contradicts {Keys.ALIGNMENT}={kv_alignment}"
                )
            alignment = kv_alignment
        elif alignment is not None and alignment != GGUF_DEFAULT_ALIGNMENT:
            entries.append((Keys.ALIGNMENT, int(alignment), GGUFValueType.UINT32, None))
        alignment = GGUF_DEFAULT_ALIGNMENT if alignment is None else int(alignment)
        if alignment <= 0 or alignment & (alignment - 1) or alignment >= 2**32:
            raise ValueError(f"alignment must be a power of two below 2**32, got {alignment}")

        self.table = [
            (str(n), tuple(int(d) for d in shape), GGMLType(t)) for n, shape, t in tensors
        ]
        names = [n for n, _, _ in self.table]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"duplicate tensor name {dup!r}")

        import gguf

        self.path, self.magic, self.version = path, magic, version
        self.n_written = 0
        self.tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        with open(self.tmp, "xb"):  # claim the name, with the usual (umask) permissions
            pass
        try:
            with _quiet_gguf_logs():
                # arch "" adds no key, so the caller's key order is kept exactly
                self.writer = _writer_class()(self.tmp, arch="")
                self.writer.data_alignment = alignment
                for key, value, vtype, item_type in entries:
                    self.writer.add_key_value(
                        key,
                        value,
                        gguf.GGUFValueType(int(vtype)),
                        sub_type=None if item_type is None else gguf.GGUFValueType(int(item_type)),
                    )
                for name, shape, ggml_type in self.table:
                    if len(shape) > MAX_DIMS:
                        raise ValueError(
                            f"tensor {name!r}: {len(shape)} dims, ggml allows {MAX_DIMS}"
                        )
                    self.writer.add_tensor_info(
                        name,
                        shape,
                        np.dtype(np.int8),  # element shape, raw type id below
                        tensor_nbytes(tuple(reversed(shape)), ggml_type),
                        raw_dtype=gguf.GGMLQuantizationType(_file_type_id(ggml_type, magic)),
                    )
                self.writer.write_header_to_file()
                self.writer.write_kv_data_to_file()
                self.writer.write_ti_data_to_file()
                fout = self.writer.fout[0]
                self.writer.write_padding(fout, fout.tell())  # data starts aligned, even if empty
        except BaseException:
            self.abort()
            raise
        self.n_kv = len(entries)

    def write(self, name: str, data: np.ndarray, shape: Sequence[int] | None = None) -> None:
        """Write the next tensor's data: a typed array or raw ``uint8`` bytes (see ``write_gguf``).

        Raises:
            ValueError: out of order, or data whose dtype or size does not fit the table entry.
        """
        if self.n_written >= len(self.table):
            raise ValueError(f"tensor {name!r}: all {len(self.table)} tensors are written")
        want, want_shape, ggml_type = self.table[self.n_written]
        if name != want:
            raise ValueError(f"tensor {name!r} written out of order: {want!r} comes next")
        _, flat, got_shape, _ = _normalize_tensor(
            (name, data, ggml_type, want_shape if shape is None else shape), self.magic
        )
        if tuple(got_shape) != want_shape:
            raise ValueError(f"tensor {name!r}: shape {got_shape} does not match {want_shape}")
        self.writer.write_tensor_data(flat)
        self.n_written += 1

    def close(self) -> Path:
        """Finish the file, patch the magic and rename it into place; returns the path."""
        if self.n_written != len(self.table):
            self.abort()
            raise ValueError(
                f"{self.path}: only {self.n_written} of {len(self.table)} tensors were written"
            )
        try:
            self.writer.close()
            with open(self.tmp, "r+b") as fh:
                fh.write(self.magic + struct.pack("<I", self.version))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        logger.debug(
            "wrote %s (%s, %d kv, %d tensors)",
            self.path,
            self.magic.decode(),
            self.n_kv,
            len(self.table),
        )
        return self.path

    def abort(self) -> None:
        """Drop the temp file; the destination is untouched."""
        writer = getattr(self, "writer", None)
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink()

    def __enter__(self) -> GGUFStreamWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # type: ignore[no-untyped-def]
        if exc_type is None:
            self.close()
        else:
            self.abort()


def patch_magic(path: str | os.PathLike[str], magic: bytes) -> None:
    """Overwrite bytes 0..3 of a GGUF/PWRI file in place (as upstream's converters do).

    Only the magic changes; type ids are not translated, so patching a file holding I8/I16/I32
    (or GGUF-only types) between GGUF and PWRI changes what its ids mean.

    Args:
        path: an existing GGUF or PWRI file.
        magic: ``b"GGUF"`` or ``b"PWRI"``.

    Raises:
        ValueError: ``magic`` is neither. GGUFFormatError: the file does not start with either.
        FileNotFoundError: no such file.
    """
    if magic not in (GGUF_MAGIC, PWRI_MAGIC):
        raise ValueError(f"magic must be b'GGUF' or b'PWRI', got {magic!r}")
    with open(path, "r+b") as fh:
        current = fh.read(4)
        if current not in (GGUF_MAGIC, PWRI_MAGIC):
            raise GGUFFormatError(path, 0, f"bad magic {current!r}", "not a GGUF or PWRI file")
        fh.seek(0)
        fh.write(magic)
