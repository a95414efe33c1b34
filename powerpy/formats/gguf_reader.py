"""GGUF and PowerInfer (PWRI) files: a validating, memory-mapped reader.

Format: ``docs/formats.md#gguf-container``. A PWRI file is GGUF v3 with ``b"PWRI"`` as magic and
PowerInfer's ggml type ids (I32 = 18); a GGUF file uses upstream ids (I32 = 26, BF16 = 30) and
its ids 16..23 (IQ quants) are rejected. Both map onto powerpy's ``GGMLType``.

The header is parsed and checked by ``gguf_parse`` (every problem raises ``GGUFFormatError``
naming the file, the byte offset and the offending value). ``raw``/``array`` return zero-copy
views of one buffer: the file's ``mmap``, or with ``in_memory=True`` the file read into anonymous
memory in transparent huge pages (``read_into_memory``). The writer is ``gguf_writer``.

Typical use::

    with read_gguf("model.powerinfer.gguf") as f:
        w = f.dequantize("blk.0.ffn_up.weight")  # (n_ff, n_embd) float32
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from powerpy._fs import huge_page_buffer
from powerpy.errors import FileFormatError
from powerpy.formats import quants
from powerpy.formats.constants import PWRI_MAGIC, GGMLType, GGUFValueType
from powerpy.formats.gguf_parse import GGUFLayout, parse_layout
from powerpy.formats.gguf_types import VIEW_DTYPES, GGUFFormatError, TensorInfo, tensor_nbytes

__all__ = [
    "GGUFFile",
    "GGUFFormatError",
    "TensorInfo",
    "mapped_by",
    "read_gguf",
    "read_into_memory",
    "tensor_nbytes",
]

log = logging.getLogger(__name__)

# Every open GGUFFile, so the writer can refuse to replace a file that is still mapped.
_OPEN_FILES: weakref.WeakSet[GGUFFile] = weakref.WeakSet()


class FilePages:
    """A file read into memory whose pages may become file pages of the same bytes again
    (``powerpy.model.interleave`` hands back the rows it has copied, with ``mmap(MAP_FIXED)``
    of the file over them): the buffer's address and size, a descriptor of the file and its
    (size, mtime) when read.

    The :class:`GGUFFile` that read the file owns it (``GGUFFile.pages``), and so does each
    weight made of its bytes (``QuantWeight.pages``): the buffer may outlive the file object.
    The descriptor is closed with the buffer, or by :meth:`GGUFFile.close`.
    """

    def __init__(self, addr: int, size: int, fd: int, when: tuple[int, int]) -> None:
        self.addr, self.size, self.when = addr, size, when
        self.fd: int | None = fd

    def range(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """(file descriptor, file offset of ``ptr``) when ``[ptr, ptr + nbytes)`` lies in this
        buffer and the file has not changed since it was read, else None."""
        fd = self.fd
        if fd is None or not (self.addr <= ptr and ptr + nbytes <= self.addr + self.size):
            return None
        st = os.fstat(fd)
        return (fd, ptr - self.addr) if (st.st_size, st.st_mtime_ns) == self.when else None

    def close(self) -> None:
        """Close the descriptor: the pages stay as they are from now on."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def mapped_by(path: str | os.PathLike[str]) -> GGUFFile | None:
    """An open ``GGUFFile`` that maps ``path`` (the same file, by inode), or None."""
    path = Path(path)
    if not path.exists():
        return None
    for f in list(_OPEN_FILES):
        if f.mapped and f.path.exists() and os.path.samefile(f.path, path):
            return f
    return None


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
        in_memory: the bytes were read into memory (the file is no longer mapped).

    Views from ``raw``/``array`` are read-only (unless opened with ``writable=True``, which maps
    copy-on-write) and keep the mapping alive after ``close()``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        writable: bool = False,
        in_memory: bool = False,
        progress: bool = False,
    ):
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        self._data: np.ndarray | None = None  # (file_size,) uint8 view of _mm
        self.pages: FilePages | None = None  # read into memory: the file behind its pages
        self.in_memory = False
        layout = self._open(writable, in_memory, progress)
        self.magic: bytes = layout.magic
        self.version: int = layout.version
        self.alignment: int = layout.alignment
        self.data_offset: int = layout.data_offset
        self.kv: dict[str, Any] = layout.kv
        self.kv_types: dict[str, GGUFValueType] = layout.kv_types
        self.kv_array_types: dict[str, GGUFValueType] = layout.kv_array_types
        self.tensors: dict[str, TensorInfo] = layout.tensors
        _OPEN_FILES.add(self)

    @property
    def sparse(self) -> bool:
        return self.magic == PWRI_MAGIC

    @property
    def closed(self) -> bool:
        return self._data is None

    @property
    def mapped(self) -> bool:
        """Whether views of this file are backed by a mapping of the file itself."""
        return not self.closed and not self.in_memory

    # --- opening
    def _open(self, writable: bool, in_memory: bool, progress: bool) -> GGUFLayout:
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
                layout = parse_layout(path, self._mm, size)
                buf = read_into_memory(fh, size, progress) if in_memory else None
            except BaseException:
                mm, self._mm = self._mm, None
                with contextlib.suppress(BufferError):  # a view may still be alive in a traceback
                    mm.close()
                raise
        if buf is not None:
            mm, self._mm, self.in_memory = self._mm, buf, True
            with contextlib.suppress(BufferError):
                mm.close()
        self._data = np.frombuffer(self._mm, dtype=np.uint8)
        if self.in_memory and not writable:
            self._data.flags.writeable = False
            fd = os.open(path, os.O_RDONLY)
            st = os.fstat(fd)
            self.pages = FilePages(self._data.ctypes.data, size, fd, (st.st_size, st.st_mtime_ns))
            weakref.finalize(buf, self.pages.close)  # with the buffer, not this object
        return layout

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
        dtype = VIEW_DTYPES.get(t.ggml_type)
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
                if self.pages is not None:
                    self.pages.close()
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


