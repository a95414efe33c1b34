"""Q4_K, Q4_0 and MXFP4 matrices with their rows interleaved 8 at a time, for whole-matrix
products.

llama.cpp's CPU backend repacks every Q4_K, Q4_0 and MXFP4 matrix (or stack of experts) of 8k
rows at load (on AVX2 hosts) and multiplies it with kernels of its own order. powerpy does the
same for the products that read a matrix whole (the prompt GEMM, a dense layer's decode GEMV,
attention's projections, each routed expert's rows): :func:`interleaved` builds the layout of
``csrc/q4_k_x8.h``, ``csrc/q4_0_x8.h`` or ``csrc/mxfp4_x8.h`` once, and those products run its
kernels, at llama.cpp's bits and speed. Row gathers and row sums (the sparse FFN) keep the
file's rows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import sys

import torch

from powerpy.formats import gguf_reader
from powerpy.formats.constants import GGMLType
from powerpy.model import kernels

logger = logging.getLogger(__name__)

X8_SB = 1184  # bytes of 8 Q4_K rows' super-block (csrc/q4_k_x8.h)
X8Q40_B = 144  # bytes of 8 Q4_0 rows' block (csrc/q4_0_x8.h)
X8MX_B = 136  # bytes of 8 MXFP4 rows' block (csrc/mxfp4_x8.h)
# dtype codes (csrc/common.h): Q4_K, GEMM tokens 4 at a time; Q4_K, every token by the GEMV (a
# mixture's experts); Q4_0 and MXFP4 (one order for both)
X8, X8_GEMV, X8_Q4_0, X8_MXFP4 = 11, 12, 13, 15
STACKS = (X8, X8_Q4_0, X8_MXFP4)  # the codes :func:`interleaved` builds
_LAYOUTS = {
    GGMLType.Q4_K: (256, X8_SB, X8),
    GGMLType.Q4_0: (32, X8Q40_B, X8_Q4_0),
    GGMLType.MXFP4: (32, X8MX_B, X8_MXFP4),
}
_ROW_BYTES = {X8: (256, 144), X8_GEMV: (256, 144), X8_Q4_0: (32, 18), X8_MXFP4: (32, 17)}
_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the range's pages (file pages are read back on use)
_PROT_RW, _MAP_PRIVATE_FIXED = 0x1 | 0x2, 0x02 | 0x10


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's madvise and mmap on Linux (their flags are Linux's), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.mmap.restype = ctypes.c_void_p
    except (OSError, TypeError, AttributeError):
        return None
    return libc


def interleaved(
    lib: kernels.KernelLibrary,
    m: kernels.Matrix,
    release: bool = True,
    pages: gguf_reader.FilePages | None = None,
) -> kernels.Matrix | None:
    """``m``'s rows interleaved 8 at a time, in a new buffer; None where ``m`` is not a Q4_K,
    Q4_0 or MXFP4 matrix of 8k rows or the kernels have no interleaved products (no AVX2).

    With ``release`` the pages of ``m``'s own rows are handed back to the kernel afterwards (a
    file mapping reads them again if a row gather needs them), so a dense model stays near its
    file's size in memory; a matrix whose rows a sparse FFN gathers keeps them where they are.
    ``pages``: the file read into memory that holds ``m``'s rows (:func:`release_pages`).
    """
    layout = next((v for t, v in _LAYOUTS.items() if kernels.DTYPE_CODES[t] == m.code), None)
    if layout is None or m.nrows % 8 or m.cols % layout[0]:
        return None
    qk, block_bytes, want = layout
    gb = m.cols // qk * block_bytes
    out = torch.empty(m.nrows // 8, gb, dtype=torch.uint8)  # (groups, group bytes)
    fn = lib.cdll.pp_repack_x8
    code = fn(m.code, m.ptr, m.ld, m.nrows, m.cols, out.data_ptr(), 0, torch.get_num_threads())
    if code < 0:
        return None
    assert code == want, code
    if release:
        release_pages(m.ptr, m.ld * m.nrows, pages)
    return kernels.Matrix(out, code, m.nrows, m.cols, gb)


def dense_kernel(w) -> tuple[kernels.KernelLibrary, kernels.Matrix] | None:
    """Weight ``w``'s (library, matrix) for whole-matrix products: a Q4_K, Q4_0 or MXFP4 matrix's
    interleaved rows (``QuantWeight.dense_kernel``), any other weight's ``kernel()``."""
    return getattr(w, "dense_kernel", w.kernel)()


def expert_rows(m: kernels.Matrix, start: int, n: int) -> kernels.Matrix:
    """Rows ``start .. start + n`` (multiples of 8) of an interleaved stack of experts, every
    token multiplied in the GEMV's order, as llama.cpp multiplies its experts."""
    assert m.code in _ROW_BYTES and start % 8 == 0 and n % 8 == 0
    code = X8_GEMV if m.code == X8 else m.code  # Q4_0, MXFP4: one order for every token count
    return kernels.Matrix(m.data[start // 8 : (start + n) // 8], code, n, m.cols, m.ld)


def rows_of(lib: kernels.KernelLibrary, m: kernels.Matrix) -> torch.Tensor:
    """An interleaved matrix's rows again, (nrows, row bytes) uint8 (for tests)."""
    if m.code not in _ROW_BYTES:
        raise ValueError("not an interleaved matrix")
    qk, block_bytes = _ROW_BYTES[m.code]
    out = torch.empty(m.nrows, m.cols // qk * block_bytes, dtype=torch.uint8)
    if lib.cdll.pp_repack_x8(m.code, m.ptr, m.ld, m.nrows, m.cols, out.data_ptr(), 1, 1) < 0:
        raise ValueError("not an interleaved matrix")
    return out


def release_pages(ptr: int, nbytes: int, pages: gguf_reader.FilePages | None = None) -> None:
    """Hand the whole pages of ``[ptr, ptr + nbytes)`` back to the kernel without changing a
    byte: in a file read into memory (the default load; ``pages``, the file's
    ``GGUFFile.pages``), the same bytes of the file are mapped over them (read back from the
    file if a row is needed again); in a file mapping, the kernel reclaims them. Any other
    memory keeps its pages. A failure is only logged."""
    start = -(-ptr // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (ptr + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    libc = _libc()
    if end <= start or libc is None:
        return
    at = None if pages is None else pages.range(start, end - start)
    if at is not None:
        got = libc.mmap(start, end - start, _PROT_RW, _MAP_PRIVATE_FIXED, *at)
        if got != start:
            logger.debug("mmap(MAP_FIXED) over a loaded file failed: errno %d", ctypes.get_errno())
    elif libc.madvise(start, end - start, _MADV_PAGEOUT) != 0:
        logger.debug("madvise(MADV_PAGEOUT) failed: errno %d", ctypes.get_errno())
