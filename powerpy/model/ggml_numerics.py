"""llama.cpp's float numerics on the CPU: RMSNorm, SwiGLU, RoPE and attention over an f16 KV
cache, computed step by step as ggml computes them (native kernels, ``csrc/numerics.cpp``).

They are on in calls whose numerics keep the native kernels and llama.cpp's activation rounding
(the default; ``powerpy.model.numerics``). Together with llama.cpp's activation
rounding they make a quantized model's logits equal llama.cpp's bit for bit, given llama.cpp's
f16 KV cache (the default cache type). ``--exact-activations`` turns them off: RoPE angles in
float64 and torch's attention, for research comparisons.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.config import ModelArgs
from powerpy.model import kernels, numerics


def library(x: Tensor | None = None) -> ctypes.CDLL | None:
    """The kernels when llama.cpp's numerics are on (and apply to ``x``, a CPU f32 tensor),
    else None."""
    if x is not None and (x.device.type != "cpu" or x.dtype is not torch.float32):
        return None
    if not numerics.current().quantized_activations:
        return None
    lib = kernels.library()
    return None if lib is None else lib.cdll


def layer_norm(c: ctypes.CDLL, x: Tensor, w: Tensor, b: Tensor | None, eps: float) -> Tensor:
    """x (..., n) f32 -> (x - mean) / sqrt(var + eps) · w + b in ggml's order (ggml_norm: the mean
    from a double sum, the variance from GW-lane squares, then mul, then add)."""
    x, w = x.contiguous(), w.float().contiguous()
    b = None if b is None else b.float().contiguous()
    y = torch.empty_like(x)
    c.pp_layer_norm(
        x.data_ptr(),
        w.data_ptr(),
        None if b is None else b.data_ptr(),
        x.numel() // x.shape[-1],
        x.shape[-1],
        eps,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y


def rms_norm(c: ctypes.CDLL, x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x (..., n) f32 -> x / sqrt(mean(x²) + eps) · w, the squares summed in double (ggml)."""
    x, w = x.contiguous(), w.float().contiguous()
    y = torch.empty_like(x)
    c.pp_rms_norm(
        x.data_ptr(),
        w.data_ptr(),
        x.numel() // x.shape[-1],
        x.shape[-1],
        eps,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y


def swiglu_(c: ctypes.CDLL, g: Tensor, u: Tensor) -> Tensor:
    """g = silu(g) · u in place (ggml's exp and order); g, u contiguous f32 of one shape."""
    u = u.contiguous()
    assert g.is_contiguous() and g.shape == u.shape and u.dtype is torch.float32
    c.pp_swiglu(g.data_ptr(), u.data_ptr(), g.numel(), g.data_ptr(), torch.get_num_threads())
    return g


def soft_max(c: ctypes.CDLL, x: Tensor) -> Tensor:
    """ggml's soft_max of each row of x (T, n) f32 (its exp, its sums): (T, n) f32."""
    x = x.contiguous()
    y = torch.empty_like(x)
    c.pp_soft_max(x.data_ptr(), x.shape[0], x.shape[1], y.data_ptr())
    return y


def silu_div(c: ctypes.CDLL, g: Tensor) -> Tensor:
    """silu(g) / g of each value (a sigmoid as llama.cpp's qwen2moe graph computes a shared
    expert's gate: ggml's one-value silu, libm's expf; 0.5 at 0): g f32 -> same shape."""
    g = g.contiguous()
    y = torch.empty_like(g)
    c.pp_silu_div(g.data_ptr(), g.numel(), y.data_ptr())
    return y


def gemm_f32(c: ctypes.CDLL, w: Tensor, x: Tensor) -> Tensor | None:
    """``x @ w.T`` for an f32 matrix w (rows, cols) and x (T, cols) in the order of llama.cpp's
    f32 matmuls (tinyBLAS for a batch where llama.cpp takes it, else ggml_vec_dot_f32): (T,
    rows) f32; None where w is not an f32 matrix of contiguous rows."""
    if w.dtype is not torch.float32 or w.stride(1) != 1 or x.shape[-1] != w.shape[1]:
        return None
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    st = c.pp_gemm_f32_gw(
        w.data_ptr(),
        w.stride(0),
        w.shape[0],
        w.shape[1],
        x.data_ptr(),
        x.shape[0],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return None if st else out


def rope_table(
    c: ctypes.CDLL,
    args: ModelArgs,
    positions: Tensor,
    base: float | None = None,
    *,
    scale: float = 1.0,
    factors: Tensor | None = None,
) -> Tensor:
    """ggml's RoPE rotations for positions (n,): (n, n_rot/2) complex64, the angles by ggml's
    f32 recurrence θ ← θ·base^(-2/n_rot) (base: ``args.rope_base`` unless given), each divided
    by its factor (``factors`` (n_rot/2,): llama-3's ``rope_freqs``, phi3's), times the f32
    frequency scale 1/``scale``, then cosf/sinf times ``args.rope_mscale``; under YaRN
    (``rope_ext_factor``) ggml's ramp and magnitude."""
    pos = positions.to(torch.int64).contiguous()
    out = torch.empty(pos.numel(), args.n_rot // 2, 2, dtype=torch.float32)
    base = args.rope_base if base is None else base
    freq_scale = float(np.float32(1.0) / np.float32(scale))  # llama.cpp: 1.0f / factor
    ff = None if factors is None else factors.to(torch.float32).contiguous()
    ff_ptr = None if ff is None else ff.data_ptr()
    if args.rope_ext_factor:  # YaRN: its ramp and magnitude (families.rope_scaling)
        c.pp_rope_table_yarn(
            pos.data_ptr(),
            pos.numel(),
            args.n_rot,
            base,
            freq_scale,
            ff_ptr,
            args.rope_mscale,
            args.rope_ext_factor,
            args.rope_orig_ctx or args.n_ctx_train,
            args.rope_yarn_beta_fast,
            args.rope_yarn_beta_slow,
            out.data_ptr(),
        )
    else:
        c.pp_rope_table_ext(
            pos.data_ptr(),
            pos.numel(),
            args.n_rot,
            base,
            freq_scale,
            ff_ptr,
            args.rope_mscale,
            out.data_ptr(),
        )
    return torch.view_as_complex(out)


def rope(c: ctypes.CDLL, x: Tensor, rot: Tensor, n_rot: int, neox: bool = False) -> Tensor:
    """x (T, heads, head_dim) f32 rotated by rot (T, n_rot/2) complex64, as ggml rounds it:
    adjacent pairs, or pairs (i, i + n_rot/2) with ``neox``."""
    x = x.contiguous().clone()
    r = torch.view_as_real(rot.contiguous())
    T, heads, hd = x.shape
    c.pp_rope(x.data_ptr(), T, heads, hd, n_rot, r.data_ptr(), int(neox))
    return x


def attention(
    c: ctypes.CDLL,
    args: ModelArgs,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    p0: int,
    window: int = 0,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention of T queries at positions p0.. as llama.cpp computes it without flash
    attention: q (T, n_head, head_dim) f32 after RoPE, k and v one layer's f16 cache (n_ctx,
    n_head_kv, head_dim) filled up to p0 + T -> (T, n_embd). q and the softmax weights are
    rounded to f16; one token and batches follow ggml's two summation orders. The model's
    ``attn_scale`` scales q before its rounding where the family's graph does
    (``Family.scale_q``), else the scores; its ``attn_softcap`` caps them; ``window`` > 0: a
    query at p sees keys at p - window + 1 .. p; ``sinks`` (n_head,) f32: each head's sink
    logit in its softmax (GPT-OSS)."""
    q = q.contiguous()
    T = q.shape[0]
    out = torch.empty(T, args.n_head * args.head_dim, dtype=torch.float32)
    sk = None if sinks is None else sinks.float().contiguous()
    st = c.pp_attn_ext(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        p0,
        T,
        args.n_head,
        args.n_head_kv,
        args.head_dim,
        args.attn_scale,
        int(args.family.scale_q),
        args.attn_softcap,
        window,
        None if sk is None else sk.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if st:
        raise ValueError(f"attention: invalid arguments (status {st})")
    return out


def attention_mla(c: ctypes.CDLL, q: Tensor, k: Tensor, p0: int, scale: float, hv: int) -> Tensor:
    """DeepSeek-2's latent attention as llama.cpp computes it (absorbed, without flash
    attention): q (T, n_head, hk) f32, k one layer's f16 latent cache (n_ctx, 1, hk) filled up
    to p0 + T, whose first hv dims are the values -> (T, n_head · hv); ``attention``'s orders
    and roundings with one key/value head."""
    q = q.contiguous()
    T, n_head, hk = q.shape
    out = torch.empty(T, n_head * hv, dtype=torch.float32)
    st = c.pp_attn_mla(
        q.data_ptr(),
        k.data_ptr(),
        p0,
        T,
        n_head,
        hk,
        hv,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if st:
        raise ValueError(f"attention_mla: invalid arguments (status {st})")
    return out


def gelu(x: Tensor) -> Tensor:
    """ggml's GELU of x (any shape) f32: each value rounded to f16 and looked up in ggml's table
    of f16 tanh-form results (llama.cpp's falcon FFN, gemma's GeGLU); x itself at or above 10, 0
    at or below -10. Native (``pp_gelu``, on the run's threads) where the kernels load; else the
    table's values come from torch's tanh form (they may differ in the last f16 bit near a
    rounding midpoint)."""
    c = library()
    if c is not None:
        x = x.float().contiguous()
        y = torch.empty_like(x)
        c.pp_gelu(x.data_ptr(), x.numel(), y.data_ptr(), 1, torch.get_num_threads())
        return y
    y = F.gelu(x.half().float(), approximate="tanh").half().float()
    y = torch.where(x >= 10.0, x, y)
    return torch.where(x <= -10.0, torch.zeros_like(x), y)


def softcap_(x: Tensor, cap: float) -> Tensor:
    """x ← cap·tanh(x / cap) in place (x f32, contiguous): under llama.cpp's numerics as ggml
    computes it (x·(1/cap) in f32, tanhf, ·cap), else in torch."""
    c = library(x)
    if c is not None and x.is_contiguous():
        c.pp_softcap(x.data_ptr(), x.numel(), cap)
        return x
    return x.div_(cap).tanh_().mul_(cap)
