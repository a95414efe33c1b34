"""Fused ops of the accelerator's decode step: one launch each, placed blocks decoded in registers.

A placed matrix keeps the bytes it has in the file (F16, Q8_0, Q4_0, Q4_1 or MXFP4 blocks), so
the VRAM budget charges exactly what is allocated, and a decode step reads each placed byte once:

- ``powerpy::linear(w, x, need?, bucket?)``: ``y = x @ W.T`` for row-major W (attention's q/k/v
  in one matrix, the predictor, the output, a hot layer's gate and up rows stacked in one
  matrix), all T tokens of a tile against each weight tile, so a batch reads the weights once.
  With ``need`` (T, n_ff) bool and ``bucket`` (k,), row r is computed only where
  ``need[t, bucket[r % k]]`` (else 0): a block of rows no token needs is not read.
- ``powerpy::glu(gu, tau?, variant)``: a hot layer's activation ``h = act(g, u)`` from the
  stacked gate/up output, with the cut ``|h| < tau -> 0`` in the same pass.
- ``powerpy::rms_norm(x, w, eps)``: RMSNorm in one launch.
- ``powerpy::block_rows_sum(w, h)``: ``y = h @ W`` for neuron-major W (a hot layer's down
  rows); rows whose ``h`` is 0 for every token are not read. Split over row chunks, then one sum.
- ``powerpy::decode_attention(q, k, v, base, pos, ...)``: one query per session over a layer of
  the device KV pool (``cache.py``), each session's rows ``base .. base + pos`` (a window, a
  scale, a soft-cap), split over positions and merged: lengths are data, so a CUDA graph
  replays it at every position.
- ``powerpy::rope_kv(q, k, v, table, pos, rows, kc, vc, ...)``: RoPE of q and k at ``pos`` from a
  table of every position, and k and v written into the pool at ``rows``, in one launch.

They are torch custom ops. On CUDA they run Triton kernels (``triton_kernels``); on CPU tensors
(the emulated accelerator, which takes the same branches as CUDA) the same maths in torch ops;
under ``FakeTensorMode`` their fake versions give the output shapes, so launch counts and the
absence of host syncs are checked on a CPU. ``triton_*`` functions launch the Triton kernels on
any tensors (CPU ones in Triton's interpreter: the tests compare them with the torch versions).
Without Triton, :func:`available` is False and a CUDA device places quantized matrices with
torch's block decoding (``matrices.QuantWeight``), many ops per tile. :class:`DeviceQuantWeight` is
the placed matrix that calls them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.config import FFNVariant
from powerpy.formats.constants import GGMLType
from powerpy.model.block_decode import dequantize_rows_torch
from powerpy.model.matrices import QuantWeight

log = logging.getLogger(__name__)

_KERNELS = "powerpy.model.triton_kernels"

# The block types the kernels decode; their codes are compile-time constants of the kernels.
TYPES = {GGMLType.F16: 0, GGMLType.Q8_0: 1, GGMLType.Q4_0: 2, GGMLType.Q4_1: 3, GGMLType.MXFP4: 4}
_TYPE_OF = {code: t for t, code in TYPES.items()}
VARIANTS = {FFNVariant.SWIGLU: 0, FFNVariant.REGLU: 1, FFNVariant.DRELU: 2}
ROWS_SUM_SPLIT = 16  # row chunks of block_rows_sum (the second launch adds them)
ATTN_CHUNK = 256  # positions per program of decode_attention (the second launch merges them)
MAX_TILE_T = 16  # tokens per tile of linear and block_rows_sum (a larger batch takes several tiles)


@functools.cache
def available() -> bool:
    """Triton is installed: placed F16/Q8_0/Q4_0/Q4_1/MXFP4 matrices run in one launch each."""
    return importlib.util.find_spec("triton") is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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


def _decoded(w: Tensor, qtype: int, cols: int) -> Tensor:
    """The blocks w (rows, row_bytes) uint8 decoded: (rows, cols) f32 (the torch versions)."""
    return dequantize_rows_torch(w, _TYPE_OF[qtype], cols)


def _needed(need: Tensor | None, bucket: Tensor | None, rows: int) -> Tensor | None:
    """(T, rows) bool: row r is needed for token t when need[t, bucket[r % k]]."""
    if need is None or bucket is None:
        return None
    k = max(bucket.shape[0], 1)
    return need.index_select(1, bucket[torch.arange(rows, device=bucket.device) % k])


# ----------------------------------------------------------------------------------- linear
def triton_linear(w, x, qtype: int, cols: int, need=None, bucket=None) -> Tensor:
    """``powerpy::linear`` by the Triton kernel: w (rows, row_bytes) uint8, x (T, cols) f32 ->
    (T, rows) f32. Tiles of up to :data:`MAX_TILE_T` tokens read each weight tile once."""
    rows, T = w.shape[0], x.shape[0]
    y = torch.empty(T, rows, dtype=torch.float32, device=w.device)
    if rows == 0 or T == 0:
        return y
    nb = cols // 32
    if need is None or bucket is None:
        need = bucket = None  # every row
    else:
        need, bucket = need.contiguous(), bucket.contiguous()
    k = 1 if bucket is None else max(bucket.shape[0], 1)
    n_ff = 1 if need is None else need.shape[1]
    bt = 1 if T == 1 else MAX_TILE_T  # a batch: tensor-core tiles of 16 tokens (padded)
    br = 16 if bt == 1 else 32
    _launch(
        "_linear_kernel",
        (_cdiv(rows, br), _cdiv(T, bt)),
        w,
        x.contiguous(),
        y,
        need,
        bucket,
        rows,
        T,
        nb,
        w.shape[1],
        k,
        n_ff,
        QT=qtype,
        HAS_NEED=need is not None,
        BR=br,
        BT=bt,
        BB=8 if qtype == 0 else 4,
    )
    return y


@torch.library.custom_op("powerpy::linear", mutates_args=())
def linear_op(
    w: Tensor, x: Tensor, qtype: int, cols: int, need: Tensor | None, bucket: Tensor | None
) -> Tensor:
    """w (rows, row_bytes) uint8, x (T, cols) f32 -> (T, rows) f32; see the module doc."""
    return triton_linear(w, x, qtype, cols, need, bucket)


@linear_op.register_kernel("cpu")
def _(w, x, qtype, cols, need, bucket):
    y = x.float() @ _decoded(w, qtype, cols).t()
    keep = _needed(need, bucket, w.shape[0])
    return y if keep is None else y.mul_(keep)


@linear_op.register_fake
def _(w, x, qtype, cols, need, bucket):
    return x.new_empty(x.shape[0], w.shape[0])


# ----------------------------------------------------------------------------- block_rows_sum
def triton_block_rows_sum(w, h, qtype: int, cols: int) -> Tensor:
    """``powerpy::block_rows_sum`` by the Triton kernels: w (rows, row_bytes) uint8 neuron-major, h
    (T, rows) f32 -> (T, cols) f32."""
    rows, T = w.shape[0], h.shape[0]
    nb = cols // 32
    split = max(1, min(ROWS_SUM_SPLIT, rows))
    part = torch.empty(split, T, cols, dtype=torch.float32, device=w.device)
    if rows == 0 or T == 0:
        return part.new_zeros(T, cols)
    bt = 1 if T == 1 else MAX_TILE_T
    _launch(
        "_block_rows_sum_kernel",
        (_cdiv(nb, 4), split, _cdiv(T, bt)),
        w,
        h.contiguous(),
        part,
        rows,
        T,
        nb,
        w.shape[1],
        _cdiv(rows, split),
        QT=qtype,
        BR=16,
        BB=4,
        BT=bt,
    )
    return part.sum(0)


@torch.library.custom_op("powerpy::block_rows_sum", mutates_args=())
def block_rows_sum_op(w: Tensor, h: Tensor, qtype: int, cols: int) -> Tensor:
    """w (rows, row_bytes) uint8 neuron-major, h (T, rows) f32 -> (T, cols) f32."""
    return triton_block_rows_sum(w, h, qtype, cols)


@block_rows_sum_op.register_kernel("cpu")
def _(w, h, qtype, cols):
    return h.float() @ _decoded(w, qtype, cols)


@block_rows_sum_op.register_fake
def _(w, h, qtype, cols):
    return h.new_empty(h.shape[0], cols)


# ----------------------------------------------------------------------------------- glu
def _glu_torch(g: Tensor, u: Tensor, variant: int) -> Tensor:
    if variant == 0:
        return F.silu(g) * u
    if variant == 1:
        return F.relu(g) * u
    return F.relu(g) * F.relu(u)


def triton_glu(gu: Tensor, tau: Tensor | None, variant: int) -> Tensor:
    """``powerpy::glu`` by the Triton kernel."""
    T, k = gu.shape[0], gu.shape[1] // 2
    h = torch.empty(T, k, dtype=torch.float32, device=gu.device)
    if T * k == 0:
        return h
    _launch(
        "_glu_kernel",
        (_cdiv(T * k, 1024),),
        gu.contiguous(),
        tau,
        h,
        k,
        T * k,
        HAS_TAU=tau is not None,
        VAR=variant,
        B=1024,
    )
    return h


@torch.library.custom_op("powerpy::glu", mutates_args=())
def glu_op(gu: Tensor, tau: Tensor | None, variant: int) -> Tensor:
    """gu (T, 2k) f32 (gate rows then up rows) -> h (T, k) f32, cut by tau (k,) if given."""
    return triton_glu(gu, tau, variant)


@glu_op.register_kernel("cpu")
def _(gu, tau, variant):
    k = gu.shape[1] // 2
    h = _glu_torch(gu[:, :k], gu[:, k:], variant)
    return h if tau is None else h.masked_fill_(h.abs() < tau, 0.0)


@glu_op.register_fake
def _(gu, tau, variant):
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


# ----------------------------------------------------------------------------------- rms_norm
def triton_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """``powerpy::rms_norm`` by the Triton kernel."""
    y = torch.empty_like(x)
    if x.numel():
        n = x.shape[-1]
        _launch("_rms_norm_kernel", (x.numel() // n,), x.contiguous(), w, y, n, eps, B=1024)
    return y


@torch.library.custom_op("powerpy::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x (T, n) f32, w (n,) f32 -> x / sqrt(mean(x²) + eps) · w (T, n) f32."""
    return triton_rms_norm(x, w, eps)