def check_tensor_sizes(gf: GGUFFile) -> None:
    """Each tensor's bytes (from its type and shape) must fill its slot up to the next tensor.

    Writers pack tensors at aligned offsets, so a type or shape that disagrees with the data
    (F32 bytes labelled Q4_0, a wrong dimension) leaves a gap the reader cannot see as overlap.

    Raises:
        FileFormatError: the first tensor whose slot is larger than its padded size.
    """
    size = gf.path.stat().st_size
    spans = sorted((t.offset, t.nbytes, t.name) for t in gf.tensors.values())
    nexts = [off for off, _, _ in spans[1:]] + [size]
    for (off, nbytes, name), nxt in zip(spans, nexts, strict=True):
        padded = -(-nbytes // gf.alignment) * gf.alignment
        if nxt - off > padded:
            t = gf.tensors[name]
            raise FileFormatError(
                f"{gf.path}: tensor {name!r} ({t.ggml_type.name}, shape {t.shape}) takes "
                f"{nbytes} bytes, but {nxt - off} bytes lie before the next tensor or the end "
                "of the file: its type or shape does not match its data (e.g. F32 data "
                "labelled Q4_0); re-convert the model"
            )


def read_gguf(
    path: str | os.PathLike[str],
    *,
    writable: bool = False,
    in_memory: bool = False,
    progress: bool = False,
) -> GGUFFile:
    """Open and validate a GGUF or PWRI file; tensor data stays memory-mapped, or is read into
    memory.

    Args:
        path: the file.
        writable: map copy-on-write so views are writable (changes never reach the file);
            useful for ``torch.from_numpy``, which warns on read-only arrays.
        in_memory: read the whole file into anonymous memory in transparent huge pages
            (``read_into_memory``) instead of mapping it: the CPU kernels gather scattered rows,
            and 4 KiB file pages make every row a TLB miss. Falls back to the mapping (with a
            warning) when the file does not fit in the available memory.
        progress: a progress bar while reading into memory.

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
    return GGUFFile(path, writable=writable, in_memory=in_memory, progress=progress)


def _available_memory() -> int | None:
    """MemAvailable in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def read_into_memory(fh, size: int, progress: bool = False) -> mmap.mmap | None:
    """The ``size`` bytes of open file ``fh`` in a private anonymous mapping advised for
    transparent huge pages (2 MiB pages where the kernel allows them), or None when they do not
    fit in the memory available (with a warning: the caller keeps the file mapping)."""
    avail = _available_memory()
    if avail is not None and size > avail:
        log.warning(
            "%s: %.1f GB does not fit in the %.1f GB of available memory; mapping the file "
            "instead (--mmap)",
            getattr(fh, "name", "model"),
            size / 1e9,
            avail / 1e9,
        )
        return None
    from tqdm.auto import tqdm

    buf = huge_page_buffer(size)

    view, chunk = memoryview(buf), 64 << 20
    fh.seek(0)
    with tqdm(total=size, unit="B", unit_scale=True, desc="reading", disable=not progress) as bar:
        done = 0
        while done < size:
            n = fh.readinto(view[done : done + chunk])
            if not n:
                view.release()
                buf.close()
                raise OSError(f"{getattr(fh, 'name', 'file')}: ended at byte {done} of {size}")
            done += n
            bar.update(n)
    view.release()
    return buf
