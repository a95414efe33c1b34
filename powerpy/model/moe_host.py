"""A mixture's routed experts on the host (``moe.moe_ffn``'s CPU part; ``ex`` is a layer's
``moe.Experts``), as llama.cpp's ``build_moe_ffn`` computes them: each routed expert's gate and
up products (plus their biases, GPT-OSS's), the activation (SwiGLU, or GPT-OSS's clamped
``swiglu_oai``), the cut, the down product (plus its bias), weighted, and the k outputs added in
routing order.

A decode step reads exactly the routed experts' rows (one fused gate/up call where the experts
are plain SwiGLU); a prompt groups its tokens by expert. Interleaved Q4_K/Q4_0/MXFP4 stacks run
every token by their GEMV (``Experts.x8``), as llama.cpp multiplies them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from powerpy.config import FFNVariant
from powerpy.model import ggml_numerics, kernels, numerics
from powerpy.model.ffn import glu, glu_rows
from powerpy.model.kernels import as_f32
from powerpy.model.matrices import Weight
from powerpy.model.options import RunOptions

SWIGLU = FFNVariant.SWIGLU
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # GPT-OSS's SwiGLU (llama.cpp's constants)


def swiglu_oai(g: Tensor, u: Tensor) -> Tensor:
    """GPT-OSS's SwiGLU of gate g and up u (any shape, f32): the gate capped at 7, the up
    clamped to [-7, 7], then ``x / (1 + exp(-1.702 x)) · (y + 1)``; ggml's (libm's expf, its
    order) under llama.cpp's numerics (``pp_swiglu_oai``)."""
    c = ggml_numerics.library(g)
    if c is not None:
        g, u = g.contiguous(), u.float().contiguous()
        out = torch.empty_like(g)
        c.pp_swiglu_oai(g.data_ptr(), u.data_ptr(), g.numel(), out.data_ptr())
        return out
    x, y = g.clamp(max=OAI_LIMIT), u.clamp(-OAI_LIMIT, OAI_LIMIT)
    return x / (1 + torch.exp(-OAI_ALPHA * x)) * (y + 1)


def cut(ex, h: Tensor, w: Tensor, tau: Tensor, idx: Tensor | None = None) -> Tensor:
    """The MoE cut, in place: h (T, n) one expert's activations (or with idx (n,) the layer's
    neuron ids of n routed ones, one expert per ``ex.cut_group`` neurons), w (T,) their
    routing weights, tau the layer's per-neuron cut (``ffn.cut_taus``). A group of
    ``ex.cut_group`` neurons is zeroed when ``w · Σ_j |h_j| / tau_j < 1``: its share of the
    output, ``w · Σ_j |h_j| · ‖down column j‖``, is below the layer's threshold. The sums in
    neuron order in C (``pp_moe_cut``, the decode block's), else torch's."""
    T, n, g = h.shape[0], h.shape[1], ex.cut_group
    tau = tau if idx is None else tau[idx]
    lib = kernels.library() if numerics.current().native else None
    if lib is not None and h.is_contiguous() and h.dtype == torch.float32 and n % g == 0:
        w, tau = as_f32(w), as_f32(tau)
        lib.cdll.pp_moe_cut(h.data_ptr(), T, n, g, w.data_ptr(), tau.data_ptr(), None)
        return h
    q = torch.where(tau > 0, h.abs() * w[:, None] / tau, torch.where(h != 0, torch.inf, 0.0))
    keep = q.view(T, -1, g).sum(-1) >= 1.0  # (T, n / g)
    return h.mul_(keep.repeat_interleave(g, dim=1))