@rms_norm_op.register_kernel("cpu")
def _(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@rms_norm_op.register_fake
def _(x, w, eps):
    return torch.empty_like(x)


# ----------------------------------------------------------------------------------- attention
def _softcap(s: Tensor, cap: float) -> Tensor:
    return s if not cap else s.div(cap).tanh_().mul_(cap)


def triton_decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    base: Tensor,
    pos: Tensor,
    scale: float,
    softcap: float,
    window: int,
    span: int,
) -> Tensor:
    """``powerpy::decode_attention`` by the Triton kernels: a program per (session, kv head,
    chunk of :data:`ATTN_CHUNK` positions) keeps its softmax's running max, sum and weighted
    values (the split of flash-decoding); a second launch merges the chunks."""
    B, n_head, hd = q.shape
    n_kv = k.shape[1]
    splits = max(1, _cdiv(span, ATTN_CHUNK))
    part_o = torch.empty(B, n_head, splits, hd, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(B, n_head, splits, 2, dtype=torch.float32, device=q.device)
    out = torch.empty(B, n_head * hd, dtype=torch.float32, device=q.device)
    if B == 0:
        return out
    group = n_head // n_kv
    _launch(
        "_decode_attn_kernel",
        (B, n_kv, splits),
        q.contiguous(),
        k,
        v,
        base,
        pos,
        part_o,
        part_ml,
        n_head,
        n_kv,
        hd,
        k.stride(0),
        ATTN_CHUNK,
        splits,
        scale,
        softcap,
        window,
        G=_pow2(group),
        D=_pow2(hd),
        BS=16,
        HAS_CAP=bool(softcap),
        HAS_WIN=window > 0,
    )
    _launch(
        "_attn_merge_kernel",
        (B, n_head),
        part_o,
        part_ml,
        out,
        hd,
        splits,
        D=_pow2(hd),
        NS=_pow2(splits),
    )
    return out


@torch.library.custom_op("powerpy::decode_attention", mutates_args=())
def decode_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    base: Tensor,
    pos: Tensor,
    scale: float,
    softcap: float,
    window: int,
    span: int,
) -> Tensor:
    """q (B, n_head, hd) f32, k and v (rows, n_kv, hd) one layer of the pool, base and pos (B,)
    int64 -> (B, n_head·hd) f32: query b at position pos[b] over its rows base[b] ..
    base[b] + pos[b] (the last ``window`` of them when > 0), scores times ``scale``, soft-capped
    by ``softcap`` when > 0. ``span``: the longest cache (positions), which sizes the split."""
    return triton_decode_attention(q, k, v, base, pos, scale, softcap, window, span)


