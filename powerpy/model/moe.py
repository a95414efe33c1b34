"""A mixture-of-experts FFN (Mixtral, Qwen3-MoE, Qwen2-MoE, GLM-4.5) as llama.cpp's
``build_moe_ffn`` computes it: the router, the routed experts only, the cut inside them, hot
rows on an accelerator, and a shared expert.

For one token x (n_embd,), the FFN input after ffn_norm (docs/moe.md):

    E, w = the k = n_expert_used routed experts and their weights   (``routing.route``)
    h_e = silu(gate_e · x) · (up_e · x)          (n_ff,) for each routed expert e
    y   = Σ_i w_i · (down_e · h_{E_i})           summed in routing order, as llama.cpp adds

Only the routed experts' rows are read. Each expert's matrices are views of the file's 3-D
tensors (``Experts.gate`` etc. hold them flattened, ``(n_expert · rows, cols)``), so quantized
blocks stay raw and run in the native kernels. Neuron j of expert e is neuron ``e · n_ff + j``
of the layer: statistics, the cut and placements count ``n_expert · n_ff`` neurons.

A shared expert (``Block.ffn_*_shexp``) adds, for every token,
``down_s · (silu(gate_s · x) · (up_s · x))`` to y, scaled by ``sigmoid(ffn_gate_inp_shexp · x)``
where it has that gate (qwen2moe).

The cut (``powerpy.ffn_down_threshold``) drops neuron j of a routed expert when its share of
the output is small, ``w_i · |h_j| · ‖down_e[:, j]‖ < t``: ``tau = t / ‖down_e[:, j]‖`` per neuron.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from powerpy.config import FFNVariant
from powerpy.formats.constants import GGMLType
from powerpy.model import ggml_numerics, interleave, layer_record, numerics
from powerpy.model.biased import row_slices
from powerpy.model.device import HOST, Accelerator, OnDevices, move
from powerpy.model.ffn import glu, scaled_cut
from powerpy.model.kernels import RECORD_FLAGS, Matrix, RecRoute, act_code, as_f32
from powerpy.model.matrices import DenseWeight, Weight
from powerpy.model.moe_host import cut_hot, experts_host, swiglu_oai
from powerpy.model.options import RunOptions
from powerpy.model.routing import Routing, route, router_logits, softmax, spread
from powerpy.model.split import run_split
from powerpy.model.timing import phase

SWIGLU = FFNVariant.SWIGLU
__all__ = [
    "ExpertHot",
    "Experts",
    "Routing",
    "mixture",
    "placed_dense",
    "route",
    "router_logits",
    "softmax",
]


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
        gate_b, up_b: ``(k,)`` f32 on the device, the hot rows' gate and up biases (GPT-OSS).
        per_expert_dev: ``per_expert`` on the device (a device step's statistics).
        n_cold: neurons left on the host.
    """

    k: int
    gate: Weight
    up: Weight
    down_t: Weight
    bucket: Tensor
    cold: Tensor
    per_expert: Tensor
    tau: Tensor | None = None
    gate_b: Tensor | None = None
    up_b: Tensor | None = None
    per_expert_dev: Tensor | None = None
    n_cold: int = 0

    @property
    def device_bytes(self) -> int:
        biases = [b for b in (self.gate_b, self.up_b) if b is not None]
        return sum(m.nbytes for m in (self.gate, self.up, self.down_t)) + 4 * sum(
            b.numel() for b in biases
        )

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
        routing: how the router's logits choose the experts (``routing.Routing``).
        act, gate_b, up_b, down_b: the experts' activation and biases (see the fields).
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
    routing: Routing = field(default_factory=Routing)
    act: str = "swiglu"  # or "swiglu_oai" (GPT-OSS: moe_host.swiglu_oai)
    gate_b: Tensor | None = None  # (n_expert, n_ff) f32 the experts' biases (GPT-OSS), or None
    up_b: Tensor | None = None  # (n_expert, n_ff)
    down_b: Tensor | None = None  # (n_expert, n_embd)
    _views: list = field(default_factory=list, repr=False)  # per expert (gate, up, down)
    _ids: Tensor | None = field(default=None, repr=False)  # (n_expert, n_ff) neuron ids
    _x8: tuple | None = field(default=None, repr=False)  # interleaved()'s result
    _row: tuple | None = field(default=None, repr=False)  # (shared gate row, its (1, n_embd))

    @property
    def n_expert(self) -> int:
        return self.router.shape[0]

    @property
    def plain(self) -> bool:
        """SwiGLU experts without biases (every family but GPT-OSS): one fused gate/up pass."""
        return self.act == "swiglu" and self.gate_b is None and self.up_b is None

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

    @property
    def cut_group(self) -> int:
        """Neurons the cut keeps or drops together: one block of the down stack's type (a
        K-quant's 256, else 32), so a cut group is a block not read in every row of the
        stored down matrix (``moe_host.cut``, ``csrc/moe.h`` ``cut_groups``)."""
        t = getattr(self.down, "ggml_type", None)
        return 256 if t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else 32

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
        """(library, gate, up, down): the Q4_K, Q4_0 and MXFP4 stacks interleaved as llama.cpp
        repacks them (``interleave``; None: a stack that keeps its rows, gate and up alike),
        built once."""
        if self._x8 is None and (k := self.gate.kernel()) is not None:
            mats = []
            # a cut's down stack keeps its rows: its products skip the cut groups' blocks
            down = None if self.tau is not None else self.down
            for m, step in ((self.gate, self.n_ff), (self.up, self.n_ff), (down, self.n_embd)):
                dk = interleave.dense_kernel(m) if m is not None and step % 8 == 0 else None
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


