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
def _e2m1(q):
    # MXFP4's 4-bit codes as their doubled E2M1 values: 0, 1, 2, 3, 4, 6, 8, 12, bit 3 the sign
    mag = (q & 7).to(tl.float32)
    v = tl.where(mag < 5.0, mag, tl.where(mag == 5.0, 6.0, tl.where(mag == 6.0, 8.0, 12.0)))
    return tl.where((q & 8) != 0, -v, v)


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
    if QT == 4:  # MXFP4: an E8M0 exponent e, 16 bytes of codes; scale 2^(e - 128) (ggml's)
        blk = w + r[:, None] * row_bytes + b[None, :] * 17
        e = tl.load(blk, mask=m2, other=0).to(tl.uint32)
        bits = tl.where(e < 2, (e + 1) * 2097152, (e - 1) * 8388608)  # subnormal below 2
        d = bits.to(tl.float32, bitcast=True)[:, :, None]
        byte = tl.load(blk[:, :, None] + 1 + j[None, None, :], mask=m3, other=0)
        return _e2m1(byte & 15) * d, _e2m1(byte >> 4) * d
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
    w,
    x,
    y,
    need,
    bucket,
    rows,
    T,
    nb,
    row_bytes,
    k,
    n_ff,
    QT: tl.constexpr,
    HAS_NEED: tl.constexpr,
    BR: tl.constexpr,
    BT: tl.constexpr,
    BB: tl.constexpr,
):
    # y[t, r] = sum_c W[r, c] x[t, c] for BT tokens x BR rows; grid (cdiv(rows, BR), cdiv(T, BT))
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    rmask = r < rows
    tmask = t < T
    if HAS_NEED:
        neuron = tl.load(bucket + r % k, mask=rmask, other=0)
        nd = (
            tl.load(
                need + t[:, None] * n_ff + neuron[None, :],
                mask=tmask[:, None] & rmask[None, :],
                other=0,
            )
            != 0
        )
        rneed = (tl.max(nd.to(tl.int32), axis=0) > 0) & rmask  # rows some token needs
    else:
        nd = tmask[:, None] & rmask[None, :]
        rneed = rmask
    # a block of rows no token needs is not read: its loop runs no step
    steps = tl.where(tl.max(rneed.to(tl.int32), axis=0) > 0, nb, 0)
    j = tl.arange(0, 16)
    acc = tl.zeros((BT, BR), tl.float32)
    for b0 in range(0, steps, BB):
        b = b0 + tl.arange(0, BB)
        bm = b < nb
        lo, hi = _block_values(w, r, b, row_bytes, rneed[:, None] & bm[None, :], QT)
        xp = x + t[:, None, None] * nb * 32 + b[None, :, None] * 32 + j[None, None, :]
        xm = tmask[:, None, None] & bm[None, :, None]
        x_lo = tl.load(xp, mask=xm, other=0.0)  # (BT, BB, 16)
        x_hi = tl.load(xp + 16, mask=xm, other=0.0)
        if BT == 1:
            part = tl.sum(tl.sum(lo * x_lo + hi * x_hi, axis=2), axis=1)  # (BR,)
            acc += part[None, :]
        else:
            wt = tl.reshape(tl.join(lo, hi), (BR, BB * 32))  # (BR, K): block, element, half
            xt = tl.reshape(tl.join(x_lo, x_hi), (BT, BB * 32))
            acc += tl.dot(xt, tl.trans(wt), input_precision="ieee")
    tl.store(
        y + t[:, None] * rows + r[None, :],
        tl.where(nd, acc, 0.0),
        mask=tmask[:, None] & rmask[None, :],
    )


