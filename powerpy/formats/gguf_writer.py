"""GGUF and PowerInfer (PWRI) files: an atomic writer (``docs/formats.md#gguf-container``).

Writing goes through ``gguf.GGUFWriter`` (raw type ids and shapes) into a temporary file beside
the target (``powerpy._fs.AtomicFile``); the magic is patched there (``b"PWRI"`` files are GGUF
v3 with PowerInfer's type ids), then the file atomically replaces the target.

Typical use::

    write_gguf("m.generated.gpuidx", {"split.vram_capacity": (n, GGUFValueType.UINT64)},
               [("blk.0.gpu_idx", idx, GGMLType.I32), ...], magic=b"PWRI")
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from powerpy._fs import AtomicFile
from powerpy.formats.constants import (
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSIONS,
    PWRI_MAGIC,
    TYPE_TRAITS,
    GGMLType,
    GGUFValueType,
    Keys,
)
from powerpy.formats.gguf_reader import mapped_by
from powerpy.formats.gguf_types import (
    ARRAY_DTYPES,
    INT_RANGES,
    MAX_DIMS,
    MAX_NAME_BYTES,
    VIEW_DTYPES,
    GGUFFormatError,
    file_type_id,
    infer_item_type,
    infer_type,
    tensor_nbytes,
)

logger = logging.getLogger(__name__)

__all__ = ["GGUFStreamWriter", "patch_magic", "write_gguf"]

_F32_MAX = float(np.finfo(np.float32).max)


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
    if vtype in INT_RANGES:
        lo, hi = INT_RANGES[vtype]
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
    if item_type in INT_RANGES and src.size:
        lo, hi = INT_RANGES[item_type]
        if src.dtype.kind == "f" or int(src.min()) < lo or int(src.max()) > hi:
            raise ValueError(f"key {key!r}: values do not fit {item_type.name} items")
    dtype = np.dtype(ARRAY_DTYPES[item_type])
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
            value, vtype = spec, infer_type(spec, key)
        if vtype is GGUFValueType.ARRAY:
            item_type = item_type if item_type is not None else infer_item_type(value, key)
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
        expected = VIEW_DTYPES.get(ggml_type)
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
    file_type_id(ggml_type, magic)  # raises for a type with no id under this magic
    return name, flat, shape, ggml_type


def _check_not_mapped(path: Path) -> None:
    f = mapped_by(path)
    if f is not None:
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
    progress: bool = False,
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
        progress: a tqdm bar over the tensor bytes written.

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
        from tqdm.auto import tqdm

        total = sum(flat.nbytes for _, flat, _, _ in specs)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=not progress)
        with bar:
            for name, flat, shape, _ in specs:
                writer.write(name, flat.view(np.uint8), shape)
                bar.update(flat.nbytes)
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
        self._target = AtomicFile(path)
        self.tmp = self._target.tmp
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
                        raw_dtype=gguf.GGMLQuantizationType(file_type_id(ggml_type, magic)),
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
        except BaseException:
            self.abort()
            raise
        self._target.commit()  # fsync + os.replace; removes the temp file if that fails
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
        self._target.discard()

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
