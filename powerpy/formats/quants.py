"""ggml block formats: vectorised numpy dequantization and the Q8_0/Q4_0 reference quantizers.

Block layouts: ``docs/formats.md#quantized-blocks``. Every decoder works on whole blocks at once
(``(n_blocks, type_size)`` uint8 in, ``(n_blocks, block_size)`` float32 out) and the driver walks
the tensor in chunks of about a million elements, so temporaries stay small whatever the tensor
size. Results are bit-identical to ``gguf.quants.dequantize`` (PyPI ``gguf``): the float32
operations are done in the same order (e.g. Q4_1 is ``d*q + m`` with two roundings).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from powerpy.formats.constants import TYPE_TRAITS, GGMLType

logger = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_TYPES",
    "QUANTIZE_TYPES",
    "dequantize",
    "quantize",
    "quantize_q4_0",
    "quantize_q4_1",
    "quantize_q8_0",
]

# Elements decoded per step: bounds the float32 temporaries to a few MB per live array.
_CHUNK_ELEMS = 1 << 20

# Types stored element by element (no blocks): file dtype, always little-endian.
_PLAIN_DTYPES: dict[GGMLType, str] = {
    GGMLType.F32: "<f4",
    GGMLType.F16: "<f2",
    GGMLType.I8: "i1",
    GGMLType.I16: "<i2",
    GGMLType.I32: "<i4",
}

_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)  # 2-bit fields of a byte
_BIT_SHIFTS_8 = np.arange(8, dtype=np.uint8)
_BIT_SHIFTS_32 = np.arange(32, dtype=np.uint32)


# --- helpers ------------------------------------------------------------------------------------
def _f16_col(b: np.ndarray, start: int) -> np.ndarray:
    """fp16 field at byte ``start`` of every block -> float32 column (n_blocks, 1)."""
    return np.ascontiguousarray(b[:, start : start + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., n) bytes -> (..., 2, n) nibbles: low nibbles first, then high nibbles."""
    return (qs[..., None, :] >> _NIBBLE_SHIFTS[:, None]) & np.uint8(0x0F)


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte 6-bit scale/min field of Q4_K/Q5_K: (n_blocks, 12) -> 2 x (n_blocks, 8).

    For j < 4: ``sc_j = s[j] & 63``, ``m_j = s[j+4] & 63``; for j >= 4:
    ``sc_j = (s[j+4] & 15) | (s[j-4] >> 6) << 4`` and ``m_j = (s[j+4] >> 4) | (s[j] >> 6) << 4``.
    """
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]  # (n_blocks, 4) each
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


# --- block decoders: b (n_blocks, type_size) uint8 -> out (n_blocks, block_size) float32 --------
def _dec_q4_0(b: np.ndarray, out: np.ndarray) -> None:
    # d, qs[16]; byte j: element j (low nibble), element j+16 (high nibble)
    d = _f16_col(b, 0)
    q = _nibbles(b[:, 2:18]).reshape(len(b), 32).astype(np.float32)
    q -= np.float32(8)
    np.multiply(d, q, out=out)


def _dec_q4_1(b: np.ndarray, out: np.ndarray) -> None:
    # d, m, qs[16]; y = d*q + m
    d, m = _f16_col(b, 0), _f16_col(b, 2)
    q = _nibbles(b[:, 4:20]).reshape(len(b), 32).astype(np.float32)
    np.multiply(d, q, out=out)
    out += m


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """5-bit values of Q5_0/Q5_1: qh (n_blocks, 4) u32 LE bit j = high bit of element j."""
    hbits = (np.ascontiguousarray(qh).view("<u4") >> _BIT_SHIFTS_32) & np.uint32(1)  # (nb, 32)
    lo = _nibbles(qs).reshape(len(qs), 32)
    return lo | (hbits.astype(np.uint8) << np.uint8(4))


def _dec_q5_0(b: np.ndarray, out: np.ndarray) -> None:
    # d, qh[4], qs[16]; y = d*(q - 16)
    d = _f16_col(b, 0)
    q = _q5_values(b[:, 2:6], b[:, 6:22]).astype(np.float32)
    q -= np.float32(16)
    np.multiply(d, q, out=out)


def _dec_q5_1(b: np.ndarray, out: np.ndarray) -> None:
    # d, m, qh[4], qs[16]; y = d*q + m
    d, m = _f16_col(b, 0), _f16_col(b, 2)
    q = _q5_values(b[:, 4:8], b[:, 8:24]).astype(np.float32)
    np.multiply(d, q, out=out)
    out += m


def _dec_q8_0(b: np.ndarray, out: np.ndarray) -> None:
    # d, i8 qs[32]; y = q*d
    d = _f16_col(b, 0)
    np.multiply(b[:, 2:34].view(np.int8), d, out=out, dtype=np.float32)


def _dec_q2_k(b: np.ndarray, out: np.ndarray) -> None:
    # scales[16], qs[64], d, dmin; element 128h + 32j + l is (qs[32h + l] >> 2j) & 3
    nb = len(b)
    sc = b[:, 0:16]
    d, dmin = _f16_col(b, 80), _f16_col(b, 82)
    dl = d * (sc & np.uint8(15)).astype(np.float32)  # (nb, 16)
    ml = dmin * (sc >> np.uint8(4)).astype(np.float32)
    qs = b[:, 16:80].reshape(nb, 2, 1, 32)
    q = ((qs >> _CRUMB_SHIFTS[:, None]) & np.uint8(3)).reshape(nb, 16, 16).astype(np.float32)
    o = out.reshape(nb, 16, 16)
    np.multiply(dl[:, :, None], q, out=o)
    o -= ml[:, :, None]


def _dec_q3_k(b: np.ndarray, out: np.ndarray) -> None:
    # hmask[32], qs[64], scales[12], d; element 128h + 32j + l: 2 low bits (qs[32h+l] >> 2j) & 3,
    # minus 4 unless bit 4h+j of hmask[l] is set; 16 signed 6-bit scales (minus 32)
    nb = len(b)
    s = b[:, 96:108]
    low = np.concatenate([s[:, 0:8] & np.uint8(15), s[:, 0:8] >> np.uint8(4)], axis=1)  # (nb, 16)
    high = ((s[:, 8:12].reshape(nb, 1, 4) >> _CRUMB_SHIFTS[:, None]) & np.uint8(3)).reshape(nb, 16)
    scale = (low | (high << np.uint8(4))).astype(np.float32)
    scale -= np.float32(32)
    dl = _f16_col(b, 108) * scale  # (nb, 16)
    ql = (b[:, 32:96].reshape(nb, 2, 1, 32) >> _CRUMB_SHIFTS[:, None]) & np.uint8(3)  # (nb,2,4,32)
    hshift = _BIT_SHIFTS_8.reshape(2, 4, 1)
    hbit = (b[:, 0:32].reshape(nb, 1, 1, 32) >> hshift) & np.uint8(1)  # (nb, 2, 4, 32)
    q = ql.astype(np.float32) - ((np.uint8(1) - hbit) << np.uint8(2)).astype(np.float32)
    o = out.reshape(nb, 16, 16)
    np.multiply(dl[:, :, None], q.reshape(nb, 16, 16), out=o)


def _dec_q4_k(b: np.ndarray, out: np.ndarray) -> None:
    # d, dmin, scales[12], qs[128]; sub-block 2c (+1) = low (high) nibbles of qs[32c : 32c+32]
    nb = len(b)
    d, dmin = _f16_col(b, 0), _f16_col(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    dl = d * sc.astype(np.float32)  # (nb, 8)
    ml = dmin * mn.astype(np.float32)
    q = _nibbles(b[:, 16:144].reshape(nb, 4, 32)).reshape(nb, 8, 32).astype(np.float32)
    o = out.reshape(nb, 8, 32)
    np.multiply(dl[:, :, None], q, out=o)
    o -= ml[:, :, None]


def _dec_q5_k(b: np.ndarray, out: np.ndarray) -> None:
    # d, dmin, scales[12], qh[32], qs[128]; sub-block j takes its 5th bit from bit j of qh[l]
    nb = len(b)
    d, dmin = _f16_col(b, 0), _f16_col(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    dl = d * sc.astype(np.float32)  # (nb, 8)
    ml = dmin * mn.astype(np.float32)
    lo = _nibbles(b[:, 48:176].reshape(nb, 4, 32)).reshape(nb, 8, 32)
    hbit = (b[:, 16:48].reshape(nb, 1, 32) >> _BIT_SHIFTS_8[:, None]) & np.uint8(1)  # (nb, 8, 32)
    q = (lo | (hbit << np.uint8(4))).astype(np.float32)
    o = out.reshape(nb, 8, 32)
    np.multiply(dl[:, :, None], q, out=o)
    o -= ml[:, :, None]


def _dec_q6_k(b: np.ndarray, out: np.ndarray) -> None:
    # ql[128], qh[64], i8 scales[16], d; half h, quarter k, l < 32:
    # low 4 bits from ql[64h + 32(k%2) + l] (nibble k//2), high 2 bits (qh[32h + l] >> 2k) & 3
    nb = len(b)
    lo = _nibbles(b[:, 0:128].reshape(nb, 2, 64)).reshape(nb, 2, 4, 32)
    hi = (b[:, 128:192].reshape(nb, 2, 1, 32) >> _CRUMB_SHIFTS[:, None]) & np.uint8(3)
    q = (lo | (hi << np.uint8(4))).reshape(nb, 16, 16).astype(np.float32)
    q -= np.float32(32)
    ds = _f16_col(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)  # (nb, 16)
    np.multiply(ds[:, :, None], q, out=out.reshape(nb, 16, 16))


# MXFP4's E2M1 values, doubled (ggml's kvalues_mxfp4): a value is kvalue · 2^(e - 128)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml's E8M0 scale, halved: 2^(e - 128) as f32 (e < 2: the subnormals)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _dec_mxfp4(b: np.ndarray, out: np.ndarray) -> None:
    # e, qs[16]: y[j] = kvalue(qs[j] & 15) d, y[j + 16] = kvalue(qs[j] >> 4) d
    d = _e8m0_half(b[:, :1])
    q = MXFP4_VALUES[_nibbles(b[:, 1:17])].reshape(len(b), 32)  # (nb, 32)
    np.multiply(q, d, out=out, dtype=np.float32)


_DECODERS: dict[GGMLType, Callable[[np.ndarray, np.ndarray], None]] = {
    GGMLType.Q4_0: _dec_q4_0,
    GGMLType.Q4_1: _dec_q4_1,
    GGMLType.Q5_0: _dec_q5_0,
    GGMLType.Q5_1: _dec_q5_1,
    GGMLType.Q8_0: _dec_q8_0,
    GGMLType.Q2_K: _dec_q2_k,
    GGMLType.Q3_K: _dec_q3_k,
    GGMLType.Q4_K: _dec_q4_k,
    GGMLType.Q5_K: _dec_q5_k,
    GGMLType.Q6_K: _dec_q6_k,
    GGMLType.MXFP4: _dec_mxfp4,
}

# Every type dequantize() accepts (a superset of constants.DEQUANT_TYPES).
SUPPORTED_TYPES: frozenset[GGMLType] = frozenset({*_PLAIN_DTYPES, GGMLType.BF16, *_DECODERS})


def _check_type(ggml_type: GGMLType | int) -> GGMLType:
    try:
        return GGMLType(ggml_type)
    except ValueError:
        raise ValueError(f"unknown ggml type {ggml_type!r}") from None


# --- public: dequantize -------------------------------------------------------------------------
def dequantize(
    raw: npt.NDArray[np.uint8], ggml_type: GGMLType | int, shape: Sequence[int]
) -> npt.NDArray[np.float32]:
    """Decode raw ggml bytes into a new float32 array.

    Args:
        raw: uint8 array of any shape holding exactly the tensor's bytes, e.g. the
            ``(n_rows, row_bytes)`` view from ``GGUFFile.raw``. Non-contiguous input is copied.
        ggml_type: powerpy type (``GGMLType``; file ids must be mapped first).
        shape: numpy shape of the result (reversed ggml ``ne``); ``shape[-1]`` must be a
            multiple of the block size.

    Returns:
        A new, writable float32 array of ``shape`` (never a view of ``raw``). BF16 is widened as
        ``u16 << 16``; I8/I16/I32 are converted to float32 (large I32 values round).

    Raises:
        ValueError: unsupported type (the message names it), non-uint8 input, or a byte count
            that does not match ``shape``.
    """
    gt = _check_type(ggml_type)
    if gt not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(f"dequantization of ggml type {gt.name} is not supported ({names} are)")
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"raw tensor data must be uint8 bytes, got dtype {raw.dtype}")
    shape = tuple(int(s) for s in shape)
    tr = TYPE_TRAITS[gt]
    n = math.prod(shape)
    if shape and shape[-1] % tr.block_size:
        raise ValueError(
            f"{gt.name}: row length {shape[-1]} of shape {shape} is not a multiple of the "
            f"block size {tr.block_size}"
        )
    expected = n // tr.block_size * tr.type_size
    if raw.size != expected:
        raise ValueError(
            f"{gt.name} tensor of shape {shape} needs {expected} bytes, got {raw.size} bytes"
        )
    flat = raw.reshape(-1)  # (nbytes,); copies only when raw is not contiguous

    if gt in _PLAIN_DTYPES:
        return flat.view(_PLAIN_DTYPES[gt]).astype(np.float32).reshape(shape)
    if gt is GGMLType.BF16:
        bits = flat.view("<u2").astype(np.uint32)  # (n,), becomes the output buffer
        bits <<= np.uint32(16)
        return bits.view(np.float32).reshape(shape)

    decode = _DECODERS[gt]
    blocks = flat.reshape(-1, tr.type_size)  # (n_blocks, type_size)
    out = np.empty((len(blocks), tr.block_size), dtype=np.float32)  # (n_blocks, block_size)
    step = max(1, _CHUNK_ELEMS // tr.block_size)
    # inf/NaN scales in corrupt or random data must not warn: ggml decodes them silently
    with np.errstate(all="ignore"):
        for i in range(0, len(blocks), step):
            decode(blocks[i : i + step], out[i : i + step])
    return out.reshape(shape)


# --- public: quantize ---------------------------------------------------------------------------
def _as_blocks(x: npt.ArrayLike, block: int, what: str) -> tuple[np.ndarray, tuple[int, ...]]:
    arr = np.asarray(x, dtype=np.float32)
    if arr.ndim == 0 or arr.shape[-1] % block:
        raise ValueError(
            f"{what}: the last dimension must be a multiple of {block}, got shape {arr.shape}"
        )
    return np.ascontiguousarray(arr).reshape(-1, block), arr.shape


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: round half away from zero (numpy rounds half to even)."""
    a = np.abs(v)
    r = np.floor(a)
    r += (a - r) >= np.float32(0.5)  # a - floor(a) is exact
    return np.copysign(r, v)