def shared_expert(blk, x: Tensor, accel: Accelerator | None) -> Tensor | None:
    """A layer's shared expert (llama.cpp's ``ffn_shexp``): x (T, n_embd) the normed FFN input
    -> (T, n_embd) f32 on x's device, computed where its matrices are; None without one. A
    qwen2moe gate scales it by llama.cpp's silu(g) / g (``ggml_numerics.silu_div``), g summed
    as an f32 router's logits are; glm4moe's and deepseek2's have no gate."""
    if blk.ffn_up_shexp is None:
        return None
    xs = move(accel, x, blk.ffn_up_shexp.device)
    h = glu(blk.ffn_gate_shexp.linear(xs), blk.ffn_up_shexp.linear(xs), SWIGLU, inplace=True)
    y = blk.ffn_down_shexp.linear(h)  # (T, n_embd)
    if blk.ffn_gate_inp_shexp is None:
        return move(accel, y, x.device)
    w = blk.ffn_gate_inp_shexp.float()[None]  # (1, n_embd)
    g = router_logits(DenseWeight(w), move(accel, xs, w.device))  # (T, 1)
    c = ggml_numerics.library(g)
    sig = ggml_numerics.silu_div(c, g) if c is not None else torch.sigmoid(g)
    return move(accel, y.mul_(move(accel, sig, y.device)), x.device)


# ----------------------------------------------------------------------------------- the FFN
def moe_ffn(
    l: int, ex: Experts, x: Tensor, opts: RunOptions, accel: Accelerator | None, cold=None
) -> Tensor:
    """The layer's mixture: x (T, n_embd) the normed FFN input (any device) -> (T, n_embd) f32
    on x's device. CPU-only without a cut it is llama.cpp's computation, step for step; hot
    rows run on the accelerator and the CPU adds the routed cold neurons (docs/moe.md), by the
    one split runner (``split.run_split``). ``cold``: a decode plan's cold tasks
    (``host_tasks.ColdTasks``): the host's neurons run as host functions of the device's
    stream, with no host wait; a layer whose every neuron is hot runs on the device alone."""
    with phase(opts.timer, "router"):
        ids, w = route(ex, move(accel, x, ex.router.device))  # (T, k)
    tau = scaled_cut(ex.tau, opts)
    plain = opts.observer is None and opts.oracle is None
    hot = ex.hot if plain else None
    hot_tau = None if hot is None else scaled_cut(hot.tau, opts)
    in_plan = cold is not None and l in cold.layers
    if in_plan or (hot is not None and hot.n_cold == 0 and ex.down_b is None):
        assert accel is not None
        x_d, ids_d, w_d = (accel.move(t, accel.device) for t in (x, ids, w))

        def on_device() -> Tensor | None:
            return None if hot is None else _hot(ex, x_d, ids_d, w_d, hot_tau)

        # the neurons added, as the host counts them: the routed hot ones, and the host's
        routed = None if opts.stats is None or hot is None else _routed_hot(hot, ids_d)
        if in_plan:  # the task gives the statistics its count with the hot ones
            y = cold.run_moe(l, x_d, ids_d, w_d, on_device, opts.stats, routed)
        else:  # every neuron on the device: no host part, no wait
            with phase(opts.timer, "ffn_hot"):
                y = on_device()
            if opts.stats is not None:
                opts.stats.record_counts(l, routed)
        return move(accel, y, x.device)

    def hot_part(x_d: Tensor, sel: list[Tensor]) -> Tensor:
        return _hot(ex, x_d, *sel, hot_tau)

    def cold_part(x_h: Tensor, sel: list[Tensor]) -> Tensor:
        ids_h, w_h = sel
        y, kept = experts_host(l, ex, x_h, ids_h, w_h, tau, opts, None if hot is None else hot.cold)
        if opts.stats is not None:  # a hybrid adds its routed hot neurons (cut or not)
            opts.stats.record_counts(l, kept + (0 if hot is None else hot.per_expert[ids_h].sum(1)))
        return y

    return run_split(
        accel, x, [ids, w], hot_part if hot is not None else None, cold_part, opts, keep=(hot_tau,)
    )


