"""LLaMA-family transformer over GGUF-named weights: RMSNorm, ggml RoPE, GQA attention.

The model never opens files: ``loader.load_weights`` hands it weights. Arguments and weights
(``Model``), per-step state (``KVCache``) and per-call options (``RunOptions``) are separate
objects. The FFN of each block is ``powerpy.model.ffn.ffn``, the one split runner.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.config import ModelArgs
from powerpy.errors import NonFiniteError
from powerpy.model import ggml_numerics, gpu_kernels, kernels, stack_decode
from powerpy.model.cache import KVCache, KVPlacement
from powerpy.model.device import HOST, Accelerator, OnDevices, move
from powerpy.model.ffn import HotRows, ffn, fused_decode, scaled_cut
from powerpy.model.matrices import Weight
from powerpy.model.options import SPARSE, RunOptions
from powerpy.model.timing import phase

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
    hot: HotRows | None = None  # hybrid placements: this layer's rows on the accelerator
    gated: bool = True  # False: in powerpy.dense_layers, the FFN runs ungated in sparse mode
    down_tau: Tensor | None = None  # (n_ff,) f32 host: the cut (powerpy.ffn_down_threshold)

    def gates(self, opts: RunOptions) -> bool:
        """Whether the predictor gates this layer's FFN in a run with ``opts``."""
        return opts.sparse and self.gated and self.fc1 is not None and opts.oracle is None

    def predictor_input(self, ffn_inp: OnDevices, opts: RunOptions) -> Tensor:
        """The FFN's pre-norm input where the predictor reads it (where it was, when the
        predictor does not run)."""
        return ffn_inp(self.fc1.device) if self.gates(opts) else ffn_inp.tensor

    def cut(self, opts: RunOptions) -> Tensor | None:
        """This layer's cut in a run with ``opts`` (None: every computed neuron counts)."""
        return scaled_cut(self.down_tau, opts)


@dataclass
class Weights:
    token_embd: Weight  # (n_vocab, n_embd)
    output_norm: Tensor  # (n_embd,)
    output: Weight  # (n_vocab, n_embd); token_embd itself when tied
    blk: list[Block]


# ----------------------------------------------------------------------------------- maths
_HAS_RMS_NORM = hasattr(F, "rms_norm")


def rms_norm(x: Tensor, w: Tensor, eps: float, *, fused: bool = False) -> Tensor:
    """x (..., n) f32 -> x / sqrt(mean(x²) + eps) · w; ``fused``: in one launch on a device
    (``gpu_kernels``)."""
    if fused and x.device.type != "cpu" and x.dtype == w.dtype == torch.float32:
        return gpu_kernels.rms_norm_op(x, w, eps)
    c = ggml_numerics.library(x)
    if c is not None:
        return ggml_numerics.rms_norm(c, x, w, eps)
    if _HAS_RMS_NORM and x.dtype == w.dtype:
        return F.rms_norm(x, w.shape, w, eps)  # one fused op (torch >= 2.4)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(args: ModelArgs, pos0: int, n: int, positions: Tensor | None = None) -> Tensor:
    """Rotations ``exp(i·pos·θ_j)`` (n, n_rot/2) complex64 for positions pos0..pos0+n-1 (or the
    given ``positions`` (n,), e.g. one per session), ggml NORM mode (θ_j = base^(-2j/n_rot)),
    computed in float64, or as ggml computes them where its numerics are on (ggml_numerics)."""
    if positions is None:
        positions = torch.arange(pos0, pos0 + n, dtype=torch.float64)
    c = ggml_numerics.library()
    if c is not None:
        return ggml_numerics.rope_table(c, args, positions)
    inv = args.rope_base ** (-torch.arange(0, args.n_rot, 2, dtype=torch.float64) / args.n_rot)
    ang = positions.to(torch.float64)[:, None] * inv[None]
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64)


