"""A mixture-of-experts FFN (Mixtral, Qwen3-MoE, Qwen2-MoE) as llama.cpp's ``build_moe_ffn``
computes it: the router, the routed experts only, the cut inside them, hot rows on an
accelerator, and a shared expert.

For one token x (n_embd,), the FFN input after ffn_norm (docs/moe.md):

    p   = softmax(ffn_gate_inp · x)              (n_expert,), ggml's soft_max
    E   = the k = n_expert_used experts of largest p, largest first (ties: lower id first)
    w_i = p[E_i] / max(Σ_i p[E_i], 2^-14)        renormalized (expert_weights_norm), · scale
    h_e = silu(gate_e · x) · (up_e · x)          (n_ff,) for each routed expert e
    y   = Σ_i w_i · (down_e · h_{E_i})           summed in routing order, as llama.cpp adds

Only the routed experts' rows are read. Each expert's matrices are views of the file's 3-D
tensors (``Experts.gate`` etc. hold them flattened, ``(n_expert · rows, cols)``), so quantized
blocks stay raw and run in the native kernels. Neuron j of expert e is neuron ``e · n_ff + j``
of the layer: statistics, the cut and placements count ``n_expert · n_ff`` neurons.

A shared expert (qwen2moe; ``Block.ffn_*_shexp``) adds, for every token,
``sigmoid(ffn_gate_inp_shexp · x) · (down_s · (silu(gate_s · x) · (up_s · x)))`` to y.

The cut (``powerpy.ffn_down_threshold``) drops neuron j of a routed expert when its share of
the output is small, ``w_i · |h_j| · ‖down_e[:, j]‖ < t``: ``tau = t / ‖down_e[:, j]‖`` per neuron.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from powerpy.config import FFNVariant
from powerpy.model import ggml_numerics, interleave, layer_record, numerics
from powerpy.model.biased import row_slices
from powerpy.model.device import HOST, Accelerator, OnDevices, move
from powerpy.model.ffn import glu, glu_rows, rows_sum, scaled_cut
from powerpy.model.kernels import RECORD_FLAGS, RECORD_SLOTS, Matrix, act_code, as_f32
from powerpy.model.matrices import DenseWeight, Weight
from powerpy.model.options import RunOptions
from powerpy.model.timing import phase

SWIGLU = FFNVariant.SWIGLU
F16_TINY = 6.103515625e-5  # llama.cpp clamps the weights' sum to the smallest normal f16


@dataclass
class ExpertHot:
    """One layer's hot expert neurons on the accelerator (docs/moe.md#placement).

    Attributes:
        k: hot neurons (> 0), ids over ``n_expert · n_ff``.
        gate, up: ``(k, n_embd)`` their rows of the stacked gate and up matrices (raw rows).
        down_t: ``(k, n_embd)`` their columns of the down matrices as rows (float).
        bucket: ``(k,)`` int64 on the device: the neuron id of each row.
        cold: ``(n_expert · n_ff,)`` bool on the host, True where the neuron stays on the CPU.
        per_expert: ``(n_expert,)`` int64 on the host, hot neurons of each expert.
        tau: ``(k,)`` f32 on the device, the cut of each hot neuron, or None.
    """

    k: int
    gate: Weight
    up: Weight
    down_t: Weight
    bucket: Tensor
    cold: Tensor
    per_expert: Tensor
    tau: Tensor | None = None

    @property
    def device_bytes(self) -> int:
        return sum(m.nbytes for m in (self.gate, self.up, self.down_t))

    @property
    def index_bytes(self) -> int:
        return self.bucket.numel() * self.bucket.element_size()


@dataclass
class Experts:
    """One layer's mixture of experts.

    Attributes:
        router: ``ffn_gate_inp`` (n_expert, n_embd).
        gate, up: the stacked expert matrices (n_expert · n_ff, n_embd): expert e's rows are
            ``e · n_ff .. (e + 1) · n_ff`` (views of the file's (n_expert, n_ff, n_embd)).
        down: the stacked down matrices as stored (n_expert · n_embd, n_ff): expert e's
            (n_embd, n_ff) are rows ``e · n_embd ..``.
        n_used: experts routed per token (k).
        norm: renormalize the k weights to sum to 1; scale: a factor on them (0 or 1: none).
        tau: (n_expert · n_ff,) f32 on the host, the cut per neuron, or None.
        hot: hot neurons on an accelerator, or None.
    """

    router: Weight
    gate: Weight
    up: Weight
    down: Weight
    n_used: int
    norm: bool = True
    scale: float = 0.0
    tau: Tensor | None = None
    hot: ExpertHot | None = None
    _views: list = field(default_factory=list, repr=False)  # per expert (gate, up, down)
    _ids: Tensor | None = field(default=None, repr=False)  # (n_expert, n_ff) neuron ids
    _x8: tuple | None = field(default=None, repr=False)  # interleaved()'s result
    _row: tuple | None = field(default=None, repr=False)  # (shared gate row, its (1, n_embd))

    @property
    def n_expert(self) -> int:
        return self.router.shape[0]

    @property
    def n_embd(self) -> int:
        return self.router.shape[1]

    @property
    def n_ff(self) -> int:
        return self.gate.shape[0] // self.n_expert

    @property
    def n_neurons(self) -> int:
        return self.gate.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in (self.router, self.gate, self.up, self.down))

    def expert(self, e: int) -> tuple[Weight, Weight, Weight]:
        """Expert e's (gate (n_ff, n_embd), up (n_ff, n_embd), down (n_embd, n_ff)): views."""
        if not self._views:
            n, ff, d = self.n_expert, self.n_ff, self.n_embd
            g, u = row_slices(self.gate, (ff,) * n), row_slices(self.up, (ff,) * n)
            self._views.extend(zip(g, u, row_slices(self.down, (d,) * n), strict=True))
        return self._views[e]

    def neurons(self, e: int) -> Tensor:
        """Expert e's neuron ids among the layer's ``n_expert · n_ff``: (n_ff,) int64."""
        if self._ids is None:
            self._ids = torch.arange(self.n_neurons).view(self.n_expert, self.n_ff)
        return self._ids[e]

    def rows(self, e: int) -> slice:
        """Expert e's neurons among the layer's ``n_expert · n_ff``."""
        return slice(e * self.n_ff, (e + 1) * self.n_ff)

    def interleaved(self) -> tuple:
        """(library, gate, up, down): the Q4_K and Q4_0 stacks interleaved as llama.cpp repacks
        them (``interleave``; None: a stack that keeps its rows, gate and up alike), built once."""
        if self._x8 is None and (k := self.gate.kernel()) is not None:
            mats = []
            for m, step in ((self.gate, self.n_ff), (self.up, self.n_ff), (self.down, self.n_embd)):
                dk = interleave.dense_kernel(m) if step % 8 == 0 else None
                ok = dk is not None and dk[1].code in interleave.STACKS
                mats.append(dk[1] if ok else None)
            if (mats[0] is None) != (mats[1] is None):
                mats[:2] = [None, None]
            self._x8 = (k[0], *mats)
        return self._x8 or (None, None, None, None)

    def x8(self, e: int) -> tuple:
        """(library, gate, up, down) of expert e from :meth:`interleaved` (all None in a call
        without the native kernels or llama.cpp's rounding)."""
        num = numerics.current()
        if not (num.native and num.quantized_activations):
            return (None, None, None, None)
        lib, *mats = self.interleaved()
        rows = (self.n_ff, self.n_ff, self.n_embd)
        subs = (m and interleave.expert_rows(m, e * n, n) for m, n in zip(mats, rows, strict=True))
        return (lib, *subs)

    def down_norms(self, chunk: int = 256) -> Tensor:
        """‖down_e[:, j]‖ of every neuron: (n_expert · n_ff,) f32, ``chunk`` rows of one
        expert decoded at a time (a whole expert in f32 can take hundreds of MB)."""
        sq = torch.zeros(self.n_expert, self.n_ff, dtype=torch.float64)
        for s in range(0, self.down.shape[0], chunk):
            rows = torch.arange(s, min(s + chunk, self.down.shape[0]))
            part = self.down.take_rows(rows).dequantize().double().square_()  # (n, n_ff)
            sq.index_add_(0, rows // self.n_embd, part)
        return sq.sqrt_().float().reshape(-1)


def cut_taus(ex: Experts, t: float) -> Tensor:
    """A layer's cut per neuron, (n_expert · n_ff,) f32 ``t / ‖down_e[:, j]‖`` (inf for an
    all-zero column, which adds nothing)."""
    n = ex.down_norms()
    return torch.where(n > 0, t / n, torch.inf).float()


# ----------------------------------------------------------------------------------- routing
def softmax(logits: Tensor) -> Tensor:
    """ggml's soft_max of each row: exp(x - max) with ggml's exp, the sum in double, then one
    f32 multiply by 1/sum. logits (T, n) f32 -> (T, n) f32."""
    c = ggml_numerics.library(logits)
    if c is not None and logits.dim() == 2:
        return ggml_numerics.soft_max(c, logits)
    e = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
    return e * (1.0 / e.double().sum(dim=1, keepdim=True)).float()


def router_logits(router: Weight, x: Tensor) -> Tensor:
    """``router · x``: x (T, n_embd) -> (T, n_expert) f32. With llama.cpp's numerics an f32
    router (llama.cpp's converters keep it f32) sums in the order of llama.cpp's f32 matmuls:
    its logits decide the routing, so 1-ulp differences would move whole experts."""
    c = ggml_numerics.library(x)
    if c is not None and isinstance(router, DenseWeight) and router.w.dtype == torch.float32:
        out = ggml_numerics.gemm_f32(c, router.w, x)
        if out is not None:
            return out
    return router.linear(x)


def route(ex: Experts, x: Tensor) -> tuple[Tensor, Tensor]:
    """The routed experts of each token: x (T, n_embd) -> ids (T, k) int64 (largest
    probability first, ties to the lower id) and weights (T, k) f32, on the router's device."""
    p = softmax(router_logits(ex.router, x))  # (T, n_expert)
    ids = torch.sort(p, dim=1, descending=True, stable=True).indices[:, : ex.n_used]
    w = p.gather(1, ids)
    if ex.norm:  # ggml_sum_rows sums in double
        w = w / w.double().sum(dim=1, keepdim=True).float().clamp_min(F16_TINY)
    if ex.scale not in (0.0, 1.0):
        w = w * ex.scale
    return ids, w


def spread(ex: Experts, ids: Tensor, w: Tensor) -> Tensor:
    """Each neuron's routing weight: ids, w (T, k) -> (T, n_expert · n_ff) f32, 0 for the
    neurons of experts a token does not route to (on the tensors' device, no host sync)."""
    per_expert = w.new_zeros(ids.shape[0], ex.n_expert)
    per_expert.scatter_(1, ids, w)
    return per_expert.repeat_interleave(ex.n_ff, dim=1)


def shared_expert(blk, x: Tensor, accel: Accelerator | None) -> Tensor | None:
    """A layer's shared expert (qwen2moe, llama.cpp's ``ffn_shexp``): x (T, n_embd) the normed
    FFN input -> (T, n_embd) f32 on x's device, computed where its matrices are; None without
    one. Its gate is llama.cpp's silu(g) / g (``ggml_numerics.silu_div``), g summed as an f32
    router's logits are."""
    if blk.ffn_up_shexp is None:
        return None
    xs = move(accel, x, blk.ffn_up_shexp.device)
    h = glu(blk.ffn_gate_shexp.linear(xs), blk.ffn_up_shexp.linear(xs), SWIGLU, inplace=True)
    y = blk.ffn_down_shexp.linear(h)  # (T, n_embd)
    w = blk.ffn_gate_inp_shexp.float()[None]  # (1, n_embd)
    g = router_logits(DenseWeight(w), move(accel, xs, w.device))  # (T, 1)
    c = ggml_numerics.library(g)
    sig = ggml_numerics.silu_div(c, g) if c is not None else torch.sigmoid(g)
    return move(accel, y.mul_(move(accel, sig, y.device)), x.device)


# ----------------------------------------------------------------------------------- the FFN
def moe_ffn(l: int, ex: Experts, x: Tensor, opts: RunOptions, accel: Accelerator | None) -> Tensor:
    """The layer's mixture: x (T, n_embd) the normed FFN input (any device) -> (T, n_embd) f32
    on x's device. CPU-only without a cut it is llama.cpp's computation, step for step; hot
    rows run on the accelerator and the CPU adds the routed cold neurons (docs/moe.md)."""
    with phase(opts.timer, "router"):
        ids, w = route(ex, move(accel, x, ex.router.device))  # (T, k)
    tau = scaled_cut(ex.tau, opts)
    plain = opts.observer is None and opts.oracle is None
    y_hot = None
    if ex.hot is not None and plain:
        y_hot = _hot(ex, x, ids, w, accel, scaled_cut(ex.hot.tau, opts), opts)
    with phase(opts.timer if accel is not None else None, "wait"):
        x_h, ids_h, w_h = _to_host(accel, [x, ids, w])  # one wait for the device's
    cold = ex.hot.cold if y_hot is not None else None
    with phase(opts.timer if y_hot is not None else None, "ffn_cold"):
        y, kept = experts_host(l, ex, x_h, ids_h, w_h, tau, opts, cold)
    if opts.stats is not None:  # a hybrid adds its routed hot neurons (cut or not)
        hot = 0 if y_hot is None else ex.hot.per_expert[ids_h].sum(1)
        opts.stats.record_counts(l, kept + hot)
    if y_hot is None:
        return move(accel, y, x.device)
    accel.join(y_hot)
    return (
        y_hot + accel.move(y, y_hot.device)
        if y_hot.device == x.device
        else (accel.move(y_hot, x.device) + y)
    )


def mixture(l: int, blk, x: Tensor, opts: RunOptions, accel: Accelerator | None) -> Tensor:
    """A mixture-of-experts layer's FFN: x (T, n_embd) the normed FFN input -> the routed
    experts' sum (:func:`moe_ffn`) plus its shared expert's output where it has one
    (:func:`shared_expert`, added as llama.cpp adds it), (T, n_embd) f32 on x's device."""
    y = moe_ffn(l, blk.moe, x, opts, accel)
    shared = shared_expert(blk, x, accel)
    return y if shared is None else y.add_(shared)


def _to_host(accel: Accelerator | None, ts: list[Tensor]) -> list[Tensor]:
    """The tensors on the host, with one wait for those on the device."""
    on_dev = [t for t in ts if t.device != HOST]
    if not on_dev:
        return ts
    assert accel is not None
    got = iter(accel.fetch(on_dev))
    return [next(got) if t.device != HOST else t for t in ts]


def moe_kernels(blk, opts: RunOptions):
    """(library, [router, gate, up, down, a shared expert's gate row, gate, up, down or 4 None]
    matrices, tau) for the native MoE block of a decode step (``pp_moe_decode``); None for hot
    rows, profiling, an oracle, f32 activations (it computes llama.cpp's numerics), a norm or
    matrix the kernels cannot read or placed on an accelerator."""
    ex: Experts | None = blk.moe
    if ex is None or ex.hot is not None or opts.observer is not None or opts.oracle is not None:
        return None
    norm_b, post = blk.ffn_norm_b, getattr(blk, "post_ffw_norm", None)
    if blk.ffn_norm is None or norm_b is not None or post is not None:
        return None
    if blk.ffn_norm.device.type != "cpu" or not opts.numerics.quantized_activations:
        return None
    mats = [ex.router, ex.gate, ex.up, ex.down]
    if blk.ffn_up_shexp is not None:
        if ex._row is None or ex._row[0] is not blk.ffn_gate_inp_shexp:  # built once
            ex._row = (blk.ffn_gate_inp_shexp, DenseWeight(as_f32(blk.ffn_gate_inp_shexp)[None]))
        mats += [ex._row[1], blk.ffn_gate_shexp, blk.ffn_up_shexp, blk.ffn_down_shexp]
    kerns = [m.kernel() for m in mats[:4]] + [interleave.dense_kernel(m) for m in mats[4:]]
    if None in kerns:
        return None
    x8 = ex.interleaved()[1:]  # the stacks interleaved, or None
    kerns[1:4] = [k if m is None else (k[0], m) for k, m in zip(kerns[1:4], x8, strict=True)]
    codes = [k[1].code for k in kerns]
    if codes[1] != codes[2] or codes[5:7] and codes[5] != codes[6]:  # each GLU's gate and up
        return None
    return kerns[0][0], [k[1] for k in kerns] + [None] * (8 - len(kerns)), scaled_cut(ex.tau, opts)


def moe_part(blk, a, opts: RunOptions) -> layer_record.Part | None:
    """The FFN half of a mixture of experts' layer record for the stack plan (``layer_record``,
    flag "moe"): the router in fc1's slot, the gate, up and down stacks, a shared expert's
    matrices, the FFN norm, the cut, and the routing (experts per token, renormalised weights,
    the weights' scale); None where the native block does not apply (:func:`moe_kernels`)."""
    kern = moe_kernels(blk, opts)
    if kern is None:
        return None
    lib, mats, tau = kern
    p = layer_record.Part(lib, flags=layer_record.layout_flags(a) | RECORD_FLAGS["moe"])
    ffn = RECORD_SLOTS["ffn"]
    sh = RECORD_SLOTS["shexp"]
    slots = (ffn, ffn + 10, ffn + 15, ffn + 20, sh, sh + 5, sh + 10, sh + 15)
    for slot, m in zip(slots, mats, strict=True):
        if m is not None:
            p.matrix(slot, m)
    if not (p.vec(RECORD_SLOTS["ffn_norm"], blk.ffn_norm) and p.vec(RECORD_SLOTS["tau"], tau)):
        return None
    ex, at = blk.moe, RECORD_SLOTS["moe"]
    p.slots[at], p.slots[at + 1] = ex.n_used, int(ex.norm)
    p.f32(at + 2, ex.scale)
    return p


def moe_decode(l: int, blk, x: OnDevices, a, thr: float, opts: RunOptions) -> Tensor | None:
    """A decode step's whole MoE block on the host (ffn_norm, router, routed experts, cut, shared
    expert, residual) in one native call: x the residual stream -> x + FFN (1, n_embd) on the host;
    None where it does not apply (:func:`moe_kernels`). The same bits as :func:`moe_ffn`."""
    kern = moe_kernels(blk, opts)
    if kern is None:
        return None
    lib, mats, tau = kern
    ex = blk.moe
    r, w = as_f32(x(HOST)[0]), as_f32(blk.ffn_norm)  # (n_embd,) the residual, the norm
    tau = None if tau is None else as_f32(tau)
    y = torch.empty(r.numel(), dtype=torch.float32)
    kept = lib.cdll.pp_moe_decode(
        Matrix.pack(mats), ex.n_used, int(ex.norm), ex.scale, 0 if tau is None else tau.data_ptr(),
        r.data_ptr(), w.data_ptr(), a.norm_eps, y.data_ptr(), None, None, act_code(),
        torch.get_num_threads(),
    )  # fmt: skip
    if kept < 0:
        raise ValueError(f"moe_decode: invalid arguments (status {-kept})")
    if opts.stats is not None:
        opts.stats.record_count(l, kept)
    return y[None]


def experts_host(
    l: int,
    ex: Experts,
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
    sees, and an oracle chooses from, ``w_i · h`` of every neuron (0 where not routed)."""
    T, k = ids.shape
    if T == 1 and cold is None and opts.observer is None and opts.oracle is None:
        return _one_token(ex, x[0], ids[0], w[0], tau)
    parts = []  # (expert, tokens, slots, h (T_e, n_ff), weights (T_e,))
    for e in torch.unique(ids).tolist():
        mask = None if cold is None else cold[ex.rows(e)]  # (n_ff,) this expert's cold neurons
        if mask is not None and not bool(mask.any()):
            continue  # every neuron of e is hot
        t, s = (ids == e).nonzero(as_tuple=True)  # tokens routing to e, and their slots
        gate, up, _ = ex.expert(e)
        x8 = ex.x8(e)
        if x8[1] is not None and mask is None:  # interleaved: every token by the GEMV
            h = _x8_glu(x8, x.index_select(0, t))
        else:
            h = _activations(x, gate, up, t, mask)  # (T_e, n_ff) f32
        we = w[t, s]
        if tau is not None:
            h.masked_fill_(h.abs() * we[:, None] < tau[ex.rows(e)], 0.0)
        parts.append((e, t, s, h, we))
    if opts.observer is not None or opts.oracle is not None:
        full = x.new_zeros(T, ex.n_neurons)  # (T, n_expert · n_ff)
        for e, t, _, h, we in parts:
            full[t, ex.rows(e)] += h * we[:, None]
        if opts.observer is not None:
            opts.observer(l, x, full)
        if opts.oracle is not None:
            keep = opts.oracle(l, full)  # (T, n_expert · n_ff) bool
            for e, t, _, h, _ in parts:
                h.mul_(keep[t, ex.rows(e)])
    outs = x.new_zeros(T, k, ex.n_embd)
    kept = torch.zeros(T, dtype=torch.int64)
    for e, t, s, h, we in parts:
        kept.index_add_(0, t, (h != 0).sum(1))
        outs[t, s] = _down(ex, e, h) * we[:, None]
    y = outs[:, 0]
    for i in range(1, k):
        y = y + outs[:, i]
    return y, kept


def _one_token(
    ex: Experts, x: Tensor, ids: Tensor, w: Tensor, tau: Tensor | None
) -> tuple[Tensor, Tensor]:
    """A decode step: x (n_embd,), ids and w (k,) -> ((1, n_embd), (1,) kept). The routed
    experts' gate and up rows in one fused native call, then one down product per expert."""
    es = ids.tolist()
    idx = torch.cat([ex.neurons(e) for e in es])  # (k · n_ff,)
    if ex.x8(0)[1] is not None:  # interleaved: each expert's whole gate and up
        h = torch.cat([_x8_glu(ex.x8(e), x[None])[0] for e in es])
    else:
        h = glu_rows(x, ex.gate, ex.up, idx, SWIGLU)  # (k · n_ff,)
    ff = ex.n_ff
    if tau is not None:
        h.masked_fill_(h.abs() * w.repeat_interleave(ff) < tau[idx], 0.0)
    y = None
    for i, e in enumerate(es):
        y_e = _down(ex, e, h[i * ff : (i + 1) * ff][None]).mul_(w[i])  # (1, n_embd)
        y = y_e if y is None else y + y_e
    kept = int((h != 0).sum()) if tau is not None else h.numel()
    return y, torch.tensor([kept])


def _x8_glu(x8: tuple, x: Tensor) -> Tensor:
    """silu(gate · x) · (up · x) of an expert's interleaved (library, gate, up, ...)."""
    return glu(x8[0].gemm(x8[1], x), x8[0].gemm(x8[2], x), SWIGLU, inplace=True)


def _down(ex: Experts, e: int, h: Tensor) -> Tensor:
    """Expert e's down product: h (T, n_ff) -> (T, n_embd) f32."""
    lib, _, _, m = ex.x8(e)
    return ex.expert(e)[2].linear(h) if m is None else lib.gemm(m, h)


def _activations(x: Tensor, gate: Weight, up: Weight, t: Tensor, mask: Tensor | None) -> Tensor:
    """h = silu(gate · x) · (up · x) of one expert for tokens t: (T_e, n_ff) f32. One token
    reads only its rows in one fused native call (the cold ones when ``mask`` is given)."""
    if t.numel() == 1:
        idx = torch.arange(gate.shape[0]) if mask is None else mask.nonzero().squeeze(1)
        h = glu_rows(x[t[0]], gate, up, idx, SWIGLU)
        if mask is None:
            return h[None]
        out = h.new_zeros(1, gate.shape[0])
        out[0, idx] = h
        return out
    xe = x.index_select(0, t)
    h = glu(gate.linear(xe), up.linear(xe), SWIGLU, inplace=True)
    return h if mask is None else h.mul_(mask)


def _hot(
    ex: Experts,
    x: Tensor,
    ids: Tensor,
    w: Tensor,
    accel: Accelerator,
    tau: Tensor | None,
    opts: RunOptions,
) -> Tensor:
    """The hot neurons' part on the accelerator's side stream (queued, no host sync): every
    hot row is computed and weighted by its expert's routing weight (0 unless routed)."""
    hot = ex.hot
    assert hot is not None
    x_d, ids_d, w_d = (accel.move(t, accel.device) for t in (x, ids, w))
    with accel.side_stream(x_d, ids_d, w_d, tau), phase(opts.timer, "ffn_hot"):
        scale = spread(ex, ids_d, w_d).index_select(1, hot.bucket)  # (T, k_hot)
        h = glu(hot.gate.linear(x_d), hot.up.linear(x_d), SWIGLU, inplace=True).mul_(scale)
        if tau is not None:
            h = h.masked_fill_(h.abs() < tau, 0.0)
        return rows_sum(h, hot.down_t)