def mixture(
    l: int, blk, x: Tensor, opts: RunOptions, accel: Accelerator | None, cold=None
) -> Tensor:
    """A mixture-of-experts layer's FFN: x (T, n_embd) the normed FFN input -> the routed
    experts' sum (:func:`moe_ffn`; ``cold``: as there) plus its shared expert's output where it
    has one (:func:`shared_expert`, added as llama.cpp adds it), (T, n_embd) f32 on x's
    device."""
    y = moe_ffn(l, blk.moe, x, opts, accel, cold)
    shared = shared_expert(blk, x, accel)
    return y if shared is None else y.add_(shared)


def placed_dense(blk, x: Tensor, variant: FFNVariant, accel: Accelerator | None) -> Tensor:
    """A mixture's leading dense layer whose FFN a placement put whole on the accelerator (the
    dense pass, ``placement.experts``): x (T, n_embd) the normed FFN input -> (T, n_embd) f32
    on x's device, every product where its matrix is (no hot/cold split: every token runs
    every neuron, as a shared expert's)."""
    xs = move(accel, x, blk.ffn_up.device)
    g = blk.ffn_gate.linear(move(accel, xs, blk.ffn_gate.device))
    h = glu(move(accel, g, xs.device), blk.ffn_up.linear(xs), variant, inplace=True)
    y = blk.ffn_down_t.rows_sum(move(accel, h, blk.ffn_down_t.device))
    return move(accel, y, x.device)


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
    extras = (ex.routing.probs_b, ex.routing.router_b, ex.gate_b, ex.up_b, ex.down_b)
    if any(b is not None and b.device.type != "cpu" for b in extras):
        return None
    mats = [ex.router, ex.gate, ex.up, ex.down]
    gate_row = blk.ffn_gate_inp_shexp
    if blk.ffn_up_shexp is not None:
        if gate_row is not None and (ex._row is None or ex._row[0] is not gate_row):  # once
            ex._row = (gate_row, DenseWeight(as_f32(gate_row)[None]))
        row = None if gate_row is None else ex._row[1]  # None: an unscaled shared expert
        mats += [row, blk.ffn_gate_shexp, blk.ffn_up_shexp, blk.ffn_down_shexp]
    kerns = [m.kernel() for m in mats[:4]] + [m and interleave.dense_kernel(m) for m in mats[4:]]
    if any(k is None for i, k in enumerate(kerns) if i != 4 or gate_row is not None):
        return None
    x8 = ex.interleaved()[1:]  # the stacks interleaved, or None
    kerns[1:4] = [k if m is None else (k[0], m) for k, m in zip(kerns[1:4], x8, strict=True)]
    codes = [k and k[1].code for k in kerns]
    if codes[1] != codes[2] or codes[5:7] and codes[5] != codes[6]:  # each GLU's gate and up
        return None
    mats = [k and k[1] for k in kerns] + [None] * (8 - len(kerns))
    return kerns[0][0], mats, scaled_cut(ex.tau, opts)


def route_args(ex: Experts) -> tuple[RecRoute, list[Tensor]]:
    """The native block's routing beyond top-k and the experts' extras (``kernel_abi.RecRoute``:
    gating code, selection bias, expert groups, groups used, router bias, activation, gate, up
    and down biases) and the host tensors its pointers point into."""
    r = ex.routing
    vecs = [
        None if v is None else as_f32(v)
        for v in (r.probs_b, r.router_b, ex.gate_b, ex.up_b, ex.down_b)
    ]
    ptr = [0 if v is None else v.data_ptr() for v in vecs]
    act = int(ex.act == "swiglu_oai")
    route = RecRoute(r.code, ptr[0], *r.groups, ptr[1], act, *ptr[2:])
    return route, [v for v in vecs if v is not None]