def _inverse_or_zero(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """(nb, 1) float32 -> (nb, 2) bytes of fp16 (round to nearest even; inf and subnormals as
    in ggml)."""
    with np.errstate(over="ignore", under="ignore"):
        return v.astype("<f2").view(np.uint8)


def _quantize_blocks(
    x: npt.ArrayLike, what: str, type_size: int, encode: Callable[[np.ndarray, np.ndarray], None]
) -> npt.NDArray[np.uint8]:
    """Run ``encode(blocks (nb, 32) f32, out (nb, type_size) uint8)`` over x in chunks: x
    (..., k) -> (..., k // 32 * type_size) uint8."""
    blocks, shape = _as_blocks(x, 32, what)
    out = np.empty((len(blocks), type_size), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMS // 32)
    for i in range(0, len(blocks), step):
        encode(blocks[i : i + step], out[i : i + step])
    return out.reshape(*shape[:-1], shape[-1] // 32 * type_size)


def quantize_q8_0(x: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Quantize to Q8_0 exactly like ggml's reference ``quantize_row_q8_0_ref``.

    Per block of 32: ``d = max|x| / 127``, ``q = roundf(x / d)`` (half away from zero, via
    ``x * (1/d)`` in float32), ``d`` stored as fp16 (round to nearest even).

    Args:
        x: finite values, cast to float32, with ``shape[-1] % 32 == 0``.

    Returns:
        uint8 array of shape ``(..., shape[-1] // 32 * 34)``.

    Raises:
        ValueError: the last dimension is not a multiple of 32.
    """

    def encode(b: np.ndarray, out: np.ndarray) -> None:  # (nb, 32) -> (nb, 34)
        d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)  # (nb, 1)
        q = _round_half_away(b * _inverse_or_zero(d)).astype(np.int8)
        out[:, 0:2] = _f16_bytes(d)
        out[:, 2:] = q.view(np.uint8)

    return _quantize_blocks(x, "quantize_q8_0", 34, encode)


def quantize_q4_0(x: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Quantize to Q4_0 exactly like ggml's reference ``quantize_row_q4_0_ref``.

    Per block of 32: ``m`` = the first element of largest magnitude (sign kept), ``d = m / -8``,
    ``q = min(15, trunc(x * (1/d) + 8.5))``; byte ``j`` packs element ``j`` (low nibble) and
    ``j + 16`` (high nibble); ``d`` stored as fp16.

    Args:
        x: finite values, cast to float32, with ``shape[-1] % 32 == 0``.

    Returns:
        uint8 array of shape ``(..., shape[-1] // 32 * 18)``.

    Raises:
        ValueError: the last dimension is not a multiple of 32.
    """

    def encode(b: np.ndarray, out: np.ndarray) -> None:  # (nb, 32) -> (nb, 18)
        imax = np.abs(b).argmax(axis=1)[:, None]  # first maximum, like the C loop's strict <
        d = np.take_along_axis(b, imax, axis=1) / np.float32(-8)  # (nb, 1)
        q = np.trunc(b * _inverse_or_zero(d) + np.float32(8.5))
        q = np.clip(q, 0, 15).astype(np.uint8)  # (nb, 32)
        out[:, 0:2] = _f16_bytes(d)
        out[:, 2:] = q[:, :16] | (q[:, 16:] << np.uint8(4))

    return _quantize_blocks(x, "quantize_q4_0", 18, encode)


def _quantize_bf16(x: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    # ggml_compute_fp32_to_bf16: NaN -> quiet NaN, else round to nearest even on the top 16 bits
    arr = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = arr.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    bits = np.where(is_nan, (u >> np.uint32(16)) | np.uint32(64), rounded).astype("<u2")
    return np.ascontiguousarray(bits).view(np.uint8).reshape(*arr.shape[:-1], arr.shape[-1] * 2)


QUANTIZE_TYPES = frozenset(
    {
        GGMLType.F32,
        GGMLType.F16,
        GGMLType.BF16,
        GGMLType.Q8_0,
        GGMLType.Q4_0,
        GGMLType.Q4_1,
        GGMLType.MXFP4,
    }
)


def quantize_q4_1(x: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Quantize to Q4_1 exactly like ggml's reference ``quantize_row_q4_1_ref``.

    Per block of 32: ``d = (max - min) / 15``, ``q = min(15, trunc((x - min) * (1/d) + 0.5))``,
    ``d`` and ``m = min`` stored as fp16; nibbles packed as in Q4_0.

    Args:
        x: finite values, cast to float32, with ``shape[-1] % 32 == 0``.

    Returns:
        uint8 array of shape ``(..., shape[-1] // 32 * 20)``.

    Raises:
        ValueError: the last dimension is not a multiple of 32.
    """

    def encode(b: np.ndarray, out: np.ndarray) -> None:  # (nb, 32) -> (nb, 20)
        lo = b.min(axis=1, keepdims=True)  # (nb, 1)
        d = (b.max(axis=1, keepdims=True) - lo) / np.float32(15)
        q = np.trunc((b - lo) * _inverse_or_zero(d) + np.float32(0.5))
        q = np.minimum(q, 15).astype(np.uint8)  # (nb, 32)
        out[:, 0:2] = _f16_bytes(d)
        out[:, 2:4] = _f16_bytes(lo)
        out[:, 4:] = q[:, :16] | (q[:, 16:] << np.uint8(4))

    return _quantize_blocks(x, "quantize_q4_1", 20, encode)


def quantize_mxfp4(x: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Quantize to MXFP4 as ggml's reference quantizer does: per block of 32, the scale
    exponent ``e = floor(log2(max|x|)) - 2 + 127`` (0 for an all-zero block) and each value the
    nearest of ``MXFP4_VALUES · 2^(e - 128)`` (ties: the lower index).

    Returns:
        uint8 array of shape ``(..., shape[-1] // 32 * 17)``.
    """

    def encode(b: np.ndarray, out: np.ndarray) -> None:  # (nb, 32) -> (nb, 17)
        amax = np.abs(b).max(axis=1, keepdims=True)
        with np.errstate(divide="ignore"):
            e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
        err = np.abs(_e8m0_half(e)[:, :, None] * MXFP4_VALUES.astype(np.float32) - b[:, :, None])
        q = err.argmin(axis=2).astype(np.uint8)  # (nb, 32)
        out[:, :1] = e
        out[:, 1:] = q[:, :16] | (q[:, 16:] << np.uint8(4))

    return _quantize_blocks(x, "quantize_mxfp4", 17, encode)


def quantize(x: npt.ArrayLike, ggml_type: GGMLType | int) -> npt.NDArray[np.uint8]:
    """Encode float values as raw ggml bytes of ``ggml_type``.

    Args:
        x: values with at least one dimension (cast to float32 first).
        ggml_type: one of F32, F16, BF16, Q8_0, Q4_0, Q4_1, MXFP4.

    Returns:
        uint8 array of shape ``(..., row_bytes)``, ready for ``gguf_writer.write_gguf``.

    Raises:
        ValueError: unsupported type, or a row length that is not whole blocks.
    """
    gt = _check_type(ggml_type)
    if gt is GGMLType.Q8_0:
        return quantize_q8_0(x)
    if gt is GGMLType.Q4_0:
        return quantize_q4_0(x)
    if gt is GGMLType.Q4_1:
        return quantize_q4_1(x)
    if gt is GGMLType.MXFP4:
        return quantize_mxfp4(x)
    arr = np.asarray(x, dtype=np.float32)
    if arr.ndim == 0:
        raise ValueError("quantize: need at least one dimension")
    if gt is GGMLType.BF16:
        return _quantize_bf16(arr)
    if gt in (GGMLType.F32, GGMLType.F16):
        typed = np.ascontiguousarray(arr.astype(_PLAIN_DTYPES[gt]))
        return typed.view(np.uint8).reshape(*arr.shape[:-1], arr.shape[-1] * typed.itemsize)
    names = ", ".join(sorted(t.name for t in QUANTIZE_TYPES))
    raise ValueError(f"quantization to ggml type {gt.name} is not supported ({names} are)")