@decode_attention_op.register_kernel("cpu")
def _(q, k, v, base, pos, scale, softcap, window, span):
    B, n_head, hd = q.shape
    n_kv = k.shape[1]
    s = torch.arange(span, device=q.device)
    rows = (base[:, None] + s).clamp_(max=k.shape[0] - 1).reshape(-1)  # (B·span,)
    keys = k.index_select(0, rows).view(B, span, n_kv, hd).float().transpose(1, 2)
    vals = v.index_select(0, rows).view(B, span, n_kv, hd).float().transpose(1, 2)
    qg = q.float().view(B, n_kv, n_head // n_kv, hd)
    scores = _softcap(torch.matmul(qg, keys.transpose(2, 3)) * scale, softcap)  # (B, kv, g, S)
    seen = s[None] <= pos[:, None]  # (B, span)
    if window:
        seen &= pos[:, None] - s[None] < window
    scores.masked_fill_(~seen[:, None, None, :], -math.inf)
    return torch.matmul(scores.softmax(-1), vals).reshape(B, n_head * hd)


@decode_attention_op.register_fake
def _(q, k, v, base, pos, scale, softcap, window, span):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def decode_attention(q, k, v, base, pos, *, scale, softcap=0.0, window=0, span) -> Tensor:
    """:func:`decode_attention_op` with keywords."""
    return decode_attention_op(
        q, k, v, base, pos, float(scale), float(softcap or 0.0), int(window or 0), int(span)
    )


# ----------------------------------------------------------------------------------- rope_kv
def _rotate(x: Tensor, cs: Tensor, n_rot: int, neox: bool) -> Tensor:
    """x (B, heads, hd) f32 turned by cs (B, n_rot/2, 2) (cos, sin) in its first n_rot dims."""
    c, s = cs[:, None, :, 0], cs[:, None, :, 1]  # (B, 1, n_rot/2)
    if neox:
        half = n_rot // 2
        x1, x2 = x[..., :half], x[..., half:n_rot]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return torch.cat((rot, x[..., n_rot:]), dim=-1) if n_rot < x.shape[-1] else rot


def triton_rope_kv(q, k, v, table, pos, rows, kc, vc, n_rot: int, neox: bool) -> Tensor:
    """``powerpy::rope_kv`` by the Triton kernel: a program per (session, head of q, k)."""
    B, n_head, hd = q.shape
    n_kv = k.shape[1]
    out = torch.empty(B, n_head, hd, dtype=torch.float32, device=q.device)
    if B:
        _launch(
            "_rope_kv_kernel",
            (B, n_head + n_kv),
            q,
            k,
            v,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            table,
            pos,
            rows,
            kc,
            vc,
            out,
            n_head,
            n_kv,
            hd,
            n_rot,
            kc.stride(0),
            NEOX=neox,
            D=_pow2(hd),
        )
    return out


@torch.library.custom_op("powerpy::rope_kv", mutates_args=("kc", "vc"))
def rope_kv_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    pos: Tensor,
    rows: Tensor,
    kc: Tensor,
    vc: Tensor,
    n_rot: int,
    neox: bool,
) -> Tensor:
    """q (B, n_head, hd), k and v (B, n_kv, hd) f32 (rows may be strided views of one q/k/v
    projection), table (positions, n_rot/2, 2) f32 (cos, sin) of every position, pos and rows
    (B,) int64 -> q turned at pos (B, n_head, hd) f32; k turned and v are written at ``rows``
    of kc and vc (rows, n_kv, hd), one layer of the KV pool, in its dtype."""
    return triton_rope_kv(q, k, v, table, pos, rows, kc, vc, n_rot, neox)


