"""LLaMA-family transformer over GGUF-named weights: RMSNorm, ggml RoPE, GQA attention, KV cache.

The model never opens files: ``loader.load`` hands it weights. Args, weights and per-step state
(``KVCache``) are separate objects. The FFN of each block is delegated to an ``FFNRunner`` so the
hybrid runtime can replace the CPU-only one without touching the attention code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.config import ModelArgs
from powerpy.sparse_ffn import ffn_dense, ffn_masked, ffn_rows, glu, predict, rows_sum
from powerpy.timing import PhaseTimer, phase
from powerpy.weights import Weight

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- weights
@dataclass
class Block:
    attn_norm: Tensor  # (n_embd,) f32
    attn_q: Weight  # (n_embd, n_embd)
    attn_k: Weight  # (n_embd_gqa, n_embd)
    attn_v: Weight  # (n_embd_gqa, n_embd)
    attn_output: Weight  # (n_embd, n_embd)
    ffn_norm: Tensor  # (n_embd,) f32
    ffn_gate: Weight  # (n_ff, n_embd)
    ffn_up: Weight  # (n_ff, n_embd)
    ffn_down_t: Weight  # (n_ff, n_embd): row j is neuron j's output
    fc1: Weight | None = None  # (H, n_embd) predictor
    fc2: Weight | None = None  # (n_ff, H)


@dataclass
class Weights:
    token_embd: Weight  # (n_vocab, n_embd)
    output_norm: Tensor  # (n_embd,)
    output: Weight  # (n_vocab, n_embd); token_embd itself when tied
    blk: list[Block]


# ----------------------------------------------------------------------------------- state
class KVCache:
    """Per-layer keys and values for ``n_ctx`` positions."""

    def __init__(
        self,
        args: ModelArgs,
        n_ctx: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        shape = (args.n_layer, n_ctx, args.n_head_kv, args.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_ctx = n_ctx
        self.pos = 0  # number of positions filled

    def reset(self) -> None:
        self.pos = 0


@dataclass
class SparsityStats:
    """Predicted-active neuron counts per layer, accumulated over the tokens run."""

    n_ff: int
    active: np.ndarray  # (n_layer,) int64: sum of active neurons over tokens
    tokens: np.ndarray  # (n_layer,) int64: tokens gated by the predictor
    last: np.ndarray = field(init=False)  # (n_layer,) active fraction of the last token

    def __post_init__(self) -> None:
        self.last = np.zeros(len(self.active))

    @classmethod
    def empty(cls, n_layer: int, n_ff: int) -> SparsityStats:
        return cls(n_ff, np.zeros(n_layer, np.int64), np.zeros(n_layer, np.int64))

    def record(self, layer: int, act: Tensor) -> None:
        counts = act.sum(dim=1)  # (T,)
        self.active[layer] += int(counts.sum())
        self.tokens[layer] += act.shape[0]
        self.last[layer] = float(counts[-1]) / self.n_ff

    def active_fraction(self) -> np.ndarray:
        """Mean predicted-active fraction per layer (NaN where no token was gated)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.active / (self.tokens * self.n_ff)

    def reset(self) -> None:
        self.active[:] = 0
        self.tokens[:] = 0
        self.last[:] = 0


# FFN observer: (layer, ffn_inp (T, n_embd) pre-norm, h (T, n_ff) true activation) -> None
Observer = Callable[[int, Tensor, Tensor], None]


class FFNRunner(Protocol):
    def __call__(self, layer: int, blk: Block, x: Tensor, ffn_inp: Tensor) -> Tensor: ...


