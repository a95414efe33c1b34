"""Weight matrices as the runtime computes with them: ``(rows, cols)``, rows = output features.

FFN matrices are neuron-major ``(n_ff, n_embd)`` (gate, up and down_t), so the sparse FFN is a
row gather: ``gather_linear`` computes selected rows of ``W @ x`` and ``gather_axpy`` sums
selected rows scaled by ``h``; :func:`glu_rows` fuses the gate and up passes. Quantized weights
keep their raw ggml blocks and are never dequantized as a whole (resident memory stays close to
the file size): rows are decoded on the fly.

On CPU, with contiguous rows, the methods call the native kernels of :mod:`powerpy.model.kernels`
(f32 accumulation, OpenMP on ``torch.get_num_threads()`` threads, the same bits at any thread
count: no BLAS call, whose bits vary with it). Elsewhere, or when the
kernels are unavailable or disabled, they use the fastest torch formulation measured on CPU
(``docs/kernels.md#torch-fallback``): ``index_select(out=)`` into a reused buffer plus
``F.linear``, and ``embedding_bag`` for the weighted row sum. All results are f32.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.formats import gguf_reader
from powerpy.formats.constants import TYPE_TRAITS, GGMLType
from powerpy.model import interleave, kernels, numerics
from powerpy.model.block_decode import dequantize_rows_torch

# Rows of f32 per dequantized tile in the torch paths (no native kernels).
TILE_ELEMENTS = 1 << 21  # 8 MiB of f32

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KERNEL_QUANTS = kernels.QUANT_TYPES


# ---- helpers -------------------------------------------------------------------------------------

_scratch = threading.local()


def _scratch_rows(k: int, cols: int, dtype: torch.dtype) -> Tensor:
    """A reused CPU ``(k, cols)`` buffer (per thread and dtype) until the next call: fresh
    multi-MB allocations page-fault on every call (docs/kernels.md#buffers-and-page-faults)."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    n = k * cols
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = bufs[dtype] = torch.empty(max(n, 1 << 16), dtype=dtype)
    return buf[:n].view(k, cols)


def _kernel_ok(t: Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1


def _is_f32_cpu(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _kernel_axpy(
    kern: tuple[kernels.KernelLibrary, kernels.Matrix], h: Tensor, idx: Tensor, out: Tensor | None
) -> Tensor:
    """``gather_axpy`` through the native kernel, adding into ``out`` wherever it lives."""
    lib, m = kern
    if out is None or _is_f32_cpu(out):
        return lib.gather_axpy(m, h, idx, out=out)
    return out.add_(lib.gather_axpy(m, h, idx).to(out.device))


def _as_x(x: Tensor, cols: int) -> Tensor:  # x: (cols,) or (1, cols) -> (cols,)
    if x.numel() != cols:
        raise ValueError(f"x has {x.numel()} elements, the matrix has {cols} columns")
    return x.reshape(cols)


def _as_idx(idx: Tensor) -> Tensor:
    return idx if idx.dtype == torch.int64 else idx.to(torch.int64)


# ---- dense ---------------------------------------------------------------------------------------


class DenseWeight:
    """A float matrix (f32, f16 or bf16) of shape ``(rows, cols)``."""

    def __init__(self, w: Tensor) -> None:
        assert w.dim() == 2, w.shape
        self.w = w  # (rows, cols)
        self._kernel_ok = w.dtype in _FLOAT_DTYPES and _kernel_ok(w)
        self._mat: kernels.Matrix | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    @property
    def device(self) -> torch.device:
        return self.w.device

    def kernel(self) -> tuple[kernels.KernelLibrary, kernels.Matrix] | None:
        if not self._kernel_ok:
            return None
        lib = kernels.library()
        if lib is None:
            return None
        if self._mat is None or self._mat.data is not self.w:  # built once (w is not reassigned)
            self._mat = kernels.Matrix.of_dense(self.w)
        return lib, self._mat

    def linear(self, x: Tensor, need: Tensor | None = None) -> Tensor:
        """``x @ W.T``: x (T, cols) f32 -> (T, rows) f32 (x (cols,) -> (rows,)); ``need``, a
        hint that quantized weights use, is ignored."""
        if x.dim() == 1:
            return self.linear(x[None])[0]
        kern = self.kernel()
        if kern is not None:  # the same bits at any thread count (BLAS's vary with it)
            return kern[0].gemm(kern[1], x)
        if self.w.dtype == torch.float32:
            return F.linear(x.float(), self.w)
        return F.linear(x.to(self.w.dtype), self.w).float()

    def gather_linear(self, x: Tensor, idx: Tensor) -> Tensor:
        """Rows ``idx`` of ``W @ x``: x (cols,), idx (k,) int64 -> (k,) f32."""
        kern = self.kernel()
        if kern is not None:
            return kern[0].gather_gemv(kern[1], x, idx)
        x = _as_x(x, self.w.shape[1])
        k = idx.numel()
        if k == 0:
            return self.w.new_zeros(0, dtype=torch.float32)
        idx = _as_idx(idx)
        xw = x.to(self.w.dtype)[None]  # (1, cols)
        if 2 * k >= self.w.shape[0]:  # a dense pass is cheaper than gathering half the rows
            return F.linear(xw, self.w)[0].index_select(0, idx).float()
        if self.w.device.type == "cpu":
            rows = torch.index_select(
                self.w, 0, idx, out=_scratch_rows(k, self.w.shape[1], self.w.dtype)
            )  # (k, cols)
        else:
            rows = torch.index_select(self.w, 0, idx)  # (k, cols)
        return F.linear(xw, rows)[0].float()

    def gather_axpy(self, h: Tensor, idx: Tensor, out: Tensor | None = None) -> Tensor:
        """``sum_j h[j] * W[idx[j]]``: h (k,) f32, idx (k,) -> (cols,) f32.

        Args:
            h: (k,) weights; rows with ``h[j] == 0`` may be skipped.
            idx: (k,) row ids.
            out: optional (cols,) f32 tensor to add the sum into (returned).
        """
        k = idx.numel()
        cols = self.w.shape[1]
        kern = self.kernel()
        if kern is not None:
            return _kernel_axpy(kern, h, idx, out)
        if k == 0:
            res = self.w.new_zeros(cols, dtype=torch.float32)
        else:
            bag = F.embedding_bag(
                _as_idx(idx)[None],
                self.w,
                per_sample_weights=h.to(self.w.dtype)[None],
                mode="sum",
            )
            res = bag[0].float()  # (cols,)
        return res if out is None else out.add_(res)

    def rows_sum(self, h: Tensor) -> Tensor:
        """``h @ W``, the rows summed scaled by h: h (T, rows) -> (T, cols) f32 (a neuron-major
        down matrix). On a device: one matmul in W's dtype (no f32 copy). On the host with the
        native kernels each token's row has the bits of its own one-token row sum, at any thread
        count and in any batch: one token sums its nonzero rows (``gather_axpy``), a batch takes
        the tiled row sums (``KernelLibrary.rows_sum``, ``pp_rows_sum``), which read a row once
        per tile of tokens and skip rows no token of the tile needs; else BLAS."""
        if self.w.device.type != "cpu":
            return (h.to(self.w.dtype) @ self.w).float()
        kern = self.kernel()
        if kern is not None and h.shape[0] == 1:
            return self.gather_axpy(h[0], torch.arange(self.w.shape[0]))[None]  # whole rows
        if kern is not None:
            return kern[0].rows_sum(kern[1], h)
        h = h.float()
        if self.w.dtype == torch.float32:
            # (W^T h^T)^T: MKL's vector-times-matrix path (h @ W) is ~20x slower here
            return (self.w.t() @ h.t()).t()
        out = h.new_zeros(h.shape[0], self.w.shape[1])
        step = max(16, TILE_ELEMENTS // max(self.w.shape[1], 1))
        for s in range(0, self.w.shape[0], step):
            out.addmm_(h[:, s : s + step], self.w[s : s + step].float())
        return out

    def take_rows(self, idx: Tensor) -> DenseWeight:
        """A new weight made of rows ``idx`` (contiguous)."""
        return DenseWeight(torch.index_select(self.w, 0, _as_idx(idx)).contiguous())

    def dequantize(self) -> Tensor:
        """The matrix as f32 (rows, cols)."""
        return self.w.float()

    @property
    def storage(self) -> Tensor:
        """The tensor holding the data."""
        return self.w

    def with_storage(self, t: Tensor) -> DenseWeight:
        """The same matrix over another copy of its data (e.g. on a device)."""
        return DenseWeight(t)


# ---- quantized -----------------------------------------------------------------------------------


class QuantWeight:
    """Raw ggml blocks ``(rows, row_bytes)`` uint8 of a quantized ``(rows, cols)`` matrix.

    Every type of ``kernels.QUANT_TYPES`` runs on the native kernels (CPU) or decodes the rows
    it touches with torch ops (any device). Nothing here dequantizes the whole matrix at once
    except :meth:`dequantize`.
    """

    def __init__(
        self,
        raw: Tensor,
        ggml_type: GGMLType,
        cols: int,
        gathered=False,
        repack=True,
        native=True,
        pages: gguf_reader.FilePages | None = None,
    ):
        """``native`` False: never the host kernels (a device copy's torch decoding, e.g.
        ``gpu_kernels.DeviceQuantWeight``'s blocks on the emulated device). ``pages``: the file
        read into memory whose bytes ``raw`` views (``GGUFFile.pages``), so that
        :meth:`interleave` can hand the copied rows' pages back to it."""
        tr = TYPE_TRAITS[ggml_type]
        assert raw.dtype == torch.uint8 and raw.dim() == 2
        assert raw.shape[1] == cols // tr.block_size * tr.type_size, (raw.shape, cols)
        self.raw = raw  # (rows, row_bytes)
        self.ggml_type = ggml_type
        self.cols = cols
        self._kernel_ok = native and ggml_type in _KERNEL_QUANTS and _kernel_ok(raw)
        self._mat: kernels.Matrix | None = None
        # The rows interleaved 8 at a time for whole-matrix products (``interleave``): derived
        # from ``raw``, built once by :meth:`interleave` (at load for the load's options,
        # ``stack_decode.prepare``; else by the first product that reads the matrix whole).
        # None: not built; False: none (not a Q4_K/Q4_0/MXFP4 matrix of 8k rows, or ``repack`` off).
        self.interleaved: kernels.Matrix | None | bool = None if repack else False
        self.gathered = gathered  # also read row by row (a sparse FFN): interleaving keeps rows
        self.pages = pages  # the file behind raw's pages, or None (a copy, a file mapping)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def kernel(self) -> tuple[kernels.KernelLibrary, kernels.Matrix] | None:
        if not self._kernel_ok:
            return None
        lib = kernels.library()
        if lib is None:
            return None
        if self._mat is None or self._mat.data is not self.raw:
            self._mat = kernels.Matrix.of_quant(self.raw, self.ggml_type, self.cols)
        return lib, self._mat

    def interleave(self) -> kernels.Matrix | None:
        """Build :attr:`interleaved` now if it is not built (once; with the native kernels):
        the Q4_K/Q4_0/MXFP4 rows interleaved 8 at a time in a new buffer, after which the pages of
        the file's own rows are handed back to the kernel unless the rows are ``gathered``
        (``interleave.interleaved``). Returns it, or None where the matrix has none."""
        if (k := self.kernel()) is not None and self.interleaved is None:
            release = not self.gathered
            self.interleaved = interleave.interleaved(*k, release, self.pages) or False
        return self.interleaved or None

    def dense_kernel(self) -> tuple[kernels.KernelLibrary, kernels.Matrix] | None:
        """``kernel()`` for whole-matrix products: Q4_K/Q4_0/MXFP4 rows interleaved
        (:meth:`interleave`)."""
        k = self.kernel()
        if k is None:
            return None
        x8 = self.interleave()
        return k if x8 is None else (k[0], x8)

    def _rows_f32(self, raw: Tensor) -> Tensor:
        # raw (n, row_bytes) -> (n, cols) f32
        return dequantize_rows_torch(raw, self.ggml_type, self.cols)

    def _tile_rows(self) -> int:
        return max(16, TILE_ELEMENTS // max(self.cols, 1))

    def linear(self, x: Tensor, need: Tensor | None = None) -> Tensor:
        """``x @ W.T``: x (T, cols) f32 -> (T, rows) f32 (x (cols,) -> (rows,)). With llama.cpp's
        rounding one integer GEMM reads the blocks once (:meth:`dense_kernel`'s; the rows' with
        ``need``), with f32 activations the native float GEMM; the torch fallback decodes tiles of
        rows for BLAS (never a full f32 copy). ``need`` (T, rows) bool, optional: the entries
        the caller uses (the others may come back 0, see ``KernelLibrary.gemm``)."""
        if x.dim() == 1:
            return self.linear(x[None])[0]
        x = x.float()
        rows, T = self.raw.shape[0], x.shape[0]
        q = numerics.current().quantized_activations  # llama.cpp's rounding: integer GEMM
        kern = self.dense_kernel() if q and need is None else self.kernel()
        if kern is not None:  # the same bits at any thread count (BLAS's vary with it)
            return kern[0].gemm(kern[1], x, need=need)
        out = self.raw.new_empty((T, rows), dtype=torch.float32)  # (T, rows)
        step = self._tile_rows()
        for s in range(0, rows, step):
            tile = self._rows_f32(self.raw[s : s + step])  # (n, cols)
            torch.mm(x, tile.t(), out=out[:, s : s + step])
        return out

    def gather_linear(self, x: Tensor, idx: Tensor) -> Tensor:
        """Rows ``idx`` of ``W @ x``: x (cols,), idx (k,) int64 -> (k,) f32."""
        kern = self.kernel()
        if kern is not None:
            return kern[0].gather_gemv(kern[1], x, idx)
        x = _as_x(x, self.cols).float()
        k = idx.numel()
        if k == 0:
            return self.raw.new_zeros(0, dtype=torch.float32)
        idx = _as_idx(idx)
        out = self.raw.new_empty(k, dtype=torch.float32)
        step = self._tile_rows()
        for s in range(0, k, step):
            rows = self._rows_f32(torch.index_select(self.raw, 0, idx[s : s + step]))
            out[s : s + step] = F.linear(x[None], rows)[0]
        return out

    def gather_axpy(self, h: Tensor, idx: Tensor, out: Tensor | None = None) -> Tensor:
        """``sum_j h[j] * W[idx[j]]``: h (k,) f32, idx (k,) -> (cols,) f32.

        Args:
            h: (k,) weights; rows with ``h[j] == 0`` may be skipped.
            idx: (k,) row ids.
            out: optional (cols,) f32 tensor to add the sum into (returned).
        """
        kern = self.kernel()
        if kern is not None:
            return _kernel_axpy(kern, h, idx, out)
        idx = _as_idx(idx)
        h = h.float()
        res = self.raw.new_zeros(self.cols, dtype=torch.float32)
        step = self._tile_rows()
        for s in range(0, idx.numel(), step):
            rows = self._rows_f32(torch.index_select(self.raw, 0, idx[s : s + step]))
            res += h[s : s + step] @ rows  # (cols,)
        return res if out is None else out.add_(res)

    def rows_sum(self, h: Tensor) -> Tensor:
        """``h @ W``, the rows summed scaled by h: h (T, rows) -> (T, cols) f32 (a neuron-major
        down matrix). On a device: the matrix decoded, one matmul; on the host native as
        :meth:`DenseWeight.rows_sum` (one token: whole rows streamed), else tiles of decoded
        rows and BLAS."""
        if self.raw.device.type != "cpu":
            return h.float() @ self.dequantize()
        kern = self.kernel()
        if kern is not None and h.shape[0] == 1:
            return self.gather_axpy(h[0], torch.arange(self.raw.shape[0]))[None]  # whole rows
        if kern is not None:
            return kern[0].rows_sum(kern[1], h)
        h = h.float()
        out = h.new_zeros(h.shape[0], self.cols)
        step = self._tile_rows()
        for s in range(0, self.raw.shape[0], step):
            out.addmm_(h[:, s : s + step], self._rows_f32(self.raw[s : s + step]))
        return out

    def take_rows(self, idx: Tensor) -> QuantWeight:
        """A new weight made of rows ``idx`` (raw blocks copied, not re-quantized)."""
        return QuantWeight(
            torch.index_select(self.raw, 0, _as_idx(idx)).contiguous(), self.ggml_type, self.cols
        )

    def dequantize(self) -> Tensor:
        """The whole matrix as f32 (rows, cols): a full copy, for tests and tools."""
        kern = self.kernel()
        if kern is not None:
            return kern[0].dequant_rows(kern[1], None)
        return self._rows_f32(self.raw)

    @property
    def storage(self) -> Tensor:
        """The tensor holding the raw blocks."""
        return self.raw

    def with_storage(self, t: Tensor) -> QuantWeight:
        """The same matrix over another copy of its blocks (e.g. on a device)."""
        return QuantWeight(t, self.ggml_type, self.cols)


# ---- transposed ----------------------------------------------------------------------------------


class TransposedWeight:
    """A neuron-major ``(n_ff, n_embd)`` view of a matrix stored ``(n_embd, n_ff)``: a dense
    GGUF's ``ffn_down``, kept as stored (raw blocks, memory-mapped) instead of transposed.

    Summing all rows (``h @ W_t``) is the stored matrix's ``linear``, as in llama.cpp; row
    gathers and row copies, which only research paths need on dense files, decode the matrix.
    """

    def __init__(self, inner: DenseWeight | QuantWeight) -> None:
        self.inner = inner  # (n_embd, n_ff)

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.inner.shape
        return (cols, rows)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def kernel(self) -> None:
        return None  # rows are not contiguous in memory

    def rows_sum(self, h: Tensor) -> Tensor:
        """``h @ W_t``: h (T, n_ff) -> (T, n_embd) f32."""
        return self.inner.linear(h.float())

    def gather_axpy(self, h: Tensor, idx: Tensor, out: Tensor | None = None) -> Tensor:
        """``sum_j h[j] * W_t[idx[j]]``: h (k,), idx (k,) -> (n_embd,) f32 (reads every row)."""
        full = h.new_zeros(self.shape[0], dtype=torch.float32)
        full.index_put_((_as_idx(idx),), h.float(), accumulate=True)
        res = self.inner.linear(full)
        return res if out is None else out.add_(res)

    def gather_linear(self, x: Tensor, idx: Tensor) -> Tensor:
        """Rows ``idx`` of ``W_t @ x``: x (n_embd,) -> (k,) f32."""
        return self.dequantize().index_select(0, _as_idx(idx)) @ x.float()

    def linear(self, x: Tensor, need: Tensor | None = None) -> Tensor:
        """``x @ W_t.T``: x (T, n_embd) -> (T, n_ff) f32 (decodes the matrix; no ``need``)."""
        return x.float() @ self.inner.dequantize()

    def take_rows(self, idx: Tensor) -> DenseWeight:
        """Rows ``idx`` of the neuron-major view as a new f32 weight."""
        return DenseWeight(self.dequantize().index_select(0, _as_idx(idx)).contiguous())

    def dequantize(self) -> Tensor:
        """The neuron-major matrix as f32 (n_ff, n_embd), a transposed view of a full copy."""
        return self.inner.dequantize().t()

    @property
    def storage(self) -> Tensor:
        """The tensor holding the stored matrix."""
        return self.inner.storage

    def with_storage(self, t: Tensor) -> TransposedWeight:
        """The same matrix over another copy of its data (e.g. on a device)."""
        return TransposedWeight(self.inner.with_storage(t))


@runtime_checkable
class Weight(Protocol):
    """A ``(rows, cols)`` matrix as the model computes with it, wherever it lives (host or
    device) and however it is stored: :class:`DenseWeight`, :class:`QuantWeight` (and
    ``gpu_kernels.DeviceQuantWeight``, its blocks on a device), :class:`TransposedWeight`,
    ``biased.BiasedWeight``. ``kernel()`` is (library, matrix) when the running call may compute
    it with the native kernels, else None. ``rows_sum(h)`` is ``h @ W``: the rows summed scaled
    by h, each kind by its fastest path (the FFN's down pass)."""

    @property
    def shape(self) -> tuple[int, int]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def storage(self) -> Tensor: ...

    def kernel(self) -> tuple[kernels.KernelLibrary, kernels.Matrix] | None: ...

    def linear(self, x: Tensor, need: Tensor | None = None) -> Tensor: ...

    def gather_linear(self, x: Tensor, idx: Tensor) -> Tensor: ...

    def gather_axpy(self, h: Tensor, idx: Tensor, out: Tensor | None = None) -> Tensor: ...

    def rows_sum(self, h: Tensor) -> Tensor: ...

    def take_rows(self, idx: Tensor) -> Weight: ...

    def dequantize(self) -> Tensor: ...

    def with_storage(self, t: Tensor) -> Weight: ...
