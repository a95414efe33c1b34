"""Fused kernels for matrices placed on a GPU: one launch per matrix, blocks decoded in registers.

A placed matrix keeps the bytes it has in the file (F16, Q8_0, Q4_0 or Q4_1 blocks), so the
VRAM budget charges exactly what is allocated, and a decode step reads each placed byte once:

- ``powerpy::linear(w, x, need?, bucket?)``: ``y = x @ W.T`` for row-major W (attention, the
  predictor, the output, a hot layer's gate and up rows stacked in one matrix). With ``need``
  (T, n_ff) bool and ``bucket`` (k,), row r is computed only where ``need[t, bucket[r % k]]``
  (else 0): a hot row the predictor turned off is not read, with no host round trip.
- ``powerpy::glu(gu, tau?, variant)``: a hot layer's activation ``h = act(g, u)`` from the
  stacked gate/up output, with the cut ``|h| < tau -> 0`` in the same pass.
- ``powerpy::rms_norm(x, w, eps)``: RMSNorm in one launch.
- ``powerpy::rows_sum(w, h)``: ``y = h @ W`` for neuron-major W (a hot layer's down rows); rows
  whose ``h`` is 0 are not read. Split over row chunks, then one sum: two launches.

They are torch custom ops written in Triton. Under ``FakeTensorMode`` their fake versions give
the output shapes, so the launch counts and the absence of host syncs are checked on a CPU. On
CPU tensors the same kernels run in Triton's interpreter (tests only: slow but exact). Without
Triton, :func:`available` is False and placed quantized matrices fall back to torch's block
decoding (``matrices.QuantWeight``), many ops per tile. :class:`FusedWeight` is the placed
matrix that calls them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os

import torch
from torch import Tensor

from powerpy.config import FFNVariant
from powerpy.formats.constants import GGMLType
from powerpy.model.matrices import QuantWeight

log = logging.getLogger(__name__)

_KERNELS = "powerpy.model.triton_kernels"

# The block types the kernels decode; their codes are compile-time constants of the kernels.
TYPES = {GGMLType.F16: 0, GGMLType.Q8_0: 1, GGMLType.Q4_0: 2, GGMLType.Q4_1: 3}
VARIANTS = {FFNVariant.SWIGLU: 0, FFNVariant.REGLU: 1, FFNVariant.DRELU: 2}
ROWS_SUM_SPLIT = 16  # row chunks of rows_sum (the second launch adds them)


@functools.cache
def available() -> bool:
    """Triton is installed: placed F16/Q8_0/Q4_0/Q4_1 matrices run in one launch each."""
    return importlib.util.find_spec("triton") is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def supports(ggml_type: GGMLType, cols: int) -> bool:
    """The fused kernels read rows of ``cols`` values of this type (32-value blocks)."""
    return ggml_type in TYPES and cols % 32 == 0


def _launch(name: str, grid, *args, **meta) -> None:
    """Launch kernel ``name`` of ``triton_kernels`` (imported on first use: Triton is slow to
    import, and optional). CPU tensors need Triton's interpreter, switched on by
    ``TRITON_INTERPRET=1`` before Triton is first imported (the test suite does that)."""
    if not available():
        raise RuntimeError(
            "the fused GPU kernels need Triton (it ships with CUDA builds of torch: "
            "pip install triton)"
        )
    on_cpu = next(a for a in args if isinstance(a, Tensor)).device.type == "cpu"
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the fused GPU kernels run on CPU tensors only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 before Triton is first imported"
        )
    getattr(importlib.import_module(_KERNELS), name)[grid](*args, **meta)


# ----------------------------------------------------------------------------------- ops
@torch.library.custom_op("powerpy::linear", mutates_args=())
def linear_op(
    w: Tensor, x: Tensor, qtype: int, cols: int, need: Tensor | None, bucket: Tensor | None
) -> Tensor:
    """w (rows, row_bytes) uint8, x (T, cols) f32 -> (T, rows) f32; see the module doc."""
    rows, T = w.shape[0], x.shape[0]
    y = torch.empty(T, rows, dtype=torch.float32, device=w.device)
    if rows == 0 or T == 0:
        return y
    nb = cols // 32
    br = 16
    if need is None or bucket is None:
        need = bucket = None  # every row
    else:
        need, bucket = need.contiguous(), bucket.contiguous()
    k = 1 if bucket is None else max(bucket.shape[0], 1)
    n_ff = 1 if need is None else need.shape[1]
    _launch(
        "_linear_kernel", (_cdiv(rows, br), T),
        w, x.contiguous(), y, need, bucket, rows, nb, w.shape[1], k, n_ff,
        QT=qtype, HAS_NEED=need is not None, BR=br, BB=8 if qtype == 0 else 4,
    )  # fmt: skip
    return y


@linear_op.register_fake
def _(w, x, qtype, cols, need, bucket):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("powerpy::rows_sum", mutates_args=())
def rows_sum_op(w: Tensor, h: Tensor, qtype: int, cols: int) -> Tensor:
    """w (rows, row_bytes) uint8 neuron-major, h (T, rows) f32 -> (T, cols) f32."""
    rows, T = w.shape[0], h.shape[0]
    nb = cols // 32
    split = max(1, min(ROWS_SUM_SPLIT, rows))
    part = torch.empty(split, T, cols, dtype=torch.float32, device=w.device)
    if rows == 0 or T == 0:
        return part.new_zeros(T, cols)
    bb = 8
    _launch(
        "_rows_sum_kernel", (_cdiv(nb, bb), split, T),
        w, h.contiguous(), part, rows, nb, w.shape[1], _cdiv(rows, split),
        QT=qtype, BR=16, BB=bb,
    )  # fmt: skip
    return part.sum(0)


@rows_sum_op.register_fake
def _(w, h, qtype, cols):
    return h.new_empty(h.shape[0], cols)


@torch.library.custom_op("powerpy::glu", mutates_args=())
def glu_op(gu: Tensor, tau: Tensor | None, variant: int) -> Tensor:
    """gu (T, 2k) f32 (gate rows then up rows) -> h (T, k) f32, cut by tau (k,) if given."""
    T, k = gu.shape[0], gu.shape[1] // 2
    h = torch.empty(T, k, dtype=torch.float32, device=gu.device)
    if T * k == 0:
        return h
    _launch(
        "_glu_kernel", (_cdiv(T * k, 1024),),
        gu.contiguous(), tau, h, k, T * k, HAS_TAU=tau is not None, VAR=variant, B=1024,
    )  # fmt: skip
    return h


@glu_op.register_fake
def _(gu, tau, variant):
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


@torch.library.custom_op("powerpy::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x (T, n) f32, w (n,) f32 -> x / sqrt(mean(x²) + eps) · w (T, n) f32."""
    y = torch.empty_like(x)
    if x.numel():
        n = x.shape[-1]
        _launch("_rms_norm_kernel", (x.numel() // n,), x.contiguous(), w, y, n, eps, B=1024)
    return y


@rms_norm_op.register_fake
def _(x, w, eps):
    return torch.empty_like(x)


# ----------------------------------------------------------------------------------- weight
class FusedWeight(QuantWeight):
    """A matrix placed on a GPU in its file bytes, computed by the fused kernels:
    ``linear`` and ``rows_sum`` are one custom op each.

    ``raw`` is ``(rows, row_bytes)`` uint8: ggml blocks of a type the kernels read (F16 values
    as bytes, Q8_0, Q4_0, Q4_1). Everything else is a ``QuantWeight``'s: row gathers and
    :meth:`dequantize` decode with torch ops (tests and tools).
    """

    def __init__(self, raw: Tensor, ggml_type: GGMLType, cols: int) -> None:
        if not supports(ggml_type, cols):
            raise ValueError(
                f"the fused kernels read {', '.join(t.name for t in TYPES)} rows of "
                f"a multiple of 32 values, not {ggml_type.name} rows of {cols}"
            )
        super().__init__(raw, ggml_type, cols)
        self._kernel_ok = False  # never the host kernels
        self._code = TYPES[ggml_type]

    @classmethod
    def of(cls, storage: Tensor, ggml_type: GGMLType, cols: int) -> FusedWeight:
        """From a weight's storage: raw blocks (uint8) or an F16 matrix (rows, cols)."""
        if storage.dtype == torch.float16:
            storage = storage.contiguous().view(torch.uint8)
        return cls(storage, ggml_type, cols)

    def linear(self, x: Tensor, need: Tensor | None = None, bucket: Tensor | None = None):
        """``x @ W.T``: x (T, cols) f32 -> (T, rows) f32 (x (cols,) -> (rows,)). With ``need``
        (T, n_ff) bool and ``bucket`` (k,): row r only where ``need[t, bucket[r % k]]``, else
        0, and the other rows are not read."""
        if x.dim() == 1:
            return self.linear(x[None], need, bucket)[0]
        return linear_op(self.raw, x.float(), self._code, self.cols, need, bucket)

    def rows_sum(self, h: Tensor) -> Tensor:
        """``h @ W`` for neuron-major W: h (T, rows) f32 -> (T, cols) f32; rows whose ``h`` is
        0 are not read."""
        return rows_sum_op(self.raw, h.float(), self._code, self.cols)

    def with_storage(self, t: Tensor) -> FusedWeight:
        """The same matrix over another copy of its blocks."""
        return FusedWeight(t, self.ggml_type, self.cols)


def glu(gu: Tensor, tau: Tensor | None, variant: FFNVariant | str) -> Tensor:
    """:func:`glu_op` for an FFN variant: gu (T, 2k) -> h (T, k)."""
    return glu_op(gu, tau, VARIANTS[FFNVariant(variant)])
