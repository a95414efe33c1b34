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

import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.config import FFNVariant
from powerpy.model import ggml_numerics, kernels, layer_record
from powerpy.model.device import HOST, Accelerator, OnDevices, move
from powerpy.model.matrices import Weight
from powerpy.model.options import RunOptions


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


def cut_taus(norms: Tensor, t: float) -> Tensor:
    """A layer's cut ``|h_j| · ‖down column j‖ >= t`` per neuron, from the down columns' norms
    (n,) (``row_norms(ffn_down_t)``; a mixture's ``Experts.down_norms``): (n,) f32
    ``t / norm_j``, inf for an all-zero column, which adds nothing."""
    return torch.where(norms > 0, t / norms, torch.inf).float()


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


def ffn_dense(
    x: Tensor, gate: Weight | None, up: Weight, down_t: Weight, variant: FFNVariant
) -> Tensor:
    """Dense FFN: x (T, n_embd) normed input -> (T, n_embd)."""
    return down_t.rows_sum(glu(gate_linear(gate, x), up.linear(x), variant, inplace=True))


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
    return down_t.rows_sum(h.mul_(keep)), keep.sum(1)


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
    return down_t.rows_sum(cut(h, tau))


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
    return down_t.take_rows(rows).rows_sum(h)


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
