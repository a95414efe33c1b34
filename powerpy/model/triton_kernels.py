"""The Triton kernels behind ``powerpy.model.gpu_kernels`` (which documents them).

Only kernels live here: ``gpu_kernels`` imports this module once as it is (compiled for the GPU)
and once more with Triton's interpreter switched on (for CPU tensors in tests).
"""

import triton
import triton.language as tl


@triton.jit
def _f16_at(p, m):
    # p: pointers to uint8; the little-endian f16 at each as f32 (0 where m is False)
    lo = tl.load(p, mask=m, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=m, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _block_values(w, r, b, row_bytes, m2, QT: tl.constexpr):
    """Values of blocks b (BB,) of rows r (BR,) where m2 (BR, BB): two (BR, BB, 16) f32
    halves, elements 0..15 and 16..31 of each 32-element block (a Q4 byte holds element j
    and j + 16); 0 outside m2, whose bytes are not read."""
    j = tl.arange(0, 16)
    m3 = m2[:, :, None] & (j[None, None, :] < 16)
    if QT == 0:  # F16: 32 halves per "block", read as halves (rows are 2-byte aligned)
        wh = w.to(tl.pointer_type(tl.float16))
        base = wh + r[:, None, None] * (row_bytes // 2) + b[None, :, None] * 32 + j[None, None, :]
        lo = tl.load(base, mask=m3, other=0.0).to(tl.float32)
        return lo, tl.load(base + 16, mask=m3, other=0.0).to(tl.float32)
    size = 34 if QT == 1 else 18 if QT == 2 else 20
    blk = w + r[:, None] * row_bytes + b[None, :] * size  # (BR, BB) block starts
    d = _f16_at(blk, m2)[:, :, None]  # (BR, BB, 1)
    if QT == 1:  # Q8_0: d, 32 int8
        q = blk[:, :, None] + 2 + j[None, None, :]
        lo = tl.load(q, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        hi = tl.load(q + 16, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return lo * d, hi * d
    qs = blk[:, :, None] + (2 if QT == 2 else 4) + j[None, None, :]
    byte = tl.load(qs, mask=m3, other=0)
    lo = (byte & 15).to(tl.float32)
    hi = (byte >> 4).to(tl.float32)
    if QT == 2:  # Q4_0: d * (q - 8)
        return tl.where(m3, (lo - 8.0) * d, 0.0), tl.where(m3, (hi - 8.0) * d, 0.0)
    m = _f16_at(blk + 2, m2)[:, :, None]  # Q4_1: d * q + m
    return tl.where(m3, lo * d + m, 0.0), tl.where(m3, hi * d + m, 0.0)


@triton.jit
def _linear_kernel(
    w, x, y, need, bucket, rows, nb, row_bytes, k, n_ff,
    QT: tl.constexpr, HAS_NEED: tl.constexpr, BR: tl.constexpr, BB: tl.constexpr,
):  # fmt: skip
    # y[t, r] = sum_c W[r, c] x[t, c]; grid (cdiv(rows, BR), T)
    t = tl.program_id(1)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < rows
    if HAS_NEED:
        neuron = tl.load(bucket + r % k, mask=rmask, other=0)
        rmask = rmask & (tl.load(need + t * n_ff + neuron, mask=rmask, other=0) != 0)
    acc = tl.zeros((BR,), tl.float32)
    j = tl.arange(0, 16)
    for b0 in range(0, nb, BB):
        b = b0 + tl.arange(0, BB)
        bm = b < nb
        lo, hi = _block_values(w, r, b, row_bytes, rmask[:, None] & bm[None, :], QT)
        xp = x + t * nb * 32 + b[:, None] * 32 + j[None, :]
        x_lo = tl.load(xp, mask=bm[:, None], other=0.0)  # (BB, 16)
        x_hi = tl.load(xp + 16, mask=bm[:, None], other=0.0)
        acc += tl.sum(tl.sum(lo * x_lo[None] + hi * x_hi[None], axis=2), axis=1)
    tl.store(y + t * rows + r, acc, mask=r < rows)


@triton.jit
def _rows_sum_kernel(
    w, h, part, rows, nb, row_bytes, chunk,
    QT: tl.constexpr, BR: tl.constexpr, BB: tl.constexpr,
):  # fmt: skip
    # part[s, t, c] = sum_{r in chunk s} h[t, r] W[r, c]; grid (cdiv(nb, BB), SPLIT, T)
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    s = tl.program_id(1)
    t = tl.program_id(2)
    T = tl.num_programs(2)
    bm = b < nb
    j = tl.arange(0, 16)
    acc_lo = tl.zeros((BB, 16), tl.float32)
    acc_hi = tl.zeros((BB, 16), tl.float32)
    for r0 in range(s * chunk, tl.minimum(s * chunk + chunk, rows), BR):
        r = r0 + tl.arange(0, BR)
        rm = r < tl.minimum(s * chunk + chunk, rows)
        hr = tl.load(h + t * rows + r, mask=rm, other=0.0)  # (BR,)
        m2 = (rm & (hr != 0.0))[:, None] & bm[None, :]  # rows with h == 0 are not read
        lo, hi = _block_values(w, r, b, row_bytes, m2, QT)
        acc_lo += tl.sum(lo * hr[:, None, None], axis=0)
        acc_hi += tl.sum(hi * hr[:, None, None], axis=0)
    out = part + (s * T + t) * nb * 32 + b[:, None] * 32 + j[None, :]
    tl.store(out, acc_lo, mask=bm[:, None])
    tl.store(out + 16, acc_hi, mask=bm[:, None])


@triton.jit
def _glu_kernel(gu, tau, h, k, n, HAS_TAU: tl.constexpr, VAR: tl.constexpr, B: tl.constexpr):
    # gu (T, 2k): g then u per token -> h (T, k); grid (cdiv(T * k, B),)
    i = tl.program_id(0) * B + tl.arange(0, B)
    m = i < n
    t, c = i // k, i % k
    g = tl.load(gu + t * 2 * k + c, mask=m, other=0.0)
    u = tl.load(gu + t * 2 * k + k + c, mask=m, other=0.0)
    if VAR == 0:
        a = g / (1.0 + tl.exp(-g)) * u
    elif VAR == 1:
        a = tl.maximum(g, 0.0) * u
    else:
        a = tl.maximum(g, 0.0) * tl.maximum(u, 0.0)
    if HAS_TAU:
        a = tl.where(tl.abs(a) < tl.load(tau + c, mask=m, other=0.0), 0.0, a)
    tl.store(h + i, a, mask=m)


@triton.jit
def _rms_norm_kernel(x, w, y, n, eps, B: tl.constexpr):
    # y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w; grid (T,)
    row = x + tl.program_id(0) * n
    out = y + tl.program_id(0) * n
    acc = tl.zeros((B,), tl.float32)
    for c0 in range(0, n, B):
        c = c0 + tl.arange(0, B)
        v = tl.load(row + c, mask=c < n, other=0.0)
        acc += v * v
    scale = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n + eps)
    for c0 in range(0, n, B):
        c = c0 + tl.arange(0, B)
        v = tl.load(row + c, mask=c < n, other=0.0)
        tl.store(out + c, v * scale * tl.load(w + c, mask=c < n, other=0.0), mask=c < n)
