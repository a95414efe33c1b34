"""The FFN of one block: predictor, dense reference, and the predictor-gated sparse forms.

Semantics (spec §9.2): ``act = fc2·relu(fc1·ffn_inp) >= thr``; only active neurons contribute,
``y = Σ_{j active} h_j · ffn_down_t[j]`` with ``h`` the variant's activation of gate and up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.config import FFN_DRELU, FFN_REGLU, FFN_SWIGLU
from powerpy.weights import DenseWeight, Weight, glu_rows


def glu(g: Tensor, u: Tensor, variant: str) -> Tensor:
    """The FFN activation h of gate g and up u (any shape)."""
    if variant == FFN_SWIGLU:
        return F.silu(g) * u
    if variant == FFN_REGLU:
        return F.relu(g) * u
    if variant == FFN_DRELU:
        return F.relu(g) * F.relu(u)
    raise ValueError(f"unknown FFN variant {variant!r}")


def rows_sum(h: Tensor, w: Weight, chunk: int = 2048, small_batch: int = 8) -> Tensor:
    """``h @ W`` for a neuron-major W: h (T, n_ff) f32, W (n_ff, n_embd) -> (T, n_embd) f32."""
    if isinstance(w, DenseWeight) and w.w.dtype == torch.float32:
        # (W^T h^T)^T: MKL's vector-times-matrix path (h @ W) is ~20x slower here
        return (w.w.t() @ h.t()).t()
    if h.shape[0] <= small_batch:  # decode: the row-sum kernel over all rows reads W once
        rows = torch.arange(w.shape[0], device=w.device)
        return torch.stack([w.gather_axpy(h_t, rows) for h_t in h])
    out = h.new_zeros(h.shape[0], w.shape[1])
    for s in range(0, w.shape[0], chunk):
        rows = torch.arange(s, min(s + chunk, w.shape[0]), device=w.device)
        out += h[:, s : s + chunk] @ w.take_rows(rows).dequantize()
    return out


def predict(x_pred: Tensor, fc1: Weight, fc2: Weight) -> Tensor:
    """Predictor logits ``fc2·relu(fc1·x)``: x_pred (T, n_embd) -> (T, n_ff) f32."""
    return fc2.linear(F.relu(fc1.linear(x_pred)))


def ffn_dense(x: Tensor, gate: Weight, up: Weight, down_t: Weight, variant: str) -> Tensor:
    """Dense FFN: x (T, n_embd) normed input -> (T, n_embd)."""
    return rows_sum(glu(gate.linear(x), up.linear(x), variant), down_t)


def ffn_masked(
    x: Tensor, gate: Weight, up: Weight, down_t: Weight, variant: str, act: Tensor
) -> Tensor:
    """Predictor-gated FFN over a batch, computed densely then masked: act (T, n_ff) bool.

    Equal to the row-sparse form token by token (masked neurons contribute exactly 0); used for
    prefill, where every token has its own mask.
    """
    h = glu(gate.linear(x), up.linear(x), variant) * act
    return rows_sum(h, down_t)


def ffn_rows(
    x: Tensor, gate: Weight, up: Weight, down_t: Weight, variant: str, idx: Tensor
) -> Tensor:
    """Row-sparse FFN for one token: x (n_embd,), idx (k,) active neurons -> (n_embd,)."""
    if idx.numel() == 0:
        return x.new_zeros(down_t.shape[1])
    h = glu_rows(x, gate, up, idx, variant)  # (k,)
    return down_t.gather_axpy(h, idx)
