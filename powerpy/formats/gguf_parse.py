"""Parsing the header of a GGUF or PWRI file: key/values and the tensor table
(docs/formats.md#gguf-container).

Nothing here trusts a count: every length is checked against the bytes left in the file before
anything is allocated or looped over, and every problem raises ``GGUFFormatError`` naming the
file, the byte offset and the offending value. ``parse_layout`` reads only the header; the tensor
data is left where it is (``gguf_reader.GGUFFile`` maps it).
"""

from __future__ import annotations

import logging
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from powerpy.formats.constants import (
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_TYPE_IDS,
    GGUF_VERSIONS,
    PWRI_MAGIC,
    PWRI_TYPE_IDS,
    TYPE_TRAITS,
    GGUFValueType,
    Keys,
)
from powerpy.formats.gguf_types import (
    ARRAY_DTYPES,
    MAX_DIMS,
    MAX_NAME_BYTES,
    SCALAR_FORMATS,
    GGUFFormatError,
    TensorInfo,
    tensor_nbytes,
    type_table,
)

logger = logging.getLogger(__name__)

__all__ = ["GGUFLayout", "parse_layout"]

_MAX_ELEMENTS = 1 << 56  # product of the non-zero dims; numpy refuses shapes near 2**63 bytes
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_IQ_IDS = range(16, 24)  # upstream ggml IQ2_XXS .. IQ4_XS


@dataclass
class GGUFLayout:
    """What the header of a GGUF/PWRI file says (see ``gguf_reader.GGUFFile`` for the fields)."""

    magic: bytes = b""
    version: int = 0
    alignment: int = GGUF_DEFAULT_ALIGNMENT
    data_offset: int = 0
    kv: dict[str, Any] = field(default_factory=dict)
    kv_types: dict[str, GGUFValueType] = field(default_factory=dict)
    kv_array_types: dict[str, GGUFValueType] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