def cut_hot(h: Tensor, tau: Tensor, bucket: Tensor, g: int, n_neurons: int) -> Tensor:
    """The cut of the hot neurons on the accelerator: h (T, k) already weighted, tau (k,) and
    bucket (k,) their cut and neuron ids; a group of g neuron ids is scored over its hot
    members (its cold ones are the host's), no host sync."""
    q = torch.where(tau > 0, h.abs() / tau, torch.where(h != 0, torch.inf, 0.0))
    gid = bucket // g
    score = q.new_zeros(h.shape[0], n_neurons // g).index_add_(1, gid, q)
    return h.mul_(score.index_select(1, gid) >= 1.0)


def _act(ex, g: Tensor, u: Tensor, rows: Tensor | slice) -> Tensor:
    """An expert layer's activation of its gate and up products g, u (T, n) of neurons
    ``rows`` (ids among n_expert · n_ff), their biases added first."""
    if ex.up_b is not None:
        u = u + ex.up_b.reshape(-1)[rows]
    if ex.gate_b is not None:
        g = g + ex.gate_b.reshape(-1)[rows]
    if ex.act == "swiglu_oai":
        return swiglu_oai(g, u)
    return glu(g, u, SWIGLU, inplace=True)


def experts_host(
    l: int,
    ex,
    x: Tensor,
    ids: Tensor,
    w: Tensor,
    tau: Tensor | None,
    opts: RunOptions,
    cold: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The routed experts on the host: x (T, n_embd), ids and w (T, k), tau (n_expert · n_ff,)
    or None, cold (n_expert · n_ff,) bool or None (every neuron) -> ((T, n_embd) f32, (T,)
    int64 neurons whose down column was added). Tokens are grouped by expert; each expert's
    output is weighted, then the k outputs of a token are added in routing order. An observer
    sees, and an oracle chooses from, ``w_i · h`` of every neuron (0 where not routed). With
    hot rows on an accelerator (``cold``), each routed expert's down bias is added here."""
    T, k = ids.shape
    if T == 1 and cold is None and opts.observer is None and opts.oracle is None:
        return _one_token(ex, x[0], ids[0], w[0], tau)
    parts = []  # (expert, tokens, slots, h (T_e, n_ff), weights (T_e,))
    for e in torch.unique(ids).tolist():
        mask = None if cold is None else cold[ex.rows(e)]  # (n_ff,) this expert's cold neurons
        t, s = (ids == e).nonzero(as_tuple=True)  # tokens routing to e, and their slots
        if mask is not None and not bool(mask.any()):
            parts.append((e, t, s, None, w[t, s]))  # every neuron of e is hot: its bias alone
            continue
        gate, up, _ = ex.expert(e)
        x8 = ex.x8(e)
        if x8[1] is not None and mask is None:  # interleaved: every token by the GEMV
            h = _x8_glu(ex, e, x8, x.index_select(0, t))
        else:
            h = _activations(ex, e, x, gate, up, t, mask)  # (T_e, n_ff) f32
        we = w[t, s]
        if tau is not None:
            h = cut(ex, h.contiguous(), we, tau[ex.rows(e)])
        parts.append((e, t, s, h, we))
    if opts.observer is not None or opts.oracle is not None:
        full = x.new_zeros(T, ex.n_neurons)  # (T, n_expert · n_ff)
        for e, t, _, h, we in parts:
            if h is not None:
                full[t, ex.rows(e)] += h * we[:, None]
        if opts.observer is not None:
            opts.observer(l, x, full)
        if opts.oracle is not None:
            keep = opts.oracle(l, full)  # (T, n_expert · n_ff) bool
            for e, t, _, h, _ in parts:
                if h is not None:
                    h.mul_(keep[t, ex.rows(e)])
    outs = x.new_zeros(T, k, ex.n_embd)
    kept = torch.zeros(T, dtype=torch.int64)
    for e, t, s, h, we in parts:
        if h is None:  # all hot: the down bias (the device adds the rows' products)
            if ex.down_b is not None:
                outs[t, s] = ex.down_b[e].expand(len(t), -1) * we[:, None]
            continue
        kept.index_add_(0, t, (h != 0).sum(1))
        outs[t, s] = _down(ex, e, h) * we[:, None]
    y = outs[:, 0]
    for i in range(1, k):
        y = y + outs[:, i]
    return y, kept


def _one_token(ex, x: Tensor, ids: Tensor, w: Tensor, tau: Tensor | None) -> tuple[Tensor, Tensor]:
    """A decode step: x (n_embd,), ids and w (k,) -> ((1, n_embd), (1,) kept). The routed
    experts' gate and up rows in one fused native call (plain SwiGLU experts), then one down
    product per expert."""
    es = ids.tolist()
    idx = torch.cat([ex.neurons(e) for e in es])  # (k · n_ff,)
    if ex.x8(0)[1] is not None:  # interleaved: each expert's whole gate and up
        h = torch.cat([_x8_glu(ex, e, ex.x8(e), x[None])[0] for e in es])
    elif ex.plain:
        h = glu_rows(x, ex.gate, ex.up, idx, SWIGLU)  # (k · n_ff,)
    else:
        g, u = ex.gate.gather_linear(x, idx), ex.up.gather_linear(x, idx)
        h = _act(ex, g, u, idx)
    ff = ex.n_ff
    if tau is not None:  # each expert's groups (cut), then down products of the kept ones
        h = h.contiguous()
        for i, e in enumerate(es):
            cut(ex, h[i * ff : (i + 1) * ff][None], w[i : i + 1], tau[ex.rows(e)])
    y = None
    for i, e in enumerate(es):
        h_e = h[i * ff : (i + 1) * ff][None]
        y_e = (_down(ex, e, h_e) if tau is None else _down_runs(ex, e, h_e)).mul_(w[i])
        y = y_e if y is None else y + y_e
    kept = int((h != 0).sum()) if tau is not None else h.numel()
    return y, torch.tensor([kept])


def _x8_glu(ex, e: int, x8: tuple, x: Tensor) -> Tensor:
    """The activation of expert e's interleaved (library, gate, up, ...) products of x."""
    g, u = x8[0].gemm(x8[1], x), x8[0].gemm(x8[2], x)
    return glu(g, u, SWIGLU, inplace=True) if ex.plain else _act(ex, g, u, ex.rows(e))


def _down(ex, e: int, h: Tensor) -> Tensor:
    """Expert e's down product (plus its bias): h (T, n_ff) -> (T, n_embd) f32."""
    lib, _, _, m = ex.x8(e)
    y = ex.expert(e)[2].linear(h) if m is None else lib.gemm(m, h)
    return y if ex.down_b is None else y.add_(ex.down_b[e])


def _down_runs(ex, e: int, h: Tensor) -> Tensor:
    """Expert e's down product (plus its bias) under a cut: h (1, n_ff) -> (1, n_embd) f32,
    reading only the blocks of its kept groups in the stored down matrix (``pp_down_runs``;
    without the native kernels, :func:`_down`)."""
    down = ex.expert(e)[2]
    k = down.kernel() if numerics.current().native else None
    if k is None:
        return _down(ex, e, h)
    y = k[0].down_runs(k[1], h)
    return y if ex.down_b is None else y.add_(ex.down_b[e])


def _activations(
    ex, e: int, x: Tensor, gate: Weight, up: Weight, t: Tensor, mask: Tensor | None
) -> Tensor:
    """h of expert e for tokens t: (T_e, n_ff) f32 (0 where ``mask`` is False). One plain
    token reads only its rows in one fused native call (the cold ones with ``mask``)."""
    if t.numel() == 1 and ex.plain:
        idx = torch.arange(gate.shape[0]) if mask is None else mask.nonzero().squeeze(1)
        h = glu_rows(x[t[0]], gate, up, idx, SWIGLU)
        if mask is None:
            return h[None]
        out = h.new_zeros(1, gate.shape[0])
        out[0, idx] = h
        return out
    xe = x.index_select(0, t)
    g, u = gate.linear(xe), up.linear(xe)
    h = glu(g, u, SWIGLU, inplace=True) if ex.plain else _act(ex, g, u, ex.rows(e))
    return h if mask is None else h.mul_(mask)
