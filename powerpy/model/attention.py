"""Attention: RoPE, the KV-cache attention, and the native decode block.

Two paths, chosen per call by its numerics (``powerpy.model.numerics``):

- **native** (host tensors, the default): llama.cpp's float steps in ``csrc``: ggml's RoPE
  angles and rounding, and the f16-cache attention in ggml's order (``ggml_numerics``); a
  one-token step runs its whole attention block (norm, q/k/v, RoPE, cache row, softmax, output,
  residual) as one call (:func:`attention_block`).
- **torch**: float64 RoPE angles, and torch's attention (two ``bmm`` for one token, SDPA for
  more), on whatever device the cache is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.config import ModelArgs
from powerpy.families import Rope
from powerpy.model import ggml_numerics, kernels
from powerpy.model.cache import KVCache
from powerpy.model.kernels import KernelLibrary, Matrix


def rope_tables(args: ModelArgs, positions: Tensor) -> Tensor:
    """Rotations ``exp(i·pos·θ_j)`` (n, n_rot/2) complex64 for positions (n,) int64 (one per
    token), ggml NORM mode (θ_j = base^(-2j/n_rot)): computed in float64, or as ggml computes
    them where the call keeps llama.cpp's numerics."""
    c = ggml_numerics.library()
    if c is not None:
        return ggml_numerics.rope_table(c, args, positions)
    inv = args.rope_base ** (-torch.arange(0, args.n_rot, 2, dtype=torch.float64) / args.n_rot)
    ang = positions.to(torch.float64)[:, None] * inv[None]
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64)


def apply_rope(x: Tensor, rot: Tensor, n_rot: int, mode: Rope = Rope.NORM) -> Tensor:
    """Rotate pairs of the first n_rot dims: x (T, heads, head_dim) f32, rot (T, n_rot/2) from
    ``rope_tables``. NORM mode pairs (2i, 2i+1), NEOX mode (i, i + n_rot/2); pair i turns by
    rotation i either way (ggml's angles)."""
    if mode is Rope.NEOX:
        half = n_rot // 2
        cos, sin = rot.real[:, None], rot.imag[:, None]  # (T, 1, n_rot/2)
        x1, x2 = x[..., :half], x[..., half:n_rot]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., n_rot:]), dim=-1)
    c = ggml_numerics.library(x)
    if c is not None:
        return ggml_numerics.rope(c, x, rot, n_rot)
    z = torch.view_as_complex(x[..., :n_rot].reshape(*x.shape[:-1], n_rot // 2, 2))
    out = torch.view_as_real(z * rot[:, None]).flatten(-2)  # (T, heads, n_rot)
    return torch.cat((out, x[..., n_rot:]), dim=-1) if n_rot < x.shape[-1] else out


def attend(a: ModelArgs, q: Tensor, cache: KVCache, l: int, p0: int) -> Tensor:
    """Causal attention of q (T, n_head, head_dim) at positions p0.. over layer l of the cache
    (filled up to p0 + T), on the cache's device -> (T, n_embd). An f16 host cache under
    llama.cpp's numerics runs ggml's order (``ggml_numerics.attention``), else torch's."""
    n = q.shape[0]
    c = ggml_numerics.library(q)
    if c is not None and cache.k.dtype is torch.float16:
        return ggml_numerics.attention(c, a, q, cache.k[l], cache.v[l], p0)
    keys = cache.k[l, : p0 + n].transpose(0, 1).float()  # (n_head_kv, S, head_dim)
    vals = cache.v[l, : p0 + n].transpose(0, 1).float()
    if n == 1:
        # one query: query head h reads key/value head h // group, as two bmm (torch's SDPA
        # with GQA costs ~10x more here)
        qg = q.reshape(a.n_head_kv, a.n_head // a.n_head_kv, a.head_dim)
        scores = torch.bmm(qg, keys.transpose(1, 2)) * a.head_dim**-0.5  # (n_kv, group, S)
        return torch.bmm(scores.softmax(-1), vals).view(1, a.n_embd)
    mask = keys.new_ones(n, p0 + n, dtype=torch.bool).tril(diagonal=p0)  # query i: keys ..p0+i
    # with a batch dimension torch picks its fused CPU kernel (3x the 3-D math path)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[None],
        vals[None],
        attn_mask=mask,
        enable_gqa=a.n_head != a.n_head_kv,
    )[0]  # (n_head, T, head_dim)
    return out.transpose(0, 1).reshape(n, a.n_embd)


def attention_kernels(blk) -> tuple[KernelLibrary, list[Matrix]] | None:
    """(library, [q, k, v, output] matrices) for the native attention block, or None when the
    block is not of the layout it computes (``Block.native``), or a matrix or the norm is not
    for the host kernels (or the call's numerics turn them off)."""
    if not blk.native:
        return None
    mats = [w.kernel() for w in (blk.attn_q, blk.attn_k, blk.attn_v, blk.attn_output)]
    if any(m is None for m in mats) or blk.attn_norm.device.type != "cpu":
        return None
    return mats[0][0], [m[1] for m in mats]


def attention_block(
    l: int, blk, x: Tensor, cache: KVCache, rot: Tensor, a: ModelArgs
) -> Tensor | None:
    """A one-token step's attention block on the host (attn_norm, q/k/v, RoPE, cache row, GQA
    softmax, output, residual) as one native call: x (1, n_embd) the residual stream, rot (1,
    n_rot/2) complex -> x + attention (1, n_embd); None when a matrix or the cache is not for
    the kernels."""
    kern = attention_kernels(blk)
    k, v = cache.k[l], cache.v[l]  # (n_ctx, n_kv, head_dim)
    host = k.device.type == "cpu" and x.device.type == "cpu"
    if kern is None or not host or k.dtype not in kernels.CACHE_CODES:
        return None
    rot = torch.view_as_real(rot[0])  # (n_rot / 2, 2): cos, sin
    shape = (a.n_head, a.n_head_kv, a.head_dim)
    norm = (blk.attn_norm, a.norm_eps)
    lib, mats = kern
    return lib.attn_decode(mats, x[0], norm, rot, shape, (k, v, cache.pos))[None]
