"""The FFN of one block, written once: predictor, activation, and the split runner.

Semantics (docs/architecture.md#sparse-ffn): ``act = fc2·relu(fc1·ffn_inp) >= thr``; only active
neurons contribute, ``y = Σ_{j active} h_j · ffn_down_t[j]`` with ``h`` the variant's activation of
gate and up. A layer with a *cut* ``t`` (``powerpy.ffn_down_threshold``, sparse runs only) also
drops each computed neuron whose contribution is small, ``|h_j| · ‖ffn_down_t[j]‖ < t``, before its
down row is read: ``tau_j = t / ‖ffn_down_t[j]‖`` per neuron (:func:`cut_taus`). A hybrid placement
splits each layer's neurons into k hot rows on the accelerator and the cold rest on the host; the
CPU-only model is the same split with no hot rows (``blk.hot`` None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.config import FFNVariant
from powerpy.model import ggml_numerics, gpu_kernels, kernels, layer_record
from powerpy.model.device import HOST, Accelerator, OnDevices, move
from powerpy.model.gpu_kernels import FusedWeight
from powerpy.model.matrices import DenseWeight, TransposedWeight, Weight
from powerpy.model.options import SPARSE, RunOptions
from powerpy.model.timing import phase


# ----------------------------------------------------------------------------------- maths
def glu(g: Tensor | None, u: Tensor, variant: FFNVariant, *, inplace: bool = False) -> Tensor:
    """The FFN activation h of gate g and up u (any shape); an ungated variant's of u alone (g
    is None). With ``inplace`` h overwrites g (or u) and u may be changed: the prompt paths own
    both, and a fresh multi-MB result per op costs more in page faults than the op itself."""
    if variant is FFNVariant.RELU:
        return F.relu(u, inplace=inplace)
    if variant is FFNVariant.GELU:
        if ggml_numerics.library(u) is not None:  # llama.cpp's numerics: ggml's GELU
            return ggml_numerics.gelu(u)
        return F.gelu(u)  # erf form, as the models were trained (HF's nn.GELU)
    if variant is FFNVariant.GEGLU:  # tanh form (gemma's gelu_pytorch_tanh, ggml's gelu)
        if ggml_numerics.library(g) is not None:  # llama.cpp's numerics: ggml's f16 table
            return ggml_numerics.gelu(g).mul_(u)
        return F.gelu(g, approximate="tanh").mul_(u)
    if variant not in (FFNVariant.SWIGLU, FFNVariant.REGLU, FFNVariant.DRELU):
        raise ValueError(f"unknown FFN variant {variant!r}")
    if not inplace:
        g = g.clone()
    c = ggml_numerics.library(g)
    if variant == FFNVariant.SWIGLU and c is not None and g.is_contiguous():
        return ggml_numerics.swiglu_(c, g, u.float())
    if variant == FFNVariant.SWIGLU:
        F.silu(g, inplace=True)
    else:
        F.relu(g, inplace=True)
    return g.mul_(F.relu(u, inplace=inplace) if variant == FFNVariant.DRELU else u)


def gate_linear(gate: Weight | None, x: Tensor, need: Tensor | None = None) -> Tensor | None:
    """``gate.linear(x, need)``, or None for an ungated FFN (no gate matrix)."""
    return None if gate is None else gate.linear(x, need)


def row_norms(w: Weight, chunk: int = 4096) -> Tensor:
    """The L2 norm of every row: w (n, m) -> (n,) f32, dequantized ``chunk`` rows at a time."""
    parts = []
    for s in range(0, w.shape[0], chunk):
        rows = torch.arange(s, min(s + chunk, w.shape[0]), device=w.device)
        parts.append(w.take_rows(rows).dequantize().float().norm(dim=1))
    return torch.cat(parts)


def cut_taus(down_t: Weight, t: float) -> Tensor:
    """A layer's cut ``|h_j| · ‖down_t[j]‖ >= t`` per neuron: (n_ff,) f32 ``t / ‖down_t[j]‖``
    (inf for an all-zero row, which adds nothing)."""
    n = row_norms(down_t)
    return torch.where(n > 0, t / n, torch.inf).float()


def scaled_cut(tau: Tensor | None, opts: RunOptions) -> Tensor | None:
    """The cut ``tau`` as a run with ``opts`` applies it: None in dense runs and at
    ``cut_scale`` 0, else ``tau · cut_scale``."""
    if tau is None or not opts.sparse or opts.oracle is not None or opts.cut_scale == 0:
        return None
    return tau if opts.cut_scale == 1 else tau * opts.cut_scale


def cut(h: Tensor, tau: Tensor | None) -> Tensor:
    """h (..., k) with the neurons below their cut (``|h_j| < tau_j``, tau (k,)) set to 0 in
    place; h itself when ``tau`` is None."""
    return h if tau is None else h.masked_fill_(h.abs() < tau, 0.0)


def predict(x_pred: Tensor, fc1: Weight, fc2: Weight, accel: Accelerator | None = None) -> Tensor:
    """Predictor logits ``fc2·relu(fc1·x)``: x_pred (T, n_embd) -> (T, n_ff) f32, on fc2's
    device (each matrix runs where it is placed)."""
    z = F.relu(fc1.linear(move(accel, x_pred, fc1.device)))  # (T, H)
    return fc2.linear(move(accel, z, fc2.device))


def _glu_kernels(gate: Weight | None, up: Weight):
    """(library, gate matrix, up matrix) when the fused native GLU can read both (same type and
    shape), else None (an ungated FFN too)."""
    if gate is None:
        return None
    kg, ku = gate.kernel(), up.kernel()
    if kg is None or ku is None:
        return None
    (lib, gm), um = kg, ku[1]
    return (lib, gm, um) if (gm.code, gm.nrows, gm.cols) == (um.code, um.nrows, um.cols) else None


def glu_rows(
    x: Tensor, gate: Weight | None, up: Weight, idx: Tensor, variant: FFNVariant
) -> Tensor:
    """Activated FFN intermediate of neurons ``idx``: ``h[j] = act(gate[idx[j]]·x, up[idx[j]]·x)``.

    Args:
        x: (n_embd,) FFN input.
        gate, up: (n_ff, n_embd) weights (gate None: an ungated FFN).
        idx: (k,) neuron ids.
        variant: the FFN variant.

    Returns:
        (k,) f32. One fused pass over the gate and up rows when the native kernels apply.

    Raises:
        ValueError: unknown variant.
    """
    pair = _glu_kernels(gate, up)
    if pair is not None and variant in kernels.VARIANTS:
        lib, gm, um = pair
        return lib.glu(gm, um, x, idx, variant)
    if idx.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=up.device)
    g = None if gate is None else gate.gather_linear(x, idx)
    return glu(g, up.gather_linear(x, idx), variant, inplace=True)


def rows_sum(h: Tensor, w: Weight) -> Tensor:
    """``h @ W`` for a neuron-major W: h (T, n_ff) f32, W (n_ff, n_embd) -> (T, n_embd) f32.

    On the host with the native kernels each token's row has the bits of its own one-token row
    sum, at any thread count and in any batch: one token sums its nonzero rows
    (``gather_axpy``), a batch takes the tiled row sums (``KernelLibrary.rows_sum``), which read
    a row once per tile of tokens and skip rows no token of the tile needs."""
    if isinstance(w, FusedWeight):
        return w.rows_sum(h)  # placed rows: one fused op
    if w.device.type != "cpu" and isinstance(w, DenseWeight):
        return (h.to(w.w.dtype) @ w.w).float()  # placed float rows: one matmul, no f32 copy
    if w.device.type != "cpu" and not isinstance(w, TransposedWeight):
        return h.float() @ w.dequantize()  # placed blocks no fused kernel reads: decoded
    if h.shape[0] == 1 and not isinstance(w, TransposedWeight) and w.kernel() is not None:
        return w.gather_axpy(h[0], torch.arange(w.shape[0]))[None]  # whole rows, streamed
    return w.rows_sum(h)  # a dense file's ffn_down: its linear; else the tiled row sums


def ffn_dense(
    x: Tensor, gate: Weight | None, up: Weight, down_t: Weight, variant: FFNVariant
) -> Tensor:
    """Dense FFN: x (T, n_embd) normed input -> (T, n_embd)."""
    return rows_sum(glu(gate_linear(gate, x), up.linear(x), variant, inplace=True), down_t)


def ffn_cut(
    x: Tensor,
    gate: Weight | None,
    up: Weight,
    down_t: Weight,
    variant: FFNVariant,
    act: Tensor | None,
    tau: Tensor,
) -> tuple[Tensor, Tensor]:
    """The FFN with a cut, CPU-only: x (T, n_embd), act (T, n_ff) bool predictor mask or None
    (ungated), tau (n_ff,) -> ((T, n_embd), kept (T,) int64: neurons whose down row was added).
    One token reads only its kept down rows; a batch computes h densely and masks it."""
    if x.shape[0] == 1:
        idx = torch.arange(up.shape[0]) if act is None else act[0].nonzero().squeeze(1)
        y, kept = _rows_cut(x[0], gate, up, down_t, variant, idx, tau)
        return y[None], torch.tensor([kept])
    h = glu(gate_linear(gate, x, act), up.linear(x, act), variant, inplace=True)  # (T, n_ff)
    keep = h.abs() >= tau if act is None else act & (h.abs() >= tau)
    return rows_sum(h.mul_(keep), down_t), keep.sum(1)


def _rows_cut(
    x: Tensor,
    gate: Weight | None,
    up: Weight,
    down_t: Weight,
    variant: FFNVariant,
    idx: Tensor,
    tau,
) -> tuple[Tensor, int]:
    """One token's FFN over neurons ``idx`` (k,) with the cut tau (n_ff,): x (n_embd,) ->
    ((n_embd,), how many down rows were added). Only the kept down rows are read."""
    h = glu_rows(x, gate, up, idx, variant)  # (k,)
    keep = h.abs() >= tau[idx]
    return down_t.gather_axpy(h[keep], idx[keep]), int(keep.sum())


def ffn_masked(
    x: Tensor,
    gate: Weight | None,
    up: Weight,
    down_t: Weight,
    variant: FFNVariant,
    act: Tensor,
    tau: Tensor | None = None,
) -> Tensor:
    """Predictor-gated FFN over a batch, computed densely then masked: act (T, n_ff) bool, tau
    (n_ff,) the cut or None.

    Equal to the row-sparse form token by token (masked neurons contribute exactly 0); used for
    prefill, where every token has its own mask. Quantized gate and up skip the rows that no
    token of a tile needs.
    """
    h = glu(gate_linear(gate, x, act), up.linear(x, act), variant, inplace=True).mul_(act)
    return rows_sum(cut(h, tau), down_t)


def ffn_rows(
    x: Tensor, gate: Weight | None, up: Weight, down_t: Weight, variant: FFNVariant, idx: Tensor
) -> Tensor:
    """Row-sparse FFN for one token: x (n_embd,), idx (k,) active neurons -> (n_embd,)."""
    if idx.numel() == 0:
        return x.new_zeros(down_t.shape[1])
    h = glu_rows(x, gate, up, idx, variant)  # (k,)
    return down_t.gather_axpy(h, idx)


def ffn_union(
    x: Tensor,
    gate: Weight | None,
    up: Weight,
    down_t: Weight,
    variant: FFNVariant,
    mask: Tensor,
    tau: Tensor | None = None,
) -> Tensor:
    """Masked FFN over the union of the batch's rows: x (T, n_embd), mask (T, n_ff) bool on the
    host, tau (n_ff,) the cut or None -> (T, n_embd). Only rows some token needs are read; most
    rows: one dense masked pass."""
    rows = mask.any(0).nonzero().squeeze(1)  # (r,) rows any token needs
    if rows.numel() == 0:
        return x.new_zeros(x.shape[0], down_t.shape[1])
    if 2 * rows.numel() >= mask.shape[1]:
        return ffn_masked(x, gate, up, down_t, variant, mask, tau)
    g = None if gate is None else gate.take_rows(rows).linear(x)  # (T, r)
    u = up.take_rows(rows).linear(x)
    h = cut(
        glu(g, u, variant, inplace=True).mul_(mask[:, rows]), None if tau is None else tau[rows]
    )
    return rows_sum(h, down_t.take_rows(rows))


# ----------------------------------------------------------------------------------- split
@dataclass
class HotRows:
    """One layer's split: compact hot rows on the accelerator, the cold set on the host.

    Attributes:
        k: neurons on the accelerator (> 0).
        gate, up, down_t: ``(k, n_embd)`` compact rows ``W[bucket]`` on the device (gate None
            for an ungated FFN).
        bucket: ``(k,)`` int64 on the device: the neuron id of each compact row.
        cold: ``(n_ff,)`` bool on the host, True where the neuron stays on the CPU.
        cold_idx: ``(n_ff - k,)`` int64 on the host, the cold neuron ids.
        tau: ``(k,)`` f32 on the device, the layer's cut of each compact row, or None.
        gate_up: ``(2k, n_embd)``, the gate rows then the up rows in one matrix, when the
            fused kernels run them (``gate`` and ``up`` are its halves; an ungated FFN's is
            ``up`` itself); else None.
    """

    k: int
    gate: Weight | None
    up: Weight
    down_t: Weight
    bucket: Tensor
    cold: Tensor
    cold_idx: Tensor
    tau: Tensor | None = None
    gate_up: FusedWeight | None = None

    @property
    def device_bytes(self) -> int:
        mats = (self.gate, self.up, self.down_t)
        return sum(m.nbytes for m in mats if m is not None)

    @property
    def index_bytes(self) -> int:
        return self.bucket.numel() * self.bucket.element_size()


def ffn(
    l: int,
    blk,
    x: Tensor,
    ffn_inp: Tensor,
    variant: FFNVariant,
    threshold: float,
    opts: RunOptions,
    accel: Accelerator | None,
    *,
    union: bool = False,
) -> Tensor:
    """The block's FFN: the predictor's mask, then :func:`split_ffn` (the torch path's one
    entry; a one-token step on the host takes the native block, :func:`fused_decode`).

    Args:
        l: layer, for the statistics and the observer.
        blk: the layer's weights (``powerpy.model.transformer.Block``): host FFN matrices,
            predictor ``fc1``/``fc2`` where placed, ``hot`` rows or None.
        x: (T, n_embd) normed FFN input; ffn_inp: (T, n_embd) its pre-norm value.
        variant: the FFN activation.
        threshold: the predictor cut.
        opts: run options (sparse or dense, observer, timer, statistics).
        accel: the accelerator holding ``blk.hot`` and placed tensors (None: CPU-only).
        union: the T tokens are sessions' decode steps (``Model.decode_batch``'s "union"
            mode): a gated layer without hot rows or a cut reads the union of their active
            rows once, masked per token.

    Returns:
        (T, n_embd) f32 on x's device.
    """
    act = None
    if blk.gates(opts):
        with phase(opts.timer, "predictor"):
            act = predict(ffn_inp, blk.fc1, blk.fc2, accel) >= threshold  # (T, n_ff) bool
    elif blk.cut(opts) is None and opts.sparse and blk.fc1 is not None and opts.oracle is None:
        if opts.stats is not None:
            opts.stats.record_dense(l, x.shape[0])  # an ungated layer computes every neuron
    plain = opts.observer is None and opts.oracle is None
    if union and act is not None and plain and blk.hot is None and blk.cut(opts) is None:
        act = move(accel, act, HOST)
        if opts.stats is not None:
            opts.stats.record(l, act)
        return ffn_union(x, blk.ffn_gate, blk.ffn_up, blk.ffn_down_t, variant, act)
    if plain:
        return split_ffn(blk, x, act, variant, accel, l=l, opts=opts)
    # Profiling or an oracle: the true activation of every neuron, from the host matrices.
    x_host = move(accel, x, HOST)
    h = glu(gate_linear(blk.ffn_gate, x_host), blk.ffn_up.linear(x_host), variant)  # (T, n_ff)
    act_host = None if act is None else move(accel, act, HOST)
    if opts.oracle is not None:
        act_host = opts.oracle(l, h)  # (T, n_ff) bool
    if act_host is not None and opts.stats is not None:
        opts.stats.record(l, act_host)
    if opts.observer is not None:
        opts.observer(l, move(accel, ffn_inp, HOST), h)
    y = rows_sum(h if act_host is None else h * act_host, blk.ffn_down_t)
    return move(accel, y, x.device)


def fused_decode(
    l: int, blk, x: OnDevices, a, thr: float, opts: RunOptions, src: OnDevices | None = None
) -> Tensor | None:
    """A decode step's FFN block on the host as one native call, in the family's layout
    (``layer_record``: norm, predictor, gated or ungated rows with the up bias, cut, down rows
    and bias, post norm, residual): x (1, n_embd) the residual stream, taken to the host; src
    (1, n_embd) the FFN's input before its norm where it is not x (a parallel block's input;
    the predictor reads it too; x is then the attention's output) -> x + FFN, or (x + FFN) +
    src in a parallel block, (1, n_embd) on the host; None when it does not apply
    (a matrix the kernels cannot read, hot rows, profiling, an oracle)."""
    part = layer_record.ffn_part(blk, a, opts)
    if part is None:
        return None
    x = x(HOST)
    src = None if src is None else src(HOST)[0]
    y, k = part.lib.ffn_decode(layer_record.record(part), a.norm_eps, thr, x[0], src)
    if layer_record.counted(blk, opts) and opts.sparse and opts.stats is not None:
        opts.stats.record_count(l, k)  # every neuron in an ungated layer without a cut
    return y[None]


def split_ffn(
    blk,
    x: Tensor,
    act: Tensor | None,
    variant: FFNVariant,
    accel: Accelerator | None,
    *,
    l: int = 0,
    opts: RunOptions = SPARSE,
) -> Tensor:
    """The FFN for a given mask: hot rows on the accelerator plus the predicted-active cold rows
    on the host (every row is cold when ``blk.hot`` is None), outputs added
    (docs/architecture.md#split-and-merge).

    Args:
        blk: the layer's weights (host FFN matrices and ``hot`` rows or None).
        x: (T, n_embd) normed FFN input, on any device.
        act: (T, n_ff) bool predicted-active mask (any device), or None for dense.
        variant: the FFN activation.
        accel: the accelerator holding ``blk.hot`` (None: CPU-only).
        l, opts: layer and options for the statistics and the timer.

    Returns:
        (T, n_embd) f32 on x's device.
    """
    hot: HotRows | None = blk.hot
    tau = blk.cut(opts)  # (n_ff,) on the host, or None
    y_hot = None
    if hot is not None:
        assert accel is not None
        x_dev = accel.move(x, accel.device)
        act_dev = None if act is None else accel.move(act, accel.device)
        tau_dev = scaled_cut(hot.tau, opts)  # (k,) on the device, or None
        with accel.side_stream(x_dev, act_dev, tau_dev), phase(opts.timer, "ffn_hot"):
            y_hot = _hot(hot, x_dev, act_dev, variant, accel.gather_hot, tau_dev)  # queued
    with phase(opts.timer if accel is not None else None, "wait"):
        x_host, act_host = _to_host(accel, x, act)  # waits for the predictor, not the hot part
    if hot is None and tau is not None:  # CPU-only with a cut: count the rows really added
        y_cold, kept = ffn_cut(x_host, blk.ffn_gate, blk.ffn_up, blk.ffn_down_t, variant,
                               act_host, tau)  # fmt: skip
        if opts.stats is not None:
            opts.stats.record_counts(l, kept)
        return move(accel, y_cold, x.device)
    if act_host is not None and opts.stats is not None:
        opts.stats.record(l, act_host)  # a hybrid's statistics count the predicted rows
    with phase(opts.timer if hot is not None else None, "ffn_cold"):
        y_cold = _cold(blk, hot, x_host, act_host, variant, tau)  # (T, n_embd) on the host
    if y_hot is None:
        return move(accel, y_cold, x.device)
    accel.join(y_hot)  # the main stream waits for the hot part; the host does not
    if y_hot.device == x.device:
        return y_hot + accel.move(y_cold, x.device)
    return accel.move(y_hot, x.device) + y_cold


def _to_host(accel: Accelerator | None, x: Tensor, act: Tensor | None):
    """x and act (or None) on the host, with one wait for those on the device."""
    ts = [t for t in (x, act) if t is not None]
    on_dev = [t for t in ts if t.device != HOST]
    if on_dev:
        assert accel is not None
        got = iter(accel.fetch(on_dev))
        ts = [next(got) if t.device != HOST else t for t in ts]
    return ts[0], (ts[1] if act is not None else None)


def _hot(
    hot: HotRows,
    x: Tensor,
    act: Tensor | None,
    variant: FFNVariant,
    gather: bool,
    tau: Tensor | None,
) -> Tensor:
    # x (T, n_embd), act (T, n_ff) bool, tau (k,), all on the device -> (T, n_embd) f32 there
    if hot.gate_up is not None and (hot.gate is None or variant in gpu_kernels.VARIANTS):
        # the fused kernels: three ops, no host round trip
        gu = hot.gate_up.linear(x, act, hot.bucket)  # (T, 2k); 0 where the predictor is off
        if hot.gate is None:  # ungated: (T, k) up rows; act(0) = 0 keeps the mask
            return hot.down_t.rows_sum(cut(glu(None, gu, variant, inplace=True), tau))
        return hot.down_t.rows_sum(gpu_kernels.glu(gu, tau, variant))
    if gather and act is not None and x.shape[0] == 1:
        idx = act[0, hot.bucket].nonzero().squeeze(1)  # (r,) active compact rows: a host sync
        h = cut(glu_rows(x[0], hot.gate, hot.up, idx, variant), None if tau is None else tau[idx])
        return hot.down_t.gather_axpy(h, idx)[None]
    h = cut(glu(gate_linear(hot.gate, x), hot.up.linear(x), variant, inplace=True), tau)  # (T, k)
    if act is not None:
        h = h.mul_(act.index_select(1, hot.bucket))  # predictor gating, no host round trip
    return rows_sum(h, hot.down_t)


def _cold(
    blk, hot: HotRows | None, x: Tensor, act: Tensor | None, variant: FFNVariant, tau
) -> Tensor:
    # x (T, n_embd), act (T, n_ff) bool, tau (n_ff,) or None, all on the host -> (T, n_embd) f32
    gate, up, down_t = blk.ffn_gate, blk.ffn_up, blk.ffn_down_t
    if hot is None:  # every row is cold: the CPU-only FFN (without a cut)
        if act is None:
            return ffn_dense(x, gate, up, down_t, variant)
        if x.shape[0] == 1:
            idx = act[0].nonzero().squeeze(1)
            return ffn_rows(x[0], gate, up, down_t, variant, idx)[None]
        return ffn_masked(x, gate, up, down_t, variant, act)
    if x.shape[0] == 1:  # decode: only the predicted-active cold rows
        idx = hot.cold_idx if act is None else (act[0] & hot.cold).nonzero().squeeze(1)
        if tau is not None:
            return _rows_cut(x[0], gate, up, down_t, variant, idx, tau)[0][None]
        return ffn_rows(x[0], gate, up, down_t, variant, idx)[None]
    mask = hot.cold.expand(x.shape[0], -1) if act is None else act & hot.cold  # (T, n_ff)
    return ffn_union(x, gate, up, down_t, variant, mask, tau)
