"""Native CPU kernels (powerpy/model/csrc/): build on first use, load with ctypes.

``powerpy.model.kernel_build`` compiles the library (``-O3 -march=native -fopenmp``) into a
per-user cache keyed by source, flags, compiler and CPU. When no compiler is found or the build
fails, :func:`available` returns False and logs the reason once; callers
(``powerpy.model.matrices``) then use their torch code paths, as they do in calls whose
numerics turn the kernels off (``RunOptions.numerics``, ``Numerics(native=False)``). Every
kernel runs on ``torch.get_num_threads()`` OpenMP threads, so ``torch.set_num_threads`` controls
them too (the library binds to torch's own ``libgomp.so.1``, so there is one thread pool).

Quantized matrices (:data:`QUANT_TYPES`) are read as raw ggml blocks; their matmuls round the
activations as llama.cpp does unless the call's numerics say otherwise
(``Numerics(quantized_activations=False)``, ``--exact-activations``).

The wrappers take CPU tensors and check shapes; ``powerpy.model.matrices`` decides when to call
them. Matrices are ``(rows, row_bytes)`` uint8 views or float tensors with contiguous rows.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from powerpy.config import FFNVariant
from powerpy.formats.constants import GGMLType
from powerpy.model import numerics
from powerpy.model.kernel_abi import (  # noqa: F401  (re-exported)
    ABI_VERSION,
    DTYPE_CODES,
    QUANT_TYPES,
    RECORD_FLAGS,
    SIGNATURES,
    VARIANTS,
    LayerRecord,
    RecMatrix,
    RecRoute,
)
from powerpy.model.kernel_build import (  # noqa: F401  (re-exported)
    DEFAULT_FLAGS,
    SOURCE,
    KernelBuildError,
    check_codes,
    compile_library,
    default_cache_dir,
    find_compiler,
)

logger = logging.getLogger(__name__)

SIMD_NAMES = {0: "scalar", 1: "AVX2", 2: "AVX-512"}
_ERR_INDEX = 1
_i64, _p = ctypes.c_int64, ctypes.c_void_p


def _raise(status: int, what: str, idx: Tensor | None = None, nrows: int = 0) -> None:
    if status == _ERR_INDEX and idx is not None:
        bad = idx[(idx < 0) | (idx >= nrows)]
        raise IndexError(f"{what}: row index out of range for {nrows} rows: {bad[:8].tolist()}")
    raise ValueError(f"{what}: invalid arguments (status {status})")


_F32, _I64 = torch.float32, torch.int64
CACHE_CODES = {_F32: 0, torch.float16: 1}  # the KV cache types the kernels read
_threads = torch.get_num_threads


def as_f32(x: Tensor) -> Tensor:
    """x as a contiguous f32 tensor (itself when it already is one)."""
    return x if x.dtype is _F32 and x.is_contiguous() else x.float().contiguous()


def _i64(idx: Tensor) -> Tensor:
    return idx if idx.dtype is _I64 and idx.is_contiguous() else idx.to(_I64).contiguous()


@dataclass
class Matrix:
    """A CPU weight matrix as the kernels see it: rows of ``cols`` elements ``ld`` bytes apart.

    ``data`` is the tensor that owns the memory (kept alive by this object), ``ptr`` its data
    pointer, ``code`` the C dtype code.
    """

    data: Tensor
    code: int
    nrows: int
    cols: int
    ld: int  # row stride in bytes
    ptr: int = 0

    def __post_init__(self) -> None:
        self.ptr = self.data.data_ptr()

    @property
    def args(self) -> tuple[int, int, int, int, int]:
        """The C functions' matrix arguments: (dtype code, data pointer, ld, nrows, cols)."""
        return self.code, self.ptr, self.ld, self.nrows, self.cols

    @property
    def rec(self) -> RecMatrix:
        """The matrix as the C side reads it (a layer record's, ``kernel_abi.RecMatrix``)."""
        return RecMatrix(*self.args)

    @staticmethod
    def pack(mats: list[Matrix | None]) -> ctypes.Array:
        """Matrices for the C side: a RecMatrix array (None: zeros)."""
        return (RecMatrix * len(mats))(*(RecMatrix() if m is None else m.rec for m in mats))

    @staticmethod
    def of_dense(w: Tensor) -> Matrix:
        # w: (rows, cols) f32/f16/bf16 on CPU, stride(1) == 1
        assert w.device.type == "cpu" and w.dim() == 2 and w.stride(1) == 1, w.shape
        return Matrix(w, DTYPE_CODES[w.dtype], w.shape[0], w.shape[1], w.stride(0) * w.itemsize)

    @staticmethod
    def of_quant(raw: Tensor, ggml_type: GGMLType, cols: int) -> Matrix:
        # raw: (rows, row_bytes) uint8 on CPU, stride(1) == 1
        assert raw.device.type == "cpu" and raw.dim() == 2 and raw.stride(1) == 1, raw.shape
        return Matrix(raw, DTYPE_CODES[ggml_type], raw.shape[0], cols, raw.stride(0))