# Where a mixture's matrices sit in its layer record (moe_kernels' order): the router in fc1's
# place, the stacks in the dense FFN's, then a shared expert's
MOE_MATRICES = (
    "ffn_gate_inp",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_gate_inp_shexp",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
)


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
    for name, m in zip(MOE_MATRICES, mats, strict=True):
        if m is not None:
            p.matrix(name, m)
    if not (p.vec("ffn_norm", blk.ffn_norm) and p.vec("tau", tau)):
        return None
    ex = blk.moe
    p.set("moe.n_used", ex.n_used)
    p.set("moe.norm", int(ex.norm))
    p.set("moe.scale", ex.scale)
    route, biases = route_args(ex)
    p.keep += biases
    p.set("route", route)
    return p


def moe_cold_part(blk, opts: RunOptions) -> layer_record.Part | None:
    """The record a mixture's cold task reads (``host_tasks``, ``csrc/host_tasks.h``
    ``moe_cold_rows``): the gate and up stacks as stored, the down stack (interleaved where the
    host path multiplies it so: ``Experts.x8``), the cut; None for experts other than plain
    SwiGLU without biases, or matrices the kernels cannot read."""
    ex: Experts | None = blk.moe
    if ex is None or not ex.plain or ex.down_b is not None:
        return None
    kerns = [m.kernel() for m in (ex.gate, ex.up, ex.down)]
    if any(k is None for k in kerns) or kerns[0][1].code != kerns[1][1].code:
        return None
    x8_down = ex.x8(0)[3] is not None and ex.interleaved()[3]  # numerics as Experts.x8's
    mats = [kerns[0][1], kerns[1][1], x8_down or kerns[2][1]]
    p = layer_record.Part(kerns[0][0], flags=RECORD_FLAGS["moe"])
    for name, m in zip(MOE_MATRICES[1:4], mats, strict=True):
        p.matrix(name, m)
    return p if p.vec("tau", scaled_cut(ex.tau, opts)) else None


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
    route, _biases = route_args(ex)
    kept = lib.cdll.pp_moe_decode(
        Matrix.pack(mats),
        ex.n_used,
        int(ex.norm),
        ex.scale,
        route,
        0 if tau is None else tau.data_ptr(),
        r.data_ptr(),
        w.data_ptr(),
        a.norm_eps,
        y.data_ptr(),
        None,
        None,
        act_code(),
        torch.get_num_threads(),
    )
    if kept < 0:
        raise ValueError(f"moe_decode: invalid arguments (status {-kept})")
    if opts.stats is not None:
        opts.stats.record_count(l, kept)
    return y[None]


def _routed_hot(hot: ExpertHot, ids: Tensor) -> Tensor:
    """The hot neurons of each token's routed experts: ids (T, k) -> (T,) int64, on the
    device."""
    return hot.per_expert_dev.index_select(0, ids.reshape(-1)).view(ids.shape).sum(1)


def _hot(ex: Experts, x: Tensor, ids: Tensor, w: Tensor, tau: Tensor | None) -> Tensor:
    """The hot neurons' part, all on the device (``split.run_split`` queues it on the side
    stream, no host sync): x (T, n_embd), ids and w (T, k) -> (T, n_embd). Every hot row is
    computed and weighted by its expert's routing weight (0 unless routed)."""
    hot = ex.hot
    assert hot is not None
    scale = spread(ex, ids, w).index_select(1, hot.bucket)  # (T, k_hot)
    g, u = hot.gate.linear(x), hot.up.linear(x)
    if ex.plain:
        h = glu(g, u, SWIGLU, inplace=True)
    else:  # GPT-OSS: the hot rows' biases (ExpertHot's, on the device), its activation
        g = g if hot.gate_b is None else g + hot.gate_b
        u = u if hot.up_b is None else u + hot.up_b
        h = swiglu_oai(g, u) if ex.act == "swiglu_oai" else glu(g, u, SWIGLU, inplace=True)
    h = h.mul_(scale)
    if tau is not None:  # the cut by groups, over the group's hot neurons
        h = cut_hot(h, tau, hot.bucket, ex.cut_group, ex.n_neurons)
    return hot.down_t.rows_sum(h)