def decode_attention(args: ModelArgs, q: Tensor, keys: Tensor, vals: Tensor) -> Tensor:
    """One query token: q (n_head, head_dim) (or (1, n_head, head_dim)), keys/vals (n_head_kv, S,
    head_dim) -> (1, n_embd) head-major. Query head h reads key/value head h // group, as two bmm
    (torch's SDPA with GQA costs ~10x more here)."""
    group = args.n_head // args.n_head_kv
    qg = q.reshape(args.n_head_kv, group, args.head_dim)
    scores = torch.bmm(qg, keys.transpose(1, 2)) * args.head_dim**-0.5  # (n_kv, group, S)
    return torch.bmm(scores.softmax(-1), vals).view(1, args.n_embd)


def apply_rope(x: Tensor, rot: Tensor, n_rot: int) -> Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of the first n_rot dims: x (T, heads, head_dim) f32, rot
    (T, n_rot/2) from ``rope_tables``. Each pair is one complex number times its rotation."""
    c = ggml_numerics.library(x)
    if c is not None:
        return ggml_numerics.rope(c, x, rot, n_rot)
    z = torch.view_as_complex(x[..., :n_rot].reshape(*x.shape[:-1], n_rot // 2, 2))
    out = torch.view_as_real(z * rot[:, None]).flatten(-2)  # (T, heads, n_rot)
    return torch.cat((out, x[..., n_rot:]), dim=-1) if n_rot < x.shape[-1] else out


# ----------------------------------------------------------------------------------- model
class Model:
    """A LLaMA-family decoder: its arguments and weights, and nothing that changes per call.

    ``forward(tokens, cache, opts)`` depends only on its arguments, so any number of sessions
    (each with its own cache and options) can share one model. A hybrid placement
    (``powerpy.placement.runtime``) builds a new ``Model`` whose weights live partly on an
    accelerator; ``accel`` reaches that device and ``kv`` says which new caches go there.
    """

    def __init__(
        self,
        args: ModelArgs,
        weights: Weights,
        *,
        accel: Accelerator | None = None,
        kv: KVPlacement | None = None,
        cache_dtype: torch.dtype = torch.float16,
    ) -> None:
        self.args = args
        self.weights = weights
        self.accel = accel
        self.kv = kv
        self.cache_dtype = cache_dtype  # host KV caches: f16 (llama.cpp's default) or f32

    @property
    def can_gate(self) -> bool:
        """The file has predictors for every layer (a PWRI model)."""
        return self.args.sparse and all(b.fc1 is not None for b in self.weights.blk)

    def new_cache(self, n_ctx: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """A fresh KV cache for up to ``n_ctx`` positions (default ``args.default_n_ctx``), on
        the accelerator while the placement's KV reservation has room for it (the live device
        caches together), else on the host. Host caches have ``dtype``, else the model's
        ``cache_dtype`` (f16 unless loaded with ``cache_type``, as llama.cpp's ``-ctk``)."""
        n_ctx = n_ctx or self.args.default_n_ctx
        if self.kv is not None:
            live = self.kv.in_use()
            if live + n_ctx <= self.kv.max_ctx:
                cache = KVCache(self.args, n_ctx, dtype or self.kv.dtype, self.accel)
                self.kv.live.add(cache)
                return cache
            log.warning(
                "a %d-position KV cache does not fit the %d positions placed on %s (%d in use): "
                "it stays on the host",
                n_ctx,
                self.kv.max_ctx,
                self.accel,
                live,
            )
        return KVCache(self.args, n_ctx, dtype or self.cache_dtype)

    def _to(self, t: Tensor, device: torch.device) -> Tensor:
        return move(self.accel, t, device)

    def norm(self, x: Tensor, w: Tensor) -> Tensor:
        """RMSNorm of x (T, n_embd) by w, in one launch where the accelerator runs the fused
        kernels."""
        fused = self.accel is not None and self.accel.fused
        return rms_norm(x, w, self.args.rms_eps, fused=fused)

    @torch.inference_mode()
    def forward(
        self, tokens: Tensor, cache: KVCache, opts: RunOptions = SPARSE, *, all_logits=False
    ) -> Tensor:
        """Run tokens (T,) int64 at positions cache.pos..; return logits (T or 1, n_vocab) f32.

        Args:
            tokens: (T,) token ids.
            cache: the session's KV cache (advanced by T).
            opts: how to run (sparse or dense, threshold, observer, timer, statistics).
            all_logits: return every position's logits, not just the last.

        Raises:
            ValueError: the tokens do not fit the cache.
            NonFiniteError: the logits are NaN or infinite; the message names the first layer
                where the residual stream stopped being finite.
        """
        n, p0 = tokens.shape[0], cache.pos
        if p0 + n > cache.n_ctx:
            raise ValueError(
                f"context is full: {p0} + {n} tokens exceed n_ctx {cache.n_ctx} "
                "(use a larger context: -c, n_ctx)"
            )
        if not (opts.sparse and self.can_gate):
            opts = dataclasses.replace(opts, sparse=False)
        logits = self._run(tokens, cache, opts, all_logits)
        # One reduction over the logits per call; only a bad one pays for the search below.
        if not bool(torch.isfinite(logits).all()):
            cache.pos = p0  # the rerun rewrites the same cache rows, then stops at the culprit
            quiet = dataclasses.replace(opts, observer=None, timer=None, stats=None)
            self._run(tokens, cache, quiet, all_logits, check=True)
            raise NonFiniteError("the logits are not finite, but every layer's output is")
        return logits

    def _run(
        self, tokens: Tensor, cache: KVCache, opts: RunOptions, all_logits: bool, check=False
    ) -> Tensor:
        a, w = self.args, self.weights
        n = tokens.shape[0]
        thr = a.sparse_threshold if opts.threshold is None else float(opts.threshold)
        x = w.token_embd.take_rows(tokens).dequantize()  # (T, n_embd), on the host
        if check:
            _check_finite(x, "token_embd.weight", "the embedding rows of these tokens")
        rot = OnDevices(self.accel, rope_tables(a, cache.pos, n))  # (T, n_rot/2) complex
        fused = n == 1  # decode: one native call per block where the block is on the host
        plan = None
        if fused and not check and stack_decode.usable(cache, opts):  # or one for the stack
            plan = stack_decode.plan_for(self, opts)
        for l, blk in enumerate(w.blk):
            if plan is not None and l == plan.first:
                x = plan.run(a, self._to(x, HOST), cache, rot(HOST)[0], thr, opts)
                break
            # Each step runs where its weights are and the residual stream follows (no move
            # when the tensor is already there, e.g. CPU-only).
            x = self._to(x, blk.attn_norm.device)
            with phase(opts.timer, "attention"):
                ffn_inp = _fused_attention(l, blk, x, cache, rot(HOST), a) if fused else None
                if ffn_inp is None:
                    xn = self.norm(x, blk.attn_norm)
                    ffn_inp = x + self._to(self.attention(l, blk, xn, cache, rot), x.device)
            if check:
                _check_finite(ffn_inp, f"blk.{l}", "attention (attn_norm, attn_q/k/v/output)")
            with phase(opts.timer, "ffn"):
                inp = OnDevices(self.accel, ffn_inp)  # moved once: native block, norm, predictor
                x = None
                if fused:
                    x = fused_decode(l, blk, inp, a.rms_eps, a.ffn_variant, thr, opts)
                if x is None:
                    xn = self.norm(inp(blk.ffn_norm.device), blk.ffn_norm)
                    y = ffn(l, blk, xn, blk.predictor_input(inp, opts), a.ffn_variant, thr, opts,
                            self.accel)  # fmt: skip
                    x = ffn_inp + self._to(y, ffn_inp.device)
            if check:
                _check_finite(x, f"blk.{l}", "the FFN (ffn_norm, ffn_gate/up/down, fc1/fc2)")
        cache.pos += n
        if not all_logits:
            x = x[-1:]
        with phase(opts.timer, "output"):
            x = self.norm(self._to(x, w.output_norm.device), w.output_norm)
            logits = self._to(w.output.linear(self._to(x, w.output.device)), HOST)
        if check:
            _check_finite(logits, "output", "the output layer (output_norm, output)")
        return logits

    def attention(self, l: int, blk: Block, x: Tensor, cache: KVCache, rot: OnDevices) -> Tensor:
        """x (T, n_embd) normed -> (T, n_embd) on attn_output's device; writes the cache.

        ``rot`` holds the rotations per device; they move to a device once per forward."""
        a = self.args
        n, p0 = x.shape[0], cache.pos
        x_on = OnDevices(self.accel, x)  # x moved once to each device that reads it
        q = blk.attn_q.linear(x_on(blk.attn_q.device)).view(n, a.n_head, a.head_dim)
        k = blk.attn_k.linear(x_on(blk.attn_k.device)).view(n, a.n_head_kv, a.head_dim)
        v = blk.attn_v.linear(x_on(blk.attn_v.device)).view(n, a.n_head_kv, a.head_dim)
        q = apply_rope(q, rot(q.device), a.n_rot)
        k = apply_rope(k, rot(k.device), a.n_rot)
        dev = cache.device  # attention runs where the cache is
        cache.k[l, p0 : p0 + n].copy_(self._to(k, dev))
        cache.v[l, p0 : p0 + n].copy_(self._to(v, dev))
        out = cache_attention(a, self._to(q, dev), cache, l, p0)
        return blk.attn_output.linear(self._to(out, blk.attn_output.device))


def cache_attention(a: ModelArgs, q: Tensor, cache: KVCache, l: int, p0: int) -> Tensor:
    """Causal attention of q (T, n_head, head_dim) at positions p0.. over layer l of the cache
    (filled up to p0 + T), on the cache's device -> (T, n_embd). An f16 host cache under
    llama.cpp's numerics runs ggml's order (``ggml_numerics.attention``)."""
    n = q.shape[0]
    c = ggml_numerics.library(q)
    if c is not None and cache.k.dtype is torch.float16:
        return ggml_numerics.attention(c, a, q, cache.k[l], cache.v[l], p0)
    keys = cache.k[l, : p0 + n].transpose(0, 1).float()  # (n_head_kv, S, head_dim)
    vals = cache.v[l, : p0 + n].transpose(0, 1).float()
    if n == 1:
        return decode_attention(a, q, keys, vals)
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


def _fused_attention(
    l: int, blk: Block, x: Tensor, cache: KVCache, rot: Tensor, a: ModelArgs
) -> Tensor | None:
    """A CPU-only decode step's attention block (attn_norm, q/k/v, RoPE, cache row, GQA
    softmax, output, residual) as one native call: x (1, n_embd) the residual stream -> x +
    attention (1, n_embd); None when a matrix or the cache is not for the kernels."""
    kern = stack_decode.attention_kernels(blk)
    k, v = cache.k[l], cache.v[l]  # (n_ctx, n_kv, head_dim)
    host = k.device.type == "cpu" and x.device.type == "cpu"
    if kern is None or not host or k.dtype not in kernels.CACHE_CODES:
        return None
    rot = torch.view_as_real(rot[0])  # (n_rot / 2, 2): cos, sin
    shape = (a.n_head, a.n_head_kv, a.head_dim)
    norm = (blk.attn_norm, a.rms_eps)
    lib, mats = kern
    return lib.attn_decode(mats, x[0], norm, rot, shape, (k, v, cache.pos))[None]


def _check_finite(x: Tensor, where: str, what: str) -> None:
    """Raise ``NonFiniteError`` when ``x`` holds a NaN or an infinity (diagnosis only)."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        kind = "NaN" if bool(torch.isnan(x).any()) else "infinite"
        raise NonFiniteError(
            f"the residual stream became {kind} at {where}, in {what}: the model's weights "
            f"there are corrupt or out of range (NaN or huge values, data of another type, a "
            f"wrong alignment); check the file (`powerpy dump`) or re-convert the model"
        )
