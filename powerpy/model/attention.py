"""Attention: RoPE, the KV-cache attention, and the native decode block.

Two paths, chosen per call by its numerics (``powerpy.model.numerics``):

- **native** (host tensors, the default): llama.cpp's float steps in ``csrc``: ggml's RoPE
  angles and rounding (adjacent or NEOX pairs), and the f16-cache attention in ggml's order with
  the model's scale, soft-cap and window (``ggml_numerics``); a one-token step runs its whole
  attention block (norm, q/k/v and biases, q/k norms, RoPE, cache row, softmax, output, post
  norm, residual) as one call in any family's layout (:func:`attention_block`).
- **torch**: float64 RoPE angles, and torch's attention (two ``bmm`` for one token, SDPA for
  more), on whatever device the cache is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.config import ModelArgs
from powerpy.families import Rope
from powerpy.model import ggml_numerics, gpu_kernels, kernels, layer_record, rope_yarn
from powerpy.model.cache import KVCache
from powerpy.model.device import HOST, OnDevices


def rope_tables(
    args: ModelArgs,
    positions: Tensor,
    *,
    base: float | None = None,
    scale: float = 1.0,
    factors: Tensor | None = None,
) -> Tensor:
    """Rotations ``a·exp(i·θ_j·pos/scale)`` (n, n_rot/2) complex64 for positions (n,) int64
    (one per token): θ_j = base^(-2j/n_rot) / factors[j] (``base`` defaults to the model's;
    ``factors`` (n_rot/2,) are llama-3's ``rope_freqs`` or phi3's), a the model's
    ``rope_attn_factor``. Computed as ggml computes them where the call keeps llama.cpp's
    numerics, else in float64."""
    base = args.rope_base if base is None else base
    c = ggml_numerics.library()
    if c is not None:
        return ggml_numerics.rope_table(c, args, positions, base, scale=scale, factors=factors)
    if args.rope_ext_factor:
        return rope_yarn.tables(args, positions, base, scale, factors)
    inv = base ** (-torch.arange(0, args.n_rot, 2, dtype=torch.float64) / args.n_rot)
    if factors is not None:
        inv = inv / factors.to(torch.float64)
    ang = (positions.to(torch.float64) / scale)[:, None] * inv[None]
    mag = torch.full_like(ang, args.rope_attn_factor)
    return torch.polar(mag, ang).to(torch.complex64)


def layer_rotations(args: ModelArgs, weights, pos: Tensor, n_ctx: int) -> list[Tensor | None]:
    """Each layer's RoPE rotations for positions ``pos`` (T,) of a session of ``n_ctx``
    positions (``rope_tables``): one table, or two where the windowed layers turn by their own
    base and scale (gemma3); None for learned positions. ``weights`` holds the RoPE factors:
    llama-3's ``rope_freqs``, or phi3's long ones where the session is longer than the original
    context (the training context without the key, as llama.cpp has it), else short."""
    if args.family.rope is Rope.LEARNED:
        return [None] * args.n_layer
    factors = weights.rope_freqs
    if factors is None and weights.rope_factors_short is not None:
        long = n_ctx > (args.rope_orig_ctx or args.n_ctx_train)
        factors = weights.rope_factors_long if long else weights.rope_factors_short
    full = rope_tables(args, pos, scale=args.rope_scale, factors=factors)
    if not args.swa_layers or not (args.rope_base_swa or args.rope_scale_swa):
        return [full] * args.n_layer
    base = args.rope_base_swa or args.rope_base
    scale = args.rope_scale_swa or args.rope_scale
    local = rope_tables(args, pos, base=base, scale=scale, factors=factors)
    swa = set(args.swa_layers)
    return [local if l in swa else full for l in range(args.n_layer)]


def apply_rope(x: Tensor, rot: Tensor, n_rot: int, mode: Rope = Rope.NORM) -> Tensor:
    """Rotate pairs of the first n_rot dims: x (T, heads, head_dim) f32, rot (T, n_rot/2) from
    ``rope_tables``. NORM mode pairs (2i, 2i+1), NEOX mode (i, i + n_rot/2); pair i turns by
    rotation i either way (ggml's angles). Under llama.cpp's numerics both modes run ggml's
    rounding (its fused multiply-adds, ``pp_rope``)."""
    c = ggml_numerics.library(x)
    if c is not None:
        return ggml_numerics.rope(c, x, rot, n_rot, neox=mode is Rope.NEOX)
    if mode is Rope.NEOX:
        half = n_rot // 2
        x1, x2 = x[..., :half], x[..., half:n_rot]
        cos, sin = rot.real[:, None], rot.imag[:, None]  # (T, 1, n_rot/2)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., n_rot:]), dim=-1)
    z = torch.view_as_complex(x[..., :n_rot].reshape(*x.shape[:-1], n_rot // 2, 2))
    out = torch.view_as_real(z * rot[:, None]).flatten(-2)  # (T, heads, n_rot)
    return torch.cat((out, x[..., n_rot:]), dim=-1) if n_rot < x.shape[-1] else out


def attend(
    a: ModelArgs, q: Tensor, cache: KVCache, l: int, p0: int, *, window: int = 0, sinks=None
) -> Tensor:
    """Causal attention of q (T, n_head, head_dim) at positions p0.. over layer l of the cache
    (filled up to p0 + T), on the cache's device -> (T, n_head·head_dim). ``window`` > 0: a
    query at p sees keys at p - window + 1 .. p only; ``sinks`` (n_head,): each head's sink
    logit, in the softmax without a value (GPT-OSS). The model's ``attn_scale`` and
    ``attn_softcap`` apply. An f16 host cache under llama.cpp's numerics runs ggml's order
    (``ggml_numerics.attention``), else torch's."""
    n = q.shape[0]
    plain = not window and not a.attn_softcap and not a.attn_scale and sinks is None
    c = ggml_numerics.library(q)
    if c is not None and cache.k.dtype is torch.float16 and cache.k.device.type == "cpu":
        return ggml_numerics.attention(c, a, q, cache.k[l], cache.v[l], p0, window, sinks)
    s0 = max(0, p0 - window + 1) if window else 0  # no query reads a key before s0
    keys = cache.k[l, s0 : p0 + n].transpose(0, 1).float()  # (n_head_kv, S, head_dim)
    vals = cache.v[l, s0 : p0 + n].transpose(0, 1).float()
    if not plain:
        return _attend_explicit(a, q, keys, vals, p0 - s0, window, sinks)
    if n == 1:
        # one query: query head h reads key/value head h // group, as two bmm (torch's SDPA
        # with GQA costs ~10x more here)
        qg = q.reshape(a.n_head_kv, a.n_head // a.n_head_kv, a.head_dim)
        scores = torch.bmm(qg, keys.transpose(1, 2)) * a.head_dim**-0.5  # (n_kv, group, S)
        return torch.bmm(scores.softmax(-1), vals).view(1, a.n_embd_q)
    mask = keys.new_ones(n, p0 + n, dtype=torch.bool).tril(diagonal=p0)  # query i: keys ..p0+i
    # with a batch dimension torch picks its fused CPU kernel (3x the 3-D math path)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[None],
        vals[None],
        attn_mask=mask,
        enable_gqa=a.n_head != a.n_head_kv,
    )[0]  # (n_head, T, head_dim)
    return out.transpose(0, 1).reshape(n, a.n_embd_q)


def attend_pool(
    a: ModelArgs,
    q: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    pool: tuple[Tensor, Tensor],
    l: int,
    pos: Tensor,
    base: Tensor,
    *,
    window: int = 0,
) -> Tensor:
    """One decode step of B sessions whose caches are ranges of one device pool (``cache.py``):
    q (B, n_head, head_dim) and k, v (B, n_kv, head_dim) of each session's new token at
    positions ``pos`` (B,) int64 of caches starting at pool rows ``base`` (B,) -> attention
    (B, n_head·head_dim). Writes k and v at rows ``base + pos`` of layer ``l``. Every shape is
    fixed and every position is data, so a CUDA graph can replay the step: the attention reads
    each session's rows up to its position (the fused kernel on CUDA, else every row of the
    pool's width, masked)."""
    kl, vl = pool[0][l], pool[1][l]  # (rows, n_kv, head_dim)
    if k is not None:  # (None: written already, with RoPE, by gpu_kernels.rope_kv_op)
        rows = base + pos  # (B,)
        kl.index_copy_(0, rows, k.to(kl.dtype))
        vl.index_copy_(0, rows, v.to(vl.dtype))
    return gpu_kernels.decode_attention(
        q,
        kl,
        vl,
        base,
        pos,
        scale=a.attn_scale or a.head_dim**-0.5,
        softcap=a.attn_softcap,
        window=window,
        span=kl.shape[0] - 1,
    )


def _attend_explicit(
    a: ModelArgs, q: Tensor, keys: Tensor, vals: Tensor, p0: int, window: int, sinks=None
) -> Tensor:
    """Attention with the scores in hand (a window, a soft-cap, another scale or sinks): q
    (T, n_head, hd) at key positions p0.., keys/vals (n_kv, S, hd) -> (T, n_head·hd)."""
    n, group = q.shape[0], a.n_head // a.n_head_kv
    scale = a.attn_scale or a.head_dim**-0.5
    qg = q.transpose(0, 1).reshape(a.n_head_kv, group * n, a.head_dim)  # heads of a kv group
    scores = torch.bmm(qg, keys.transpose(1, 2)).mul_(scale)  # (n_kv, group·T, S)
    if a.attn_softcap:
        scores = scores.div_(a.attn_softcap).tanh_().mul_(a.attn_softcap)
    ones = keys.new_ones(n, keys.shape[1], dtype=torch.bool)  # (T, S), no host factory call
    hidden = ones.triu(diagonal=p0 + 1)  # query i sees keys .. p0 + i
    if window:  # … and after p0 + i - window
        hidden = hidden.logical_or(ones.tril(diagonal=p0 - window))
    scores = scores.view(a.n_head_kv, group, n, -1).masked_fill_(hidden, -torch.inf)
    if sinks is not None:  # one more logit per head, without a value
        sink = sinks.view(a.n_head_kv, group, 1, 1).expand(-1, -1, n, 1)  # f32, beside q
        scores = torch.cat([scores, sink], dim=-1)
        vals = torch.cat([vals, vals.new_zeros(vals.shape[0], 1, vals.shape[2])], dim=1)
    out = torch.matmul(scores.softmax(-1), vals[:, None])  # (n_kv, group, T, hd)
    return out.reshape(a.n_head, n, a.head_dim).transpose(0, 1).reshape(n, a.n_embd_q)


def attention_block(
    l: int, blk, x: Tensor, cache: KVCache, rot: OnDevices | None, a: ModelArgs
) -> Tensor | None:
    """A one-token step's attention block on the host as one native call, in the family's
    layout (``layer_record``: norm, q/k/v with their biases, q/k norms, RoPE, cache row, the
    window, scale and soft-cap, GQA softmax, output and its bias, post norm, residual): x (1,
    n_embd) the residual stream, rot the step's (1, n_rot/2) complex rotations (None: learned
    positions) -> x + attention (1, n_embd), or the attention alone in a parallel block (its
    FFN block adds both to x); None when a matrix or the cache is not for the kernels."""
    k, v = cache.k[l], cache.v[l]  # (n_ctx, n_kv, head_dim)
    host = k.device.type == "cpu" and x.device.type == "cpu"
    if not host or k.dtype not in kernels.CACHE_CODES or not blk.native:
        return None
    part = layer_record.attention_part(blk, a, l)
    if part is None:
        return None
    rec, r = layer_record.record(part), layer_record.rotation(None if rot is None else rot(HOST))
    return part.lib.attn_decode(rec, layer_record.heads(a), x[0], r, (k, v, cache.pos))[None]
