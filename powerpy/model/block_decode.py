"""ggml blocks decoded with torch ops on the tensor's device (no host round trip).

The quantized weights' fallback and accelerator paths (``powerpy.model.matrices``) decode the rows
they touch with these; the results equal ``gguf.quants.dequantize`` bit for bit (ggml's f32
operation order).
"""

from __future__ import annotations

import torch
from torch import Tensor

from powerpy.formats.constants import TYPE_TRAITS, GGMLType
from powerpy.formats.quants import MXFP4_VALUES


def _f16_field(b: Tensor, start: int) -> Tensor:
    # b (..., type_size) uint8 -> the f16 at byte `start` as f32 (..., 1)
    return b[..., start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor, dim: int) -> Tensor:
    # qs (..., k) uint8 -> low and high nibbles stacked along `dim`, as int16
    q = qs.to(torch.int16)
    return torch.stack([q & 15, q >> 4], dim=dim)


def _bits_u32(b: Tensor) -> Tensor:
    # b (..., 4) uint8 little-endian -> (..., 32) bits as int16, bit j at j
    v = b.to(torch.int64)
    word = v[..., 0] | v[..., 1] << 8 | v[..., 2] << 16 | v[..., 3] << 24
    shifts = torch.arange(32, device=b.device)
    return ((word[..., None] >> shifts) & 1).to(torch.int16)


def _scales_k4(s: Tensor) -> tuple[Tensor, Tensor]:
    # s (..., 12) uint8 packed 6-bit scales and mins of Q4_K/Q5_K -> two (..., 8) f32
    s = s.to(torch.int16)
    lo, hi = s[..., 0:4], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)
    m = torch.cat([s[..., 4:8] & 63, (hi >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return sc.float(), m.float()


def _decode_blocks(b: Tensor, t: GGMLType) -> Tensor:
    """Blocks (..., type_size) uint8 -> (..., block_size) f32, in ggml's f32 operation order."""
    if t == GGMLType.Q8_0:
        return b[..., 2:].contiguous().view(torch.int8).float() * _f16_field(b, 0)
    if t == GGMLType.Q4_0:
        q = _nibbles(b[..., 2:], -2).flatten(-2) - 8  # (..., 32)
        return q.float() * _f16_field(b, 0)
    if t in (GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1):
        qs_at = {GGMLType.Q4_1: 4, GGMLType.Q5_0: 6, GGMLType.Q5_1: 8}[t]
        q = _nibbles(b[..., qs_at:], -2).flatten(-2)  # (..., 32)
        if t != GGMLType.Q4_1:
            q = q | _bits_u32(b[..., qs_at - 4 : qs_at]) << 4
        if t == GGMLType.Q5_0:
            return (q - 16).float() * _f16_field(b, 0)
        return _f16_field(b, 0) * q.float() + _f16_field(b, 2)
    if t in (GGMLType.Q4_K, GGMLType.Q5_K):
        sc, m = _scales_k4(b[..., 4:16])  # (..., 8)
        qs = b[..., -128:].reshape(*b.shape[:-1], 4, 32)
        q = _nibbles(qs, -2).reshape(*b.shape[:-1], 8, 32)  # sub-block s: pair s // 2, nibble s % 2
        if t == GGMLType.Q5_K:
            qh = b[..., 16:48].to(torch.int16)  # bit s of byte l: element l of sub-block s
            q = q | ((qh[..., None, :] >> torch.arange(8, device=b.device)[:, None]) & 1) << 4
        d = _f16_field(b, 0) * sc  # (..., 8)
        mn = _f16_field(b, 2) * m
        return (d[..., None] * q.float() - mn[..., None]).flatten(-2)
    if t == GGMLType.Q6_K:
        lead = b.shape[:-1]
        ql = b[..., :128].reshape(*lead, 2, 2, 32)  # (half, k & 1, l)
        lo4 = _nibbles(ql, -3).reshape(*lead, 2, 4, 32)  # (half, k = 2 * hi + (k & 1), l)
        qh = b[..., 128:192].reshape(*lead, 2, 1, 32).to(torch.int16)
        hi2 = (qh >> (2 * torch.arange(4, device=b.device))[:, None]) & 3
        q = (lo4 | hi2 << 4) - 32  # (..., 2, 4, 32)
        sc = b[..., 192:208].contiguous().view(torch.int8).reshape(*lead, 2, 4, 2).float()
        dsc = _f16_field(b, 208)[..., None, None] * sc.repeat_interleave(16, dim=-1)
        return (dsc * q.float()).reshape(*lead, 256)
    if t == GGMLType.MXFP4:  # e, 16 bytes of codes: kvalue(code) · 2^(e - 128)
        e = b[..., :1].to(torch.int64)  # (..., 1)
        bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(torch.int32)
        values = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=b.device)
        q = _nibbles(b[..., 1:], -2).flatten(-2).long()  # (..., 32)
        return values[q] * bits.view(torch.float32)
    raise ValueError(f"no torch decoder for {t.name}")


def dequantize_rows_torch(raw: Tensor, ggml_type: GGMLType, cols: int) -> Tensor:
    """Decode raw ggml rows with torch ops on the tensor's device (no host round trip):
    raw (n, row_bytes) -> (n, cols) f32, equal to ``gguf.quants.dequantize``."""
    n = raw.shape[0]
    if ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        dt = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16}.get(
            ggml_type, torch.bfloat16
        )
        return raw.contiguous().view(dt).reshape(n, cols).float()
    tr = TYPE_TRAITS[ggml_type]
    b = raw.reshape(n, cols // tr.block_size, tr.type_size)
    return _decode_blocks(b, ggml_type).reshape(n, cols)