@rope_kv_op.register_kernel("cpu")
def _(q, k, v, table, pos, rows, kc, vc, n_rot, neox):
    cs = table.index_select(0, pos)  # (B, n_rot/2, 2)
    kc.index_copy_(0, rows, _rotate(k.float(), cs, n_rot, neox).to(kc.dtype))
    vc.index_copy_(0, rows, v.to(vc.dtype))
    return _rotate(q.float(), cs, n_rot, neox)


@rope_kv_op.register_fake
def _(q, k, v, table, pos, rows, kc, vc, n_rot, neox):
    return q.new_empty(q.shape)


# ----------------------------------------------------------------------------------- weight
class DeviceQuantWeight:
    """A matrix placed on an accelerator in its file bytes, computed by this module's ops:
    ``linear`` and ``rows_sum`` are one custom op each (``powerpy::linear``,
    ``powerpy::block_rows_sum``).

    It holds the file's blocks as a :class:`~powerpy.model.matrices.QuantWeight` (``blocks``)
    with the host kernels off: ``raw`` is ``(rows, row_bytes)`` uint8, ggml blocks of a type the
    kernels read (F16 values as bytes, Q8_0, Q4_0, Q4_1, MXFP4). Row gathers, row copies and
    :meth:`dequantize` are the blocks' torch decoding (tests and tools).
    """

    def __init__(self, raw: Tensor, ggml_type: GGMLType, cols: int) -> None:
        if not supports(ggml_type, cols):
            raise ValueError(
                f"the fused kernels read {', '.join(t.name for t in TYPES)} rows of "
                f"a multiple of 32 values, not {ggml_type.name} rows of {cols}"
            )
        self.blocks = QuantWeight(raw, ggml_type, cols, native=False)  # never the host kernels
        self._code = TYPES[ggml_type]

    @classmethod
    def of(cls, storage: Tensor, ggml_type: GGMLType, cols: int) -> DeviceQuantWeight:
        """From a weight's storage: raw blocks (uint8) or an F16 matrix (rows, cols)."""
        if storage.dtype == torch.float16:
            storage = storage.contiguous().view(torch.uint8)
        return cls(storage, ggml_type, cols)

    @classmethod
    def stacked(cls, parts: list[DeviceQuantWeight]) -> DeviceQuantWeight | None:
        """One matrix of ``parts``' rows in order (q, k and v), or None when their types or
        widths differ. Device memory: the stack is a new copy (the parts are dropped by the
        caller)."""
        kinds = {(p.ggml_type, p.cols) for p in parts}
        if len(kinds) != 1:
            return None
        (kind, cols) = kinds.pop()
        return cls(torch.cat([p.raw for p in parts]), kind, cols)

    @property
    def raw(self) -> Tensor:
        """The blocks, ``(rows, row_bytes)`` uint8 on the device."""
        return self.blocks.raw

    @property
    def ggml_type(self) -> GGMLType:
        return self.blocks.ggml_type

    @property
    def cols(self) -> int:
        return self.blocks.cols

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def storage(self) -> Tensor:
        """The tensor holding the raw blocks."""
        return self.blocks.raw

    def kernel(self) -> None:
        return None  # never the host kernels

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
        return block_rows_sum_op(self.raw, h.float(), self._code, self.cols)

    def gather_linear(self, x: Tensor, idx: Tensor) -> Tensor:
        """Rows ``idx`` of ``W @ x`` (the blocks' torch decoding)."""
        return self.blocks.gather_linear(x, idx)

    def gather_axpy(self, h: Tensor, idx: Tensor, out: Tensor | None = None) -> Tensor:
        """``sum_j h[j] * W[idx[j]]`` (the blocks' torch decoding)."""
        return self.blocks.gather_axpy(h, idx, out)

    def take_rows(self, idx: Tensor) -> QuantWeight:
        """A new weight made of rows ``idx`` (raw blocks copied, not re-quantized)."""
        return self.blocks.take_rows(idx)

    def dequantize(self) -> Tensor:
        """The whole matrix as f32 (rows, cols): a full copy, for tests and tools."""
        return self.blocks.dequantize()

    def with_storage(self, t: Tensor) -> DeviceQuantWeight:
        """The same matrix over another copy of its blocks."""
        return DeviceQuantWeight(t, self.ggml_type, self.cols)


def glu(gu: Tensor, tau: Tensor | None, variant: FFNVariant | str) -> Tensor:
    """:func:`glu_op` for an FFN variant: gu (T, 2k) -> h (T, k)."""
    return glu_op(gu, tau, VARIANTS[FFNVariant(variant)])
