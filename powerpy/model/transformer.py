"""The decoder: its weights (``Block``, ``Weights``) and the one forward loop (``Model``).

The model never opens files: ``loader.load_weights`` hands it weights. Arguments and weights
(``Model``), per-step state (``KVCache``) and per-call options (``RunOptions``, numerics
included) are separate objects. One loop, :meth:`Model._run`, runs a prompt chunk, a decode
step and a batch of sessions' decode steps; attention is ``powerpy.model.attention`` and the FFN
of each block ``powerpy.model.ffn``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from powerpy.config import ModelArgs
from powerpy.errors import ModelConfigError, NonFiniteError
from powerpy.families import Norm, Residual, Rope
from powerpy.formats.constants import Names
from powerpy.model import ggml_numerics, gpu_kernels, mla, numerics, stack_decode
from powerpy.model.attention import (
    apply_rope,
    attend,
    attend_pool,
    attention_block,
    layer_rotations,
)
from powerpy.model.cache import KVCache, KVPlacement
from powerpy.model.device import HOST, Accelerator, OnDevices, move
from powerpy.model.ffn import fused_decode
from powerpy.model.finite import check_finite as _check_finite
from powerpy.model.moe import mixture, moe_decode, placed_dense
from powerpy.model.norms import layer_norm, rms_norm
from powerpy.model.options import SPARSE, RunOptions
from powerpy.model.plan import Plans
from powerpy.model.split import ffn
from powerpy.model.step import Step
from powerpy.model.timing import phase
from powerpy.model.weights import Block, Weights

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- model
FFN_MODES = ("rows", "union", "batch")


class Model:
    """A decoder of one family (``powerpy.families``): its arguments and weights, and nothing
    that changes per call.

    ``forward(tokens, cache, opts)`` and ``decode_batch(tokens, caches, opts)`` depend only on
    their arguments, so any number of sessions (each with its own cache and options, numerics
    included) can share one model. Both run the one layer loop, :meth:`_run`. A hybrid
    placement (``powerpy.placement.runtime``) builds a new ``Model`` whose weights live partly
    on an accelerator; ``accel`` reaches that device and ``kv`` says which new caches go there.
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
        self.args, self.weights, self.accel, self.kv = args, weights, accel, kv
        self.cache_dtype = cache_dtype  # host KV caches: f16 (llama.cpp's default) or f32
        self.plans = Plans()  # decode plans per options and batch size, built on first use

    @property
    def can_gate(self) -> bool:
        """Sparse runs differ from dense ones: the file has predictors for every layer (a PWRI
        model), or it is a mixture of experts with a cut (``powerpy.ffn_down_threshold``)."""
        if self.args.moe:
            return any(b.moe is not None and b.moe.tau is not None for b in self.weights.blk)
        return self.args.sparse and all(b.fc1 is not None for b in self.weights.blk)

    def new_cache(self, n_ctx: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """A fresh KV cache for up to ``n_ctx`` positions (default ``args.default_n_ctx``), on
        the accelerator while the placement's KV pool has room for it (the live device caches
        together) and ``dtype`` is None or the pool's, else on the host. Host caches have
        ``dtype``, else the model's ``cache_dtype`` (f16 unless loaded with ``cache_type``, as
        llama.cpp's ``-ctk``)."""
        n_ctx = n_ctx or self.args.default_n_ctx
        if self.kv is not None and dtype in (None, self.kv.dtype):
            cache = self.kv.allocate(self.args, n_ctx, self.accel)
            if cache is not None:
                return cache
            log.warning(
                "a %d-position KV cache does not fit the %d positions placed on %s (%d in use): "
                "it stays on the host",
                n_ctx,
                self.kv.max_ctx,
                self.accel,
                self.kv.in_use(),
            )
        return KVCache(self.args, n_ctx, dtype or self.cache_dtype)

    def _to(self, t: Tensor, device: torch.device) -> Tensor:
        return move(self.accel, t, device)

    def norm(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """The family's norm of x (T, n_embd) by w (and bias b, LayerNorm): RMSNorm in one
        launch where the accelerator runs the fused kernels."""
        if self.args.family.norm is Norm.LAYER:
            return layer_norm(x, w, b, self.args.norm_eps)
        fused = self.accel is not None and self.accel.fused
        return rms_norm(x, w, self.args.norm_eps, fused=fused)

    def _check_room(self, cache: KVCache, n: int) -> None:
        """Raise ValueError when n more tokens do not fit the cache, ModelConfigError when
        they do not fit the model's learned position table."""
        a = self.args
        if cache.pos + n > cache.n_ctx:
            raise ValueError(
                f"context is full: {cache.pos} + {n} tokens exceed n_ctx {cache.n_ctx} "
                "(use a larger context: -c, n_ctx)"
            )
        if a.family.rope is Rope.LEARNED and cache.pos + n > a.n_ctx_train:
            raise ModelConfigError(
                f"context is full: {cache.pos} + {n} tokens exceed the {a.n_ctx_train} "
                f"positions {a.arch} has learned (the model's context_length, at most the rows "
                f"of {Names.POS_EMBD} less {a.family.position_offset})"
            )

    def _options(self, opts: RunOptions) -> RunOptions:
        return opts if opts.sparse and self.can_gate else dataclasses.replace(opts, sparse=False)

    @torch.inference_mode()
    def forward(
        self, tokens: Tensor, cache: KVCache, opts: RunOptions = SPARSE, *, all_logits=False
    ) -> Tensor:
        """Run tokens (T,) int64 at positions cache.pos..; return logits (T or 1, n_vocab) f32.

        Args:
            tokens: (T,) token ids.
            cache: the session's KV cache (advanced by T).
            opts: how to run (sparse or dense, threshold, numerics, observer, timer, stats).
            all_logits: return every position's logits, not just the last.

        Raises:
            ValueError: the tokens do not fit the cache.
            NonFiniteError: the logits are NaN or infinite; the message names the first layer
                where the residual stream stopped being finite.
        """
        n = tokens.shape[0]
        self._check_room(cache, n)
        return self._checked(tokens, Step([cache], [n]), self._options(opts), all_logits, "batch")

    @torch.inference_mode()
    def decode_batch(
        self,
        tokens: Tensor,
        caches: Sequence[KVCache],
        opts: RunOptions = SPARSE,
        *,
        ffn_mode: str = "rows",
    ) -> Tensor:
        """One token per session: tokens (B,) int64, ``caches[i]`` the cache of token i (each
        advanced by one), in one forward: every dense matrix (attention projections, output
        head, a dense model's FFN) is read once for the B rows; attention stays per session.
        Returns logits (B, n_vocab) f32 on the host.

        A predictor-gated FFN gathers each token's active rows; B tokens need the union of
        their rows, which may cost more than B gathers. ``ffn_mode`` picks how: ``"rows"``
        (each session's FFN alone on its own rows, as ``forward``), ``"union"`` (one pass over
        the union, masked per session) or ``"batch"`` (as a T-token prompt chunk).

        Raises:
            ValueError: a cache is full, the sizes differ, the same cache appears twice, or an
                unknown ``ffn_mode``.
        """
        n = tokens.shape[0]
        if n != len(caches) or n == 0:
            raise ValueError(f"{n} tokens for {len(caches)} caches")
        if len({id(c) for c in caches}) != n:
            raise ValueError("a cache appears twice in one batch")
        if ffn_mode not in FFN_MODES:
            raise ValueError(f"unknown ffn_mode {ffn_mode!r}: one of {FFN_MODES}")
        for c in caches:
            self._check_room(c, 1)
        step = Step(list(caches), [1] * n)
        return self._checked(tokens, step, self._options(opts), True, ffn_mode)

    def _checked(
        self, tokens: Tensor, step: Step, opts: RunOptions, all_logits: bool, ffn_mode: str
    ) -> Tensor:
        """:meth:`_run` under the call's numerics, with one finiteness check of the logits;
        only a bad result pays for the search of the layer where it went bad."""
        with numerics.using(opts.numerics):
            pos = [c.pos for c in step.caches]
            if tokens.shape[0] == len(step.caches):  # a decode step: one token per session
                plan = self.plans.get(self, opts, len(step.caches))
            else:
                plan = None
            if plan is not None:
                logits = plan.run(tokens, step, opts, ffn_mode)
            else:
                logits = self._run(tokens, step, opts, all_logits, ffn_mode)
            if opts.stats is not None:  # the counts a device made, now that it is done
                opts.stats.settle(lambda t: self._to(t, HOST))
            if not bool(torch.isfinite(logits).all()):
                for c, p in zip(step.caches, pos, strict=True):
                    c.pos = p  # the rerun rewrites the same cache rows, then stops at the culprit
                quiet = dataclasses.replace(opts, observer=None, timer=None, stats=None)
                self._run(tokens, step, quiet, all_logits, ffn_mode, check=True)
                raise NonFiniteError("the logits are not finite, but every layer's output is")
        return logits

    def _run(
        self,
        tokens: Tensor,
        step: Step,
        opts: RunOptions,
        all_logits: bool,
        ffn_mode: str,
        check: bool = False,
        host: stack_decode.StackPlan | None = None,
    ) -> Tensor:
        """The one layer loop. ``host``: a decode plan's host executor (``stack_decode``), which
        runs the layers from its first one, all on the host in the native kernels, in C, in
        this loop's order, in one call (a one-token step whose cache it can read). A pipeline
        stage without ``token_embd``/``output`` takes/returns the residual stream (T, n_embd)."""
        a, w = self.args, self.weights
        pos = step.positions()  # (T,)
        x = tokens if w.token_embd is None else self.embed(tokens, pos)
        if check and w.token_embd is not None:
            _check_finite(x, "token_embd.weight", "the embedding rows of these tokens")
        tables = layer_rotations(a, w, pos, step.caches[0].n_ctx)  # per layer (T, n_rot/2)
        moved = {id(t): OnDevices(self.accel, t) for t in tables if t is not None}  # one per table
        rots = [None if t is None else moved[id(t)] for t in tables]
        one = tokens.shape[0] == 1  # one token: native block calls where the block is on the host
        if not one or check or not stack_decode.usable(step.caches[0], opts):
            host = None
        # a prompt whose last position alone needs logits: the last layer's FFN runs for that
        # row only, as llama.cpp's graphs do (each row's FFN is its own, so its value is the
        # same); not while an observer or the stats watch every row's FFN
        tail = not all_logits and not one and opts.observer is None and opts.stats is None
        tail = tail and w.output is not None  # a stage's: every row
        x = self.layers(x, step, rots, opts, ffn_mode, check=check, tail=tail, host=host)
        step.advance()
        if w.output is None:  # a stage before the last: the residual stream goes on
            return self._to(x, HOST)
        x = x if all_logits else x[-1:]
        logits = self._to(self.head(x, opts), HOST)
        if check:
            _check_finite(logits, "output", "the output layer (output_norm, output)")
        return logits

    def threshold(self, opts: RunOptions) -> float:
        """The predictor threshold of a run with ``opts``: its own, else the file's."""
        return self.args.sparse_threshold if opts.threshold is None else float(opts.threshold)

    def embed(self, tokens: Tensor, pos: Tensor) -> Tensor:
        """The residual stream's start: tokens (T,) at positions pos (T,) -> (T, n_embd) f32 on
        the host (the embedding rows, learned positions, the family's scale)."""
        a, w, fam = self.args, self.weights, self.args.family
        x = w.token_embd.take_rows(tokens).dequantize()  # (T, n_embd), on the host
        if w.position_embd is not None:  # learned positions
            x = x + w.position_embd.take_rows(pos + fam.position_offset).dequantize()
        if fam.embed_scale:
            x = x * a.n_embd**0.5
        return x

    def layers(
        self,
        x: Tensor,
        step: Step,
        rots: list,
        opts: RunOptions,
        ffn_mode: str = "rows",
        *,
        check: bool = False,
        tail: bool = False,
        host=None,
    ) -> Tensor:
        """The blocks over the residual stream x (T, n_embd): each where its weights are, and
        from layer ``host.first`` on the host stack plan (``stack_decode``) in one call.
        ``tail``: the last layer's FFN for the last row only. rots: each layer's rotations."""
        thr, blocks = self.threshold(opts), self.weights.blk
        for l, blk in enumerate(blocks):
            if host is not None and l == host.first:
                return host.run(self.args, self._to(x, HOST), step.caches[0], rots, thr, opts)
            last = tail and l == len(blocks) - 1
            x = self._block(l, blk, x, step, rots[l], thr, opts, ffn_mode, check, last)
            if step.cold is not None:  # a plan's step: the earlier layers' deferred cold rows
                x = step.cold.settle(l, x)
        return x

    def head(self, x: Tensor, opts: RunOptions) -> Tensor:
        """Logits of x (T, n_embd): output_norm, output and the final soft-cap, (T, n_vocab)
        f32 on the output matrix's device."""
        a, w = self.args, self.weights
        with phase(opts.timer, "output"):
            x = self.norm(self._to(x, w.output_norm.device), w.output_norm, w.output_norm_b)
            logits = w.output.linear(self._to(x, w.output.device))
            if a.final_softcap:
                logits = ggml_numerics.softcap_(logits, a.final_softcap)
        return logits

    def _block(
        self,
        l: int,
        blk: Block,
        x: Tensor,
        step: Step,
        rot: OnDevices | None,
        thr: float,
        opts: RunOptions,
        ffn_mode: str,
        check: bool,
        last_row: bool = False,
    ) -> Tensor:
        """One block: x (T, n_embd) the residual stream -> after the block, by the family's
        residual layout (``last_row``: the last row only, (1, n_embd): its FFN alone runs).
        Each step runs where its weights are and the residual stream follows (no move when
        the tensor is already there, e.g. CPU-only)."""
        if self.args.family.residual is Residual.PARALLEL:
            return self._parallel_block(l, blk, x, step, rot, thr, opts, ffn_mode, check, last_row)
        a, one = self.args, x.shape[0] == 1
        x = self._to(x, blk.attn_norm.device)
        with phase(opts.timer, "attention"):
            h = attention_block(l, blk, x, step.caches[0], rot, a) if one else None
            if h is None:
                xn = self.norm(x, blk.attn_norm, blk.attn_norm_b)
                att = self._to(self.attention(l, blk, xn, step, rot), x.device)
                if blk.post_attention_norm is not None:
                    att = self.norm(att, blk.post_attention_norm)
                h = x + att
        if last_row:
            h = h[-1:]
        if check:
            _check_finite(h, f"blk.{l}", "attention (attn_norm, attn_q/k/v/output)")
        with phase(opts.timer, "ffn"):
            inp = OnDevices(self.accel, h)  # moved once: native block, norm, predictor
            block = fused_decode if blk.moe is None else moe_decode  # one native call
            y = block(l, blk, inp, a, thr, opts) if one else None
            if y is None:
                xn = self.norm(inp(blk.ffn_norm.device), blk.ffn_norm, blk.ffn_norm_b)
                pred_in = blk.predictor_input(inp, opts)
                f = self._down_bias(
                    blk,
                    self._to(self._ffn(l, blk, xn, pred_in, step, thr, opts, ffn_mode), h.device),
                )
                if blk.post_ffw_norm is not None:
                    f = self.norm(f, blk.post_ffw_norm)
                y = h + f
        if check:
            _check_finite(y, f"blk.{l}", "the FFN (ffn_norm, ffn_gate/up/down, fc1/fc2)")
        return y

    def _parallel_block(
        self,
        l: int,
        blk: Block,
        x: Tensor,
        step: Step,
        rot: OnDevices | None,
        thr: float,
        opts: RunOptions,
        ffn_mode: str,
        check: bool,
        last_row: bool = False,
    ) -> Tensor:
        """(attn(norm2(x)) + ffn(norm(x))) + x, added in llama.cpp's order: attn_norm feeds the
        FFN, and attention too unless the block has its own attn_norm_2; the predictor reads x
        (T, n_embd) (``last_row``: see :meth:`_block`)."""
        a, one, x = self.args, x.shape[0] == 1, self._to(x, blk.attn_norm.device)
        with phase(opts.timer, "attention"):  # one token on the host: native blocks
            att = attention_block(l, blk, x, step.caches[0], rot, a) if one else None
            if att is None:
                xn = self.norm(x, blk.attn_norm, blk.attn_norm_b)
                norm_2 = blk.attn_norm_2
                xa = xn if norm_2 is None else self.norm(x, norm_2, blk.attn_norm_2_b)
                att = self._to(self.attention(l, blk, xa, step, rot), x.device)
        if last_row:
            x, att = x[-1:], att[-1:]
        if check:
            _check_finite(att, f"blk.{l}", "attention (attn_norm(_2), attn_qkv/output)")
        with phase(opts.timer, "ffn"):
            src = OnDevices(self.accel, x)
            y = fused_decode(l, blk, OnDevices(self.accel, att), a, thr, opts, src) if one else None
            if y is None:
                xn = self.norm(x, blk.attn_norm, blk.attn_norm_b)
                f = self._ffn(l, blk, xn, blk.predictor_input(src, opts), step, thr, opts, ffn_mode)
                y = (att + self._down_bias(blk, self._to(f, x.device))) + x
        if check:
            _check_finite(y, f"blk.{l}", "the FFN (attn_norm, ffn_up/down, fc1/fc2)")
        return y

    def _down_bias(self, blk: Block, f: Tensor) -> Tensor:
        """The FFN's output f (T, n_embd) plus the down matrix's bias, if it has one."""
        return f if blk.ffn_down_b is None else f + self._to(blk.ffn_down_b, f.device)

    def attention(self, l: int, blk: Block, x: Tensor, step: Step, rot: OnDevices | None) -> Tensor:
        """x (T, n_embd) normed -> (T, n_embd) on attn_output's device; writes the caches.
        The projections run once for all T tokens, the attention once per segment (each reads
        its own cache), or once for a pooled step's sessions. ``rot`` holds the rotations per
        device (moved once per forward)."""
        if blk.mla is not None:
            return mla.attention(self, l, blk, x, step, rot)
        a, n = self.args, x.shape[0]
        x_on = OnDevices(self.accel, x)  # x moved once to each device that reads it
        if blk.attn_qkv is not None:  # q, k and v in one product
            qkv = blk.attn_qkv.linear(x_on(blk.attn_qkv.device))  # (T, n_q + 2 n_kv)
            q, k, v = qkv.split([a.n_embd_q, a.n_embd_gqa, a.n_embd_gqa], dim=1)
        else:
            q = blk.attn_q.linear(x_on(blk.attn_q.device))
            k = blk.attn_k.linear(x_on(blk.attn_k.device))
            v = blk.attn_v.linear(x_on(blk.attn_v.device))
        q = q.view(n, a.n_head, a.head_dim)  # (T, n_head, head_dim)
        k = k.view(n, a.n_head_kv, a.head_dim)
        v = v.view(n, a.n_head_kv, a.head_dim)
        if blk.attn_q_norm is not None:  # per head, before RoPE
            q = rms_norm(q, blk.attn_q_norm, a.norm_eps)
            k = rms_norm(k, blk.attn_k_norm, a.norm_eps)
        window = a.sliding_window if l in a.swa_layers else 0
        if step.pooled and blk.attn_sinks is None:  # (sinks: the per-session attention)
            out = self._attend_pooled(l, q, k, v, step, rot, window)
            return blk.attn_output.linear(self._to(out, blk.attn_output.device))
        if rot is not None:
            mode = a.family.rope
            q = apply_rope(q, rot(q.device), a.n_rot, mode)
            k = apply_rope(k, rot(k.device), a.n_rot, mode)
        outs = []
        for cache, s, m in step.segments():
            dev, p0 = cache.device, cache.pos  # attention runs where the cache is
            cache.k[l, p0 : p0 + m].copy_(self._to(k[s : s + m], dev))
            cache.v[l, p0 : p0 + m].copy_(self._to(v[s : s + m], dev))
            out = attend(
                a, self._to(q[s : s + m], dev), cache, l, p0, window=window, sinks=blk.attn_sinks
            )
            outs.append(self._to(out, blk.attn_output.device))
        return blk.attn_output.linear(outs[0] if len(outs) == 1 else torch.cat(outs))

    def _attend_pooled(
        self, l: int, q: Tensor, k: Tensor, v: Tensor, step: Step, rot, window: int
    ) -> Tensor:
        """A pooled step's attention (``attention.attend_pool``): q (B, n_head, hd), k, v (B,
        n_kv, hd) -> (B, n_q) on the pool's device, RoPE and the cache rows written first (in
        one fused op where a plan holds the layer's table of every position)."""
        a, pool = self.args, step.caches[0].pool
        dev = pool[0].device
        q, k, v = (self._to(t, dev) for t in (q, k, v))
        pos, base = step.rows(self.accel)
        table = None if step.tables is None else step.tables[l]
        if table is not None and self.accel is not None and self.accel.fused:
            neox = a.family.rope is Rope.NEOX
            q = gpu_kernels.rope_kv_op(
                q, k, v, table, pos, base + pos, pool[0][l], pool[1][l], a.n_rot, neox
            )
            return attend_pool(a, q, None, None, pool, l, pos, base, window=window)
        if rot is not None:
            q = apply_rope(q, rot(dev), a.n_rot, a.family.rope)
            k = apply_rope(k, rot(dev), a.n_rot, a.family.rope)
        return attend_pool(a, q, k, v, pool, l, pos, base, window=window)

    def _ffn(
        self,
        l: int,
        blk: Block,
        xn: Tensor,
        pred_in: Tensor,
        step: Step,
        thr: float,
        opts: RunOptions,
        ffn_mode: str,
    ) -> Tensor:
        """The FFN of xn (T, n_embd) normed, pred_in its pre-norm value where the predictor
        reads it -> (T, n_embd). Sessions' tokens of one decode step run by ``ffn_mode``."""
        a, acc = self.args, self.accel
        if blk.moe is not None:  # tokens are grouped by expert, whatever the mode
            return mixture(l, blk, xn, opts, acc, step.cold)
        if a.moe and acc is not None and acc.holds(blk.ffn_up.storage):  # a dense layer, placed
            return placed_dense(blk, xn, a.ffn_variant, acc)
        if len(step.lengths) == 1 or not opts.sparse or ffn_mode == "batch":
            return ffn(l, blk, xn, pred_in, a.ffn_variant, thr, opts, acc, cold=step.cold)
        if ffn_mode == "union":
            return ffn(l, blk, xn, pred_in, a.ffn_variant, thr, opts, acc, union=True)
        rows = [
            ffn(l, blk, xn[i : i + 1], pred_in[i : i + 1], a.ffn_variant, thr, opts, acc)
            for i in range(xn.shape[0])
        ]
        return torch.cat([self._to(r, xn.device) for r in rows])