def parse_layout(path: Path, buf: mmap.mmap, size: int) -> GGUFLayout:
    """Parse and validate the header of the ``size``-byte file ``path`` mapped as ``buf``.

    Raises:
        GGUFFormatError: anything malformed or unsupported (see ``gguf_reader.read_gguf``).
    """
    p, h = _Parser(path, buf, size), GGUFLayout()
    p.need(4, "magic")
    magic = bytes(p.buf[0:4])
    if magic not in (GGUF_MAGIC, PWRI_MAGIC):
        raise p.error(
            f"bad magic {magic!r}, expected b'GGUF' or b'PWRI'",
            hint="this is not a GGUF or PowerInfer model/index file",
        )
    p.pos = 4
    h.magic = magic
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
    h.version = version
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
    kv_offsets = _parse_kv(p, h, n_kv)
    records = _parse_tensor_infos(p, h, n_tensors)
    _set_alignment(p, h, kv_offsets)
    h.data_offset = -(-p.pos // h.alignment) * h.alignment
    _place_tensors(p, h, records)
    return h


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


def _parse_kv(p: _Parser, h: GGUFLayout, n_kv: int) -> dict[str, int]:
    offsets: dict[str, int] = {}
    for i in range(n_kv):
        start = p.pos
        key = p.name(f"key of key/value record {i}")
        if key in h.kv:
            raise p.error(
                f"duplicate key {key!r} (first at offset {offsets[key]})", start, "corrupt file"
            )
        offsets[key] = start
        vtype = p.value_type(f"value type of key {key!r}")
        if vtype is GGUFValueType.ARRAY:
            value, item_type = _parse_array(p, key)
            h.kv_array_types[key] = item_type
        else:
            value = _parse_scalar(p, vtype, f"value of key {key!r}")
        h.kv[key] = value
        h.kv_types[key] = vtype
    return offsets


def _parse_scalar(p: _Parser, vtype: GGUFValueType, what: str) -> Any:
    if vtype is GGUFValueType.STRING:
        return _decode_value_string(p.raw_string(what))
    return p.scalar(SCALAR_FORMATS[vtype], what)


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
        8 if item_type is GGUFValueType.STRING else struct.calcsize(SCALAR_FORMATS[item_type])
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
    dtype = np.dtype(ARRAY_DTYPES[item_type])
    values = np.frombuffer(p.buf, dtype=dtype, count=count, offset=p.pos).copy()
    p.pos += count * dtype.itemsize
    if item_type is GGUFValueType.BOOL:
        values = values.astype(np.bool_)
    return values, item_type


def _parse_tensor_infos(p: _Parser, h: GGUFLayout, n_tensors: int) -> list[tuple[Any, ...]]:
    table = type_table(h.magic)
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
            raise p.error(_bad_type_message(h.magic, name, type_id), type_offset)
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


def _bad_type_message(magic: bytes, name: str, type_id: int) -> str:
    if magic == GGUF_MAGIC and type_id in _IQ_IDS:
        return (
            f"tensor {name!r} has ggml type id {type_id}, an upstream IQ quant type; "
            f"powerpy does not support IQ quants (if this is a PowerInfer file whose I8/I16/"
            f"I32 ids 16-18 were meant, its magic must be b'PWRI')"
        )
    if magic == PWRI_MAGIC:
        return (
            f"tensor {name!r} has ggml type id {type_id}, unknown to PowerInfer "
            f"(valid ids: {sorted(PWRI_TYPE_IDS)})"
        )
    return (
        f"tensor {name!r} has ggml type id {type_id}, which powerpy does not support "
        f"(valid ids: {sorted(GGUF_TYPE_IDS)})"
    )


def _set_alignment(p: _Parser, h: GGUFLayout, kv_offsets: dict[str, int]) -> None:
    key = Keys.ALIGNMENT
    if key not in h.kv:
        return
    vtype, value = h.kv_types[key], h.kv[key]
    if vtype is not GGUFValueType.UINT32:
        raise p.error(f"{key} has type {vtype.name}, expected UINT32", kv_offsets[key])
    if value == 0 or value & (value - 1):
        raise p.error(f"{key} = {value} is not a power of two", kv_offsets[key])
    h.alignment = value


def _place_tensors(p: _Parser, h: GGUFLayout, records: list[tuple[Any, ...]]) -> None:
    if records and h.data_offset > p.size:
        raise p.error(
            f"tensor data would start at offset {h.data_offset}, past the end of the "
            f"file ({p.size} bytes)",
            p.pos,
            "the file is truncated",
        )
    for name, ne, ggml_type, type_id, rel, rel_at in records:
        if rel % h.alignment:
            raise p.error(
                f"tensor {name!r} has data offset {rel}, not a multiple of the alignment "
                f"{h.alignment}",
                rel_at,
            )
        nbytes = tensor_nbytes(ne, ggml_type)
        start = h.data_offset + rel
        if start + nbytes > p.size:
            raise p.error(
                f"data of tensor {name!r} ({ggml_type.name}, {nbytes} bytes at offset "
                f"{start}) extends past the end of the file ({p.size} bytes)",
                rel_at,
                "the file is truncated or the offset is corrupt",
            )
        h.tensors[name] = TensorInfo(name, ne, ggml_type, type_id, start, nbytes)
    # no two tensors may share bytes (empty tensors take none)
    spans = sorted((t.offset, t.nbytes, t.name) for t in h.tensors.values() if t.nbytes)
    for (a_off, a_len, a_name), (b_off, _, b_name) in zip(spans, spans[1:], strict=False):
        if b_off < a_off + a_len:
            raise p.error(
                f"data of tensor {b_name!r} (offset {b_off}) overlaps tensor {a_name!r} "
                f"({a_len} bytes at offset {a_off})",
                b_off,
            )
    if spans:
        end = max(off + -(-n // h.alignment) * h.alignment for off, n, _ in spans)
        if end > p.size:
            logger.warning(
                "%s: the last tensor lacks its trailing padding (file ends at %d, padded "
                "data ends at %d); PowerInfer's non-mmap loader would reject it",
                p.path,
                p.size,
                end,
            )