class KernelLibrary:
    """The loaded shared library with tensor-level wrappers.

    All wrappers take CPU tensors; ``x``/``h`` are converted to contiguous f32 and ``idx`` to
    contiguous int64 when needed. Results are new f32 tensors unless ``out`` is given. An index
    outside ``[0, nrows)`` raises IndexError (the kernels check every index they read).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cdll = ctypes.CDLL(str(path))  # the raw functions (ggml_numerics calls some)
        for name, (argtypes, restype) in SIGNATURES.items():
            fn = getattr(self.cdll, name)
            fn.argtypes = argtypes
            fn.restype = restype
        version = self.cdll.pp_abi_version()
        if version != ABI_VERSION:
            raise KernelBuildError(f"{path}: ABI version {version}, expected {ABI_VERSION}")
        check_codes(self.cdll, path, DTYPE_CODES, LayerRecord)
        self.simd = SIMD_NAMES.get(self.cdll.pp_simd_level(), "?")
        self._gemv = self.cdll.pp_gather_gemv
        self._axpy = self.cdll.pp_gather_axpy
        self._glu = self.cdll.pp_glu_gemv

    def gather_gemv(self, w: Matrix, x: Tensor, idx: Tensor | None) -> Tensor:
        """``out[j] = W[idx[j]] · x``: x (cols,) -> (k,) f32; ``idx=None`` means all rows."""
        x = as_f32(x)
        if x.numel() != w.cols:
            raise ValueError(f"x has {x.numel()} elements, the matrix {w.cols} columns")
        if idx is None:
            k, ip = w.nrows, None
        else:
            idx = _i64(idx)
            k, ip = idx.numel(), idx.data_ptr()
        out = torch.empty(k, dtype=_F32)
        st = self._gemv(*w.args, x.data_ptr(), ip, k, out.data_ptr(), act_code(), _threads())
        if st:
            _raise(st, "gather_gemv", idx, w.nrows)
        return out

    def down_runs(self, w: Matrix, h: Tensor) -> Tensor:
        """``h @ W.T`` for T tokens, reading only each token's groups of h that are not all
        zero (a MoE cut's; ``csrc/moe.h`` ``down_runs``): h (T, cols) -> (T, rows) f32."""
        h = as_f32(h)
        out = torch.empty(h.shape[0], w.nrows, dtype=_F32)
        st = self.cdll.pp_down_runs(
            *w.args, h.data_ptr(), h.shape[0], out.data_ptr(), act_code(), _threads()
        )
        if st:
            _raise(st, "down_runs", None, w.nrows)
        return out

    def gather_axpy(
        self, w: Matrix, h: Tensor, idx: Tensor | None, out: Tensor | None = None
    ) -> Tensor:
        """``out (+)= sum_j h[j] * W[idx[j]]``: h (k,) -> (cols,) f32; rows with h[j]==0 skipped.
        With ``out`` (f32, contiguous, (cols,)) the sum is added into it; else a new tensor."""
        h = as_f32(h)
        k = h.numel()
        if idx is None:
            if k != w.nrows:
                raise ValueError(f"h has {k} elements, the matrix {w.nrows} rows")
            ip = None
        else:
            idx = _i64(idx)
            if idx.numel() != k:
                raise ValueError(f"h has {k} elements, idx {idx.numel()}")
            ip = idx.data_ptr()
        accumulate = out is not None
        if out is None:
            out = torch.empty(w.cols, dtype=_F32)
        elif out.dtype is not _F32 or not out.is_contiguous() or out.numel() != w.cols:
            raise ValueError(f"out must be a contiguous f32 tensor of {w.cols} elements")
        st = self._axpy(*w.args, h.data_ptr(), ip, k, out.data_ptr(), accumulate, _threads())
        if st:
            _raise(st, "gather_axpy", idx, w.nrows)
        return out

    def rows_sum(self, w: Matrix, h: Tensor) -> Tensor:
        """``h @ W`` for a neuron-major W: h (T, nrows) -> (T, cols) f32, each token's row the
        bits of its ``gather_axpy`` over every row, at any thread count (docs/kernels.md)."""
        h = as_f32(h)
        if h.dim() != 2 or h.shape[1] != w.nrows:
            raise ValueError(f"h has shape {tuple(h.shape)}, expected (T, {w.nrows})")
        out = torch.empty(h.shape[0], w.cols, dtype=_F32)
        st = self.cdll.pp_rows_sum(*w.args, h.data_ptr(), h.shape[0], out.data_ptr(), _threads())
        if st:
            _raise(st, "rows_sum")
        return out

    def glu(self, gate: Matrix, up: Matrix, x: Tensor, idx: Tensor, variant: FFNVariant) -> Tensor:
        """Fused ``h[j] = act(gate[idx[j]]·x, up[idx[j]]·x)``: -> (k,) f32 (see VARIANTS);
        ``gate`` must match ``up`` in dtype and shape."""
        x = as_f32(x)
        if x.numel() != up.cols:
            raise ValueError(f"x has {x.numel()} elements, the matrix {up.cols} columns")
        idx = _i64(idx)
        k = idx.numel()
        variant = FFNVariant(variant)
        if not variant.gated:
            raise ValueError(f"glu: {variant.value} is an ungated FFN variant (no gate rows)")
        code = VARIANTS[variant]
        if (gate.code, gate.nrows, gate.cols) != (up.code, up.nrows, up.cols):
            raise ValueError("gate and up differ in dtype or shape")
        gp, gld = gate.ptr, gate.ld
        out = torch.empty(k, dtype=_F32)
        st = self._glu(
            up.code,
            gp,
            gld,
            up.ptr,
            up.ld,
            up.nrows,
            up.cols,
            x.data_ptr(),
            idx.data_ptr(),
            k,
            code,
            out.data_ptr(),
            act_code(),
            _threads(),
        )
        if st:
            _raise(st, "glu", idx, up.nrows)
        return out

    def gemm(
        self, w: Matrix, x: Tensor, out: Tensor | None = None, need: Tensor | None = None
    ) -> Tensor:
        """Dense ``x @ W.T``: x (T, cols) -> (T, rows) f32, W read once.

        ``x`` and ``out`` may have a row stride (``stride(1) == 1`` is required). ``need``
        (T, rows) bool, optional: the entries the caller will use; the Q4_0 integer GEMM leaves
        0 where no token of an 8-token tile needs a pair of rows (a predictor-gated prompt).
        """
        if x.dtype is not _F32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        if x.dim() != 2 or x.shape[1] != w.cols:
            raise ValueError(f"x has shape {tuple(x.shape)}, expected (T, {w.cols})")
        T = x.shape[0]
        if out is None:
            out = torch.empty(T, w.nrows, dtype=_F32)
        elif out.dtype is not _F32 or out.shape != (T, w.nrows) or out.stride(1) != 1:
            raise ValueError(f"out must be f32 of shape ({T}, {w.nrows}) with unit column stride")
        if need is not None:
            if need.shape != (T, w.nrows):
                raise ValueError(f"need has shape {tuple(need.shape)}, expected ({T}, {w.nrows})")
            need = need.to(torch.bool).contiguous()
        st = self.cdll.pp_gemm(
            *w.args,
            x.data_ptr(),
            x.stride(0),
            T,
            out.data_ptr(),
            out.stride(0),
            None if need is None else need.data_ptr(),
            act_code(),
            _threads(),
        )
        if st:
            _raise(st, "gemm")
        return out

    def attn_decode(
        self,
        rec: LayerRecord,
        heads: tuple[int, int, int, int, float],
        x: Tensor,
        rot: Tensor | None,
        cache: tuple[Tensor, Tensor, int],
    ) -> Tensor:
        """One token's attention block in one call: ``rec`` the layer's record
        (``powerpy.model.layer_record``), ``heads`` = (n_head, n_head_kv, head_dim, n_rot, eps),
        x (n_embd,) the residual stream, ``rot`` (n_rot / 2, 2) f32 (cos, sin) per pair (None:
        no RoPE), ``cache`` = one layer's contiguous f32/f16 keys and values ``(n_ctx, n_kv,
        head_dim)`` and the position whose row is written. Returns x + attention (n_embd,)."""
        x = as_f32(x)
        rot = None if rot is None else as_f32(rot)
        k, v, pos = cache
        out = torch.empty(x.numel(), dtype=_F32)
        st = self.cdll.pp_attn_decode(
            rec,
            *heads,
            None if rot is None else rot.data_ptr(),
            x.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            CACHE_CODES[k.dtype],
            pos,
            out.data_ptr(),
            act_code(),
            _threads(),
        )
        if st:
            _raise(st, "attn_decode")
        return out

    def ffn_decode(
        self, rec: LayerRecord, eps: float, thr: float, r: Tensor, src: Tensor | None = None
    ) -> tuple[Tensor, int]:
        """One token's FFN block in one call: ``rec`` the layer's record, r (n_embd,) the
        residual stream it adds to, ``src`` the FFN's input before its norm, where the predictor
        reads it (a parallel block's input; None: r). The predictor keeps the neurons with
        ``fc2·relu(fc1·src) >= thr`` (the record holds no predictor: all), and the record's cut
        drops those with ``|h_j| < tau[j]``. Returns (r + FFN (n_embd,), how many neurons' down
        rows were added)."""
        r = as_f32(r)
        src = r if src is None else as_f32(src)
        out = torch.empty(r.numel(), dtype=_F32)
        k = self.cdll.pp_ffn_decode(
            rec, eps, thr, r.data_ptr(), src.data_ptr(), out.data_ptr(), act_code(), _threads()
        )
        if k < 0:
            _raise(-k, "ffn_decode")
        return out, k

    def stream_read(self, buf: Tensor) -> float:
        """Read all of ``buf`` (contiguous CPU) on every thread, as the kernels read weights."""
        return self.cdll.pp_stream_read(buf.data_ptr(), buf.numel() * buf.itemsize, _threads())

    def dequant_rows(
        self,
        w: Matrix,
        idx: Tensor | None,
        start: int = 0,
        count: int | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """Rows as f32 (k, cols): ``W[idx]``, or rows ``start:start+count`` when idx is None."""
        if idx is None:
            count = w.nrows - start if count is None else count
            if start < 0 or count < 0 or start + count > w.nrows:
                raise ValueError(f"rows {start}:{start + count} of {w.nrows}")
            k, ip, base, nrows = count, None, w.ptr + start * w.ld, count
        else:
            idx = _i64(idx)
            k, ip, base, nrows = idx.numel(), idx.data_ptr(), w.ptr, w.nrows
        if out is None:
            out = torch.empty(k, w.cols, dtype=_F32)
        elif out.dtype is not _F32 or not out.is_contiguous() or out.shape != (k, w.cols):
            raise ValueError(f"out must be a contiguous f32 tensor of shape ({k}, {w.cols})")
        st = self.cdll.pp_dequant_rows(
            w.code, base, w.ld, nrows, w.cols, ip, k, out.data_ptr(), torch.get_num_threads()
        )
        if st:
            _raise(st, "dequant_rows", idx, w.nrows)
        return out


def build(
    source: Path = SOURCE,
    flags: tuple[str, ...] = DEFAULT_FLAGS,
    cache_dir: Path | None = None,
    compiler: str | None = None,
) -> KernelLibrary:
    """Compile ``source`` (or reuse the cached build, :func:`compile_library`) and load it.

    Raises:
        KernelBuildError: no compiler, a failed compile, or a library that will not load.
    """
    target = compile_library(source, flags, cache_dir, compiler)
    try:
        return KernelLibrary(target)
    except OSError as e:
        raise KernelBuildError(f"cannot load {target}: {e}") from e


# ---- the built library ------------------------------------------------------------------------

_lock = threading.Lock()
_library: KernelLibrary | None = None
_failure: str | None = None  # why the build failed (logged once)


def act_code() -> int:
    """1 when the running call rounds quantized matmuls' activations like llama.cpp, else 0."""
    return int(numerics.current().quantized_activations)


def library() -> KernelLibrary | None:
    """The library for the running call, building it on first use; None when the call's
    numerics turn the kernels off or they are unavailable."""
    if not numerics.current().native:
        return None
    return built()


def built() -> KernelLibrary | None:
    """The loaded library, building it on first call; None when it is unavailable."""
    global _library, _failure
    if _library is not None or _failure is not None:
        return _library
    with _lock:
        if _library is None and _failure is None:
            try:
                _library = build()
                logger.debug("powerpy kernels: %s (%s)", _library.path, _library.simd)
            except KernelBuildError as e:
                _failure = str(e)
                logger.warning("powerpy kernels unavailable, using torch fallback: %s", e)
    return _library


def available() -> bool:
    """True when the native kernels are built (builds them on first call)."""
    return built() is not None