@triton.jit
def _block_rows_sum_kernel(
    w,
    h,
    part,
    rows,
    T,
    nb,
    row_bytes,
    chunk,
    QT: tl.constexpr,
    BR: tl.constexpr,
    BB: tl.constexpr,
    BT: tl.constexpr,
):
    # part[s, t, c] = sum_{r in chunk s} h[t, r] W[r, c]; grid (cdiv(nb, BB), SPLIT, cdiv(T, BT))
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    s = tl.program_id(1)
    t = tl.program_id(2) * BT + tl.arange(0, BT)
    tm = t < T
    bm = b < nb
    j = tl.arange(0, 16)
    acc = tl.zeros((BT, BB * 32), tl.float32)
    end = tl.minimum(s * chunk + chunk, rows)
    for r0 in range(s * chunk, end, BR):
        r = r0 + tl.arange(0, BR)
        rm = r < end
        hr = tl.load(h + t[:, None] * rows + r[None, :], mask=tm[:, None] & rm[None, :], other=0.0)
        rneed = (tl.max((hr != 0.0).to(tl.int32), axis=0) > 0) & rm  # rows whose h are all 0
        lo, hi = _block_values(w, r, b, row_bytes, rneed[:, None] & bm[None, :], QT)  # are not read
        wt = tl.reshape(tl.join(lo, hi), (BR, BB * 32))  # (BR, BB * 32): block, element, half
        if BT == 1:
            acc += tl.sum(wt * tl.reshape(hr, (BR, 1)), axis=0)[None, :]
        else:
            acc += tl.dot(hr, wt, input_precision="ieee")
    # the columns in acc's order (tl.join puts the halves last): block b, element j, half
    lo_col = b[:, None] * 32 + j[None, :]  # (BB, 16)
    col = tl.reshape(tl.join(lo_col, lo_col + 16), (BB * 32,))
    bm2 = bm[:, None] & (j[None, :] < 16)
    cm = tl.reshape(tl.join(bm2, bm2), (BB * 32,))
    out = part + (s * T + t[:, None]) * nb * 32 + col[None, :]
    tl.store(out, acc, mask=tm[:, None] & cm[None, :])


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


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _decode_attn_kernel(
    q,
    k,
    v,
    base,
    pos,
    part_o,
    part_ml,
    n_head,
    n_kv,
    hd,
    row_stride,
    chunk,
    splits,
    scale,
    softcap,
    window,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_WIN: tl.constexpr,
):
    # one (session b, kv head, chunk of positions): the chunk's softmax state for the group's q
    # heads; grid (B, n_kv, splits)
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    group = n_head // n_kv
    p = tl.load(pos + b)
    b0 = tl.load(base + b)
    lo = sp * chunk
    if HAS_WIN:
        lo = tl.maximum(lo, p - window + 1)
    hi = tl.minimum(sp * chunk + chunk, p + 1)
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    gm = g < group
    dm = d < hd
    heads = kh * group + g
    qv = tl.load(
        q + (b * n_head + heads)[:, None] * hd + d[None, :],
        mask=gm[:, None] & dm[None, :],
        other=0.0,
    )
    m_i = tl.full((G,), float("-inf"), tl.float32)
    l_i = tl.zeros((G,), tl.float32)
    acc = tl.zeros((G, D), tl.float32)
    for s0 in range(lo, hi, BS):
        s = s0 + tl.arange(0, BS)
        sm = s < hi
        off = (b0 + s)[:, None] * row_stride + kh * hd + d[None, :]
        kt = tl.load(k + off, mask=sm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        sc = tl.sum(qv[:, None, :] * kt[None, :, :], axis=2) * scale  # (G, BS)
        if HAS_CAP:
            sc = softcap * _tanh(sc / softcap)
        sc = tl.where(sm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        vt = tl.load(v + off, mask=sm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(pr[:, :, None] * vt[None, :, :], axis=1)
        m_i = m_new
    at = (b * n_head + heads) * splits + sp  # (G,)
    tl.store(part_o + at[:, None] * hd + d[None, :], acc, mask=gm[:, None] & dm[None, :])
    tl.store(part_ml + at * 2, m_i, mask=gm)
    tl.store(part_ml + at * 2 + 1, l_i, mask=gm)


@triton.jit
def _attn_merge_kernel(part_o, part_ml, out, hd, splits, D: tl.constexpr, NS: tl.constexpr):
    # out[b, h] = the chunks' weighted values over their weights; grid (B, n_head)
    at = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * splits
    sp = tl.arange(0, NS)
    spm = sp < splits
    m = tl.load(part_ml + (at + sp) * 2, mask=spm, other=float("-inf"))
    l = tl.load(part_ml + (at + sp) * 2 + 1, mask=spm, other=0.0)  # noqa: E741
    wgt = tl.exp(m - tl.max(m, axis=0))  # chunks past the position: exp(-inf) = 0
    d = tl.arange(0, D)
    o = tl.load(
        part_o + (at + sp)[:, None] * hd + d[None, :],
        mask=spm[:, None] & (d < hd)[None, :],
        other=0.0,
    )
    res = tl.sum(o * wgt[:, None], axis=0) / tl.sum(l * wgt, axis=0)
    tl.store(out + (at // splits) * hd + d, res, mask=d < hd)


@triton.jit
def _rope_kv_kernel(
    q,
    k,
    v,
    sq,
    sk,
    sv,
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
    kc_row,
    NEOX: tl.constexpr,
    D: tl.constexpr,
):
    # one head of session b: q's turned into out, or k's turned and v into the pool's row;
    # grid (B, n_head + n_kv)
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.load(pos + b)
    d = tl.arange(0, D)
    dm = d < hd
    half = n_rot // 2
    if NEOX:  # pairs (i, i + n_rot/2)
        i = tl.where(d < half, d, d - half)
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
    else:  # pairs (2i, 2i + 1)
        i = d // 2
        partner = d ^ 1
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    rot = d < n_rot
    c = tl.load(table + (p * half + i) * 2, mask=rot, other=1.0)
    s = tl.load(table + (p * half + i) * 2 + 1, mask=rot, other=0.0)
    if h < n_head:
        src = q + b * sq + h * hd
        x = tl.load(src + d, mask=dm, other=0.0)
        xp = tl.load(src + partner, mask=rot & dm, other=0.0)
        tl.store(out + (b * n_head + h) * hd + d, tl.where(rot, x * c + sign * xp * s, x), mask=dm)
    else:
        j = h - n_head
        r = tl.load(rows + b)
        src = k + b * sk + j * hd
        x = tl.load(src + d, mask=dm, other=0.0)
        xp = tl.load(src + partner, mask=rot & dm, other=0.0)
        y = tl.where(rot, x * c + sign * xp * s, x)
        tl.store(kc + r * kc_row + j * hd + d, y.to(kc.dtype.element_ty), mask=dm)
        vv = tl.load(v + b * sv + j * hd + d, mask=dm, other=0.0)
        tl.store(vc + r * kc_row + j * hd + d, vv.to(vc.dtype.element_ty), mask=dm)
