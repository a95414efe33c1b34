"""Records and tables shared by the GGUF/PWRI reader and writer
(``docs/formats.md#type-ids``).

A PWRI file is GGUF v3 with ``b"PWRI"`` as magic and PowerInfer's ggml type ids (I32 = 18); a
GGUF file uses upstream ids (I32 = 26, BF16 = 30). ``type_table`` and ``file_type_id`` map both
onto powerpy's ``GGMLType``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from powerpy.errors import FileFormatError
from powerpy.formats.constants import (
    GGUF_TYPE_IDS,
    PWRI_MAGIC,
    PWRI_TYPE_IDS,
    TYPE_TRAITS,
    GGMLType,
    GGUFValueType,
)

__all__ = [
    "ARRAY_DTYPES",
    "INT_RANGES",
    "MAX_DIMS",
    "MAX_NAME_BYTES",
    "SCALAR_FORMATS",
    "VIEW_DTYPES",
    "GGUFFormatError",
    "TensorInfo",
    "file_type_id",
    "tensor_nbytes",
    "type_table",
]

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME - 1; llama.cpp rejects longer tensor names

SCALAR_FORMATS: dict[GGUFValueType, str] = {
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
ARRAY_DTYPES: dict[GGUFValueType, str] = {
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
INT_RANGES: dict[GGUFValueType, tuple[int, int]] = {
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
VIEW_DTYPES: dict[GGMLType, str] = {
    GGMLType.F32: "<f4",
    GGMLType.F16: "<f2",
    GGMLType.BF16: "<u2",
    GGMLType.I8: "i1",
    GGMLType.I16: "<i2",
    GGMLType.I32: "<i4",
}


# --- errors and records -------------------------------------------------------------------------
class GGUFFormatError(FileFormatError):
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


def type_table(magic: bytes) -> dict[int, GGMLType]:
    """File type id -> powerpy type for a file of this magic (PWRI or upstream GGUF ids)."""
    return PWRI_TYPE_IDS if magic == PWRI_MAGIC else GGUF_TYPE_IDS


def file_type_id(ggml_type: GGMLType, magic: bytes) -> int:
    """powerpy type -> the id written in a file of this magic."""
    for fid, gt in type_table(magic).items():
        if gt is ggml_type:
            return fid
    raise ValueError(
        f"ggml type {ggml_type.name} has no type id in {magic.decode()} files "
        f"(PowerInfer's ggml has no BF16; convert it to F32 or F16 first)"
    )


def infer_item_type(values: Sequence[Any] | np.ndarray, key: str) -> GGUFValueType:
    if isinstance(values, np.ndarray):
        for vtype, dt in ARRAY_DTYPES.items():
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


def infer_type(value: Any, key: str) -> GGUFValueType:
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