# ----------------------------------------------------------------------------------- maths
_HAS_RMS_NORM = hasattr(F, "rms_norm")


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    if _HAS_RMS_NORM and x.dtype == w.dtype:
        return F.rms_norm(x, w.shape, w, eps)  # one fused op (torch >= 2.4)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(args: ModelArgs, pos0: int, n: int) -> Tensor:
    """Rotations ``exp(i·pos·θ_j)`` (n, n_rot/2) complex64 for positions pos0..pos0+n-1, ggml
    NORM mode (θ_j = base^(-2j/n_rot)), computed in float64."""
    inv = args.rope_base ** (-torch.arange(0, args.n_rot, 2, dtype=torch.float64) / args.n_rot)
    ang = torch.arange(pos0, pos0 + n, dtype=torch.float64)[:, None] * inv[None]
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64)


def apply_rope(x: Tensor, rot: Tensor, n_rot: int) -> Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of the first n_rot dims: x (T, heads, head_dim) f32, rot
    (T, n_rot/2) from ``rope_tables``. Each pair is one complex number times its rotation."""
    z = torch.view_as_complex(x[..., :n_rot].reshape(*x.shape[:-1], n_rot // 2, 2))
    out = torch.view_as_real(z * rot[:, None]).flatten(-2)  # (T, heads, n_rot)
    return torch.cat((out, x[..., n_rot:]), dim=-1) if n_rot < x.shape[-1] else out


# ----------------------------------------------------------------------------------- model
class Model:
    """A LLaMA-family decoder. Call ``forward(tokens, cache)`` to get logits."""

    def __init__(self, args: ModelArgs, weights: Weights, threshold: float | None = None):
        self.args = args
        self.weights = weights
        self.threshold = args.sparse_threshold if threshold is None else float(threshold)
        # Predictor-gated FFN where the file has predictors; False runs the dense reference.
        self.sparse_enabled = args.sparse and all(b.fc1 is not None for b in weights.blk)
        self.sparsity = SparsityStats.empty(args.n_layer, args.n_ff)
        self.observer: Observer | None = None
        self.ffn_runner: FFNRunner = self.cpu_ffn
        self.timer: PhaseTimer | None = None  # set by benchmarks for a per-phase breakdown
        # Where new caches live: runtime.build_hybrid sets these when the placement puts the KV
        # cache on the accelerator (caches longer than kv_max_ctx stay on the host).
        self.kv_device: torch.device | None = None
        self.kv_dtype = torch.float32
        self.kv_max_ctx = 0

    def new_cache(self, n_ctx: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """A fresh KV cache for up to ``n_ctx`` positions (default: training context, ≤ 4096)."""
        n_ctx = n_ctx or min(self.args.n_ctx_train, 4096)
        if self.kv_device is not None and n_ctx <= self.kv_max_ctx:
            return KVCache(self.args, n_ctx, dtype or self.kv_dtype, self.kv_device)
        if self.kv_device is not None:
            log.warning(
                "a %d-position KV cache exceeds the %d placed on %s: it stays on the host",
                n_ctx,
                self.kv_max_ctx,
                self.kv_device,
            )
        return KVCache(self.args, n_ctx, dtype or torch.float32)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: KVCache, *, all_logits: bool = False) -> Tensor:
        """Run tokens (T,) int64 at positions cache.pos..; return logits (T or 1, n_vocab) f32."""
        a, w = self.args, self.weights
        n = tokens.shape[0]
        if cache.pos + n > cache.n_ctx:
            raise ValueError(
                f"context is full: {cache.pos} + {n} tokens exceed n_ctx {cache.n_ctx} "
                "(use a larger context: -c, n_ctx)"
            )
        x = w.token_embd.take_rows(tokens).dequantize()  # (T, n_embd), on the host
        rot = rope_tables(a, cache.pos, n)
        for l, blk in enumerate(w.blk):
            # Hybrid placements: each step runs where its weights are and the residual stream
            # follows (every .to is a no-op when the tensor is already there, e.g. CPU-only).
            x = x.to(blk.attn_norm.device)
            rot = rot.to(blk.attn_q.device)
            with phase(self.timer, "attention"):
                att = self.attention(l, blk, rms_norm(x, blk.attn_norm, a.rms_eps), cache, rot)
                ffn_inp = x + att.to(x.device)
            with phase(self.timer, "ffn"):
                xn = rms_norm(ffn_inp.to(blk.ffn_norm.device), blk.ffn_norm, a.rms_eps)
                x = ffn_inp + self.ffn_runner(l, blk, xn, ffn_inp)  # runner: on ffn_inp's device
        cache.pos += n
        if not all_logits:
            x = x[-1:]
        with phase(self.timer, "output"):
            x = rms_norm(x.to(w.output_norm.device), w.output_norm, a.rms_eps)
            return w.output.linear(x.to(w.output.device)).cpu()  # logits on the host

    def attention(self, l: int, blk: Block, x: Tensor, cache: KVCache, rot: Tensor) -> Tensor:
        a = self.args
        n, p0 = x.shape[0], cache.pos
        q = blk.attn_q.linear(x.to(blk.attn_q.device)).view(n, a.n_head, a.head_dim)
        k = blk.attn_k.linear(x.to(blk.attn_k.device)).view(n, a.n_head_kv, a.head_dim)
        v = blk.attn_v.linear(x.to(blk.attn_v.device)).view(n, a.n_head_kv, a.head_dim)
        q = apply_rope(q, rot.to(q.device), a.n_rot)
        k = apply_rope(k, rot.to(k.device), a.n_rot)
        cache.k[l, p0 : p0 + n].copy_(k)  # copy_: the cache may live on another device
        cache.v[l, p0 : p0 + n].copy_(v)
        keys = cache.k[l, : p0 + n].transpose(0, 1).float()  # (n_head_kv, S, head_dim)
        vals = cache.v[l, : p0 + n].transpose(0, 1).float()
        if n == 1:  # decode: query head h reads key/value head h // group, as two bmm
            group = a.n_head // a.n_head_kv
            qg = q.to(keys.device).view(a.n_head_kv, group, a.head_dim)
            scores = torch.bmm(qg, keys.transpose(1, 2)) * a.head_dim**-0.5  # (n_kv, group, S)
            out = torch.bmm(scores.softmax(-1), vals).view(1, a.n_embd)  # head-major order
        else:  # query i sees keys 0..p0+i
            mask = torch.ones(n, p0 + n, dtype=torch.bool, device=keys.device).tril(diagonal=p0)
            out = F.scaled_dot_product_attention(
                q.to(keys.device).transpose(0, 1),
                keys,
                vals,
                attn_mask=mask,
                enable_gqa=a.n_head != a.n_head_kv,
            )  # (n_head, T, head_dim), where the cache is
            out = out.transpose(0, 1).reshape(n, a.n_embd)
        return blk.attn_output.linear(out.to(blk.attn_output.device))

    def cpu_ffn(self, l: int, blk: Block, x: Tensor, ffn_inp: Tensor) -> Tensor:
        """FFN on the CPU: x (T, n_embd) normed input, ffn_inp its pre-norm value (T, n_embd)."""
        variant = self.args.ffn_variant
        act = None
        if self.sparse_enabled and blk.fc1 is not None:
            with phase(self.timer, "predictor"):
                act = predict(ffn_inp, blk.fc1, blk.fc2) >= self.threshold  # (T, n_ff)
            self.sparsity.record(l, act)
        if self.observer is not None:
            h = glu(blk.ffn_gate.linear(x), blk.ffn_up.linear(x), variant)  # (T, n_ff)
            self.observer(l, ffn_inp, h)
            return rows_sum(h if act is None else h * act, blk.ffn_down_t)
        if act is None:
            return ffn_dense(x, blk.ffn_gate, blk.ffn_up, blk.ffn_down_t, variant)
        if x.shape[0] == 1:
            idx = act[0].nonzero().squeeze(1)
            return ffn_rows(x[0], blk.ffn_gate, blk.ffn_up, blk.ffn_down_t, variant, idx)[None]
        return ffn_masked(x, blk.ffn_gate, blk.ffn_up, blk.ffn_down_t, variant, act)
