"""One decode step of several sessions in one forward: B tokens, each at its own cache position.

``Model.forward`` runs T consecutive tokens of one session. A server holding B sessions instead
wants one new token of each; :func:`decode_batch` runs them together, so every dense matrix
(attention projections, output head, and the FFN of a dense model) is read once for B rows
instead of B times. Attention stays per session (each reads its own cache, of its own length).

The predictor-gated FFN of a sparse model gathers only each token's active rows; B tokens need
the union of their rows, which may cost more than B separate gathers. ``ffn`` picks how:

- ``"rows"``: each session's FFN runs alone on its own active rows (exactly as in ``forward``);
- ``"union"``: one pass over the union of the active rows, masked per session;
- ``"batch"``: the FFN as ``Model.forward`` runs a T-token chunk (a dense masked pass on a
  CPU-only model).

A dense model (or dense options) always runs its FFN batched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from powerpy.model.cache import KVCache
from powerpy.model.device import HOST, OnDevices, move
from powerpy.model.ffn import ffn, ffn_union, predict
from powerpy.model.options import SPARSE, RunOptions
from powerpy.model.timing import phase
from powerpy.model.transformer import (
    Block,
    Model,
    apply_rope,
    cache_attention,
    rope_tables,
)

FFN_MODES = ("rows", "union", "batch")


@torch.inference_mode()
def decode_batch(
    model: Model,
    tokens: Tensor,
    caches: Sequence[KVCache],
    opts: RunOptions = SPARSE,
    *,
    ffn_mode: str = "rows",
) -> Tensor:
    """One token per session: tokens (B,) int64, ``caches[i]`` the cache of token i (each
    advanced by one). Returns logits (B, n_vocab) f32 on the host.

    Raises:
        ValueError: a cache is full, the sizes differ, the same cache appears twice, or an
            unknown ``ffn_mode``.
    """
    a, w = model.args, model.weights
    n = tokens.shape[0]
    if n != len(caches) or n == 0:
        raise ValueError(f"{n} tokens for {len(caches)} caches")
    if len({id(c) for c in caches}) != n:
        raise ValueError("a cache appears twice in one batch")
    if ffn_mode not in FFN_MODES:
        raise ValueError(f"unknown ffn_mode {ffn_mode!r}: one of {FFN_MODES}")
    for c in caches:
        if c.pos + 1 > c.n_ctx:
            raise ValueError(f"context is full: {c.pos} + 1 tokens exceed n_ctx {c.n_ctx}")
    sparse = opts.sparse and model.can_gate
    if not sparse:
        opts = dataclasses.replace(opts, sparse=False)
    thr = a.sparse_threshold if opts.threshold is None else float(opts.threshold)
    x = w.token_embd.take_rows(tokens).dequantize()  # (B, n_embd) on the host
    pos = torch.tensor([c.pos for c in caches])
    rot = OnDevices(model.accel, rope_tables(a, 0, n, positions=pos))  # (B, n_rot/2)
    for l, blk in enumerate(w.blk):
        x = move(model.accel, x, blk.attn_norm.device)
        with phase(opts.timer, "attention"):
            xn = model.norm(x, blk.attn_norm)
            att = _attention(model, l, blk, xn, caches, rot)
            ffn_inp = x + move(model.accel, att, x.device)
        with phase(opts.timer, "ffn"):
            inp = OnDevices(model.accel, ffn_inp)  # the norm's and the predictor's
            xn = model.norm(inp(blk.ffn_norm.device), blk.ffn_norm)
            pred_in = blk.predictor_input(inp, opts)
            if not sparse or ffn_mode == "batch":
                y = ffn(l, blk, xn, pred_in, a.ffn_variant, thr, opts, model.accel)
            elif ffn_mode == "rows":
                y = torch.cat(
                    [
                        move(
                            model.accel,
                            ffn(l, blk, xn[i : i + 1], pred_in[i : i + 1], a.ffn_variant, thr,
                                opts, model.accel),
                            xn.device,
                        )
                        for i in range(n)
                    ]
                )  # fmt: skip
            else:
                y = _union_ffn(model, l, blk, xn, ffn_inp, thr, opts)
            x = ffn_inp + move(model.accel, y, ffn_inp.device)
    for c in caches:
        c.pos += 1
    with phase(opts.timer, "output"):
        x = model.norm(move(model.accel, x, w.output_norm.device), w.output_norm)
        return move(model.accel, w.output.linear(move(model.accel, x, w.output.device)), HOST)


def _attention(
    model: Model,
    l: int,
    blk: Block,
    x: Tensor,
    caches: Sequence[KVCache],
    rot: OnDevices,
) -> Tensor:
    """x (B, n_embd) normed -> (B, n_embd): batched projections, per-session attention."""
    a, acc = model.args, model.accel
    n = x.shape[0]
    x_on = OnDevices(acc, x)  # x moved once to each device that reads it
    q = blk.attn_q.linear(x_on(blk.attn_q.device)).view(n, a.n_head, a.head_dim)
    k = blk.attn_k.linear(x_on(blk.attn_k.device)).view(n, a.n_head_kv, a.head_dim)
    v = blk.attn_v.linear(x_on(blk.attn_v.device)).view(n, a.n_head_kv, a.head_dim)
    q = apply_rope(q, rot(q.device), a.n_rot)  # (B, n_head, head_dim)
    k = apply_rope(k, rot(k.device), a.n_rot)
    outs = []
    for i, cache in enumerate(caches):
        dev, p = cache.device, cache.pos
        cache.k[l, p] = move(acc, k[i], dev)
        cache.v[l, p] = move(acc, v[i], dev)
        out = cache_attention(a, move(acc, q[i : i + 1], dev), cache, l, p)  # (1, n_embd)
        outs.append(move(acc, out, blk.attn_output.device))
    return blk.attn_output.linear(torch.cat(outs))


def _union_ffn(
    model: Model, l: int, blk: Block, x: Tensor, ffn_inp: Tensor, thr: float, opts: RunOptions
) -> Tensor:
    """The gated FFN over the union of the B tokens' active rows (CPU-only placements; others
    run :func:`ffn`, as do layers with a cut). x, ffn_inp (B, n_embd) -> (B, n_embd)."""
    plain = blk.hot is None and opts.observer is None and blk.cut(opts) is None
    if not plain or not blk.gates(opts):
        return ffn(l, blk, x, ffn_inp, model.args.ffn_variant, thr, opts, model.accel)
    with phase(opts.timer, "predictor"):
        act = predict(ffn_inp, blk.fc1, blk.fc2, model.accel) >= thr  # (B, n_ff) bool
    act = move(model.accel, act, HOST)
    if opts.stats is not None:
        opts.stats.record(l, act)
    return ffn_union(x, blk.ffn_gate, blk.ffn_up, blk.ffn_down_t, model.args.ffn_variant, act)
