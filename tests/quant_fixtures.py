"""Quantized test matrices for every type the kernels read, and the activation-rounding oracle.

``random_blocks`` fills ggml blocks with random bytes and finite f16 scales, so every bit
pattern of quants, packed scales and high bits occurs; ``gguf.quants.dequantize`` is the oracle
for their values. ``ref_quantize_act`` rounds activations as llama.cpp does before a quantized
matmul (Q8_0, Q8_1 or Q8_K blocks), in numpy, independently of the C code.
"""

from __future__ import annotations

import numpy as np

from powerpy.formats.constants import TYPE_TRAITS, GGMLType

# byte offsets of the fp16 scale fields in one block (docs/formats.md#quantized-blocks)
F16_FIELDS = {
    GGMLType.Q4_0: [0],
    GGMLType.Q4_1: [0, 2],
    GGMLType.Q5_0: [0],
    GGMLType.Q5_1: [0, 2],
    GGMLType.Q8_0: [0],
    GGMLType.Q2_K: [80, 82],
    GGMLType.Q3_K: [108],
    GGMLType.Q4_K: [0, 2],
    GGMLType.Q5_K: [0, 2],
    GGMLType.Q6_K: [208],
    GGMLType.MXFP4: [],  # an E8M0 scale byte (random_blocks keeps it moderate)
}
# ggml's vec_dot_type of each weight type
ACT_KIND = {
    GGMLType.Q8_0: "q8_0",
    GGMLType.Q4_0: "q8_0",
    GGMLType.Q5_0: "q8_0",
    GGMLType.Q4_1: "q8_1",
    GGMLType.Q5_1: "q8_1",
    GGMLType.Q4_K: "q8_k",
    GGMLType.Q5_K: "q8_k",
    GGMLType.Q6_K: "q8_k",
    GGMLType.MXFP4: "q8_0",
}


def random_blocks(rng: np.random.Generator, t: GGMLType, rows: int, blocks_per_row: int):
    """Random block bytes (rows, row_bytes) whose scales are finite (fp16 ones; MXFP4's
    moderate)."""
    size = TYPE_TRAITS[t].type_size
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, size), dtype=np.uint8)
    for at in F16_FIELDS[t]:
        scales = (rng.standard_normal(raw.shape[:2]) * 0.05).astype("<f2")
        raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, blocks_per_row, 2)
    if t is GGMLType.MXFP4:  # scales 2^-20 .. 2^8
        raw[..., 0] = rng.integers(108, 137, size=raw.shape[:2], dtype=np.uint8)
    return raw.reshape(rows, blocks_per_row * size)


def _f16(a) -> np.float32:
    return np.float32(np.float16(a))


def ref_quantize_act(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's rounding of x (cols,) -> (the values d * q as float64, per 32-chunk bias fix).

    The fix is, for Q8_1, ``s - d * sum(q)`` per chunk (ggml stores ``s = f16(d_f32 * sum)``
    and uses it for the weights' offset m); zero otherwise.
    """
    x = np.asarray(x, dtype=np.float32)
    out = np.zeros(x.size)
    fix = np.zeros(x.size // 32)
    if kind == "q8_k":
        for b in range(x.size // 256):
            xb = x[256 * b : 256 * b + 256]
            mx = xb[np.argmax(np.abs(xb))]
            if mx == 0:
                continue
            iscale = np.float32(-127.0) / mx
            q = np.minimum(127, np.rint(iscale * xb))
            out[256 * b : 256 * b + 256] = q * np.float64(np.float32(1.0) / iscale)
        return out, fix
    for c in range(x.size // 32):
        xb = x[32 * c : 32 * c + 32]
        amax = np.float32(np.abs(xb).max())
        d = amax / np.float32(127.0)
        q = np.rint(xb * (np.float32(127.0) / amax if amax else np.float32(0.0)))
        out[32 * c : 32 * c + 32] = q * np.float64(_f16(d))
        if kind == "q8_1":
            fix[c] = np.float64(_f16(d * np.float32(q.sum()))) - np.float64(_f16(d)) * q.sum()
    return out, fix


def block_offsets(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    """Q4_1/Q5_1: each 32-chunk's offset m (rows, cols / 32) as float64; zeros otherwise."""
    tr = TYPE_TRAITS[t]
    b = raw.reshape(raw.shape[0], -1, tr.type_size)
    if t not in (GGMLType.Q4_1, GGMLType.Q5_1):
        return np.zeros((raw.shape[0], b.shape[1] * tr.block_size // 32))
    return np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float64)


def ref_qdot(w: np.ndarray, raw: np.ndarray, t: GGMLType, x: np.ndarray) -> np.ndarray:
    """``W @ x`` with x rounded as llama.cpp does: w (rows, cols) exact values -> (rows,)."""
    xq, fix = ref_quantize_act(x, ACT_KIND[t])
    return w.astype(np.float64) @ xq + block_offsets(raw, t) @ fix
