"""Device copies of a model's weights, in the form the device computes with: a placed matrix
of a type the device kernels (``gpu_kernels``) read becomes a ``DeviceQuantWeight`` over the
file's bytes; a layer's hot rows ``W[bucket]`` are raw row copies (gate and up stacked in one
matrix); q, k and v one matrix (``Block.attn_qkv``); a mixture's hot expert neurons their gate and
up rows and down columns.
``runtime.build_hybrid`` decides what moves; this module makes the copies."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor

from powerpy.formats.constants import GGMLType
from powerpy.model import gpu_kernels
from powerpy.model.biased import BiasedWeight
from powerpy.model.device import Accelerator
from powerpy.model.gpu_kernels import DeviceQuantWeight
from powerpy.model.matrices import DenseWeight, QuantWeight, TransposedWeight, Weight
from powerpy.model.moe import ExpertHot, Experts
from powerpy.model.weights import Block
from powerpy.placement.experts import down_element_bytes

logger = logging.getLogger(__name__)


def _fused_type(w: Weight) -> GGMLType | None:
    """The block type the fused kernels would read ``w`` as, or None."""
    if isinstance(w, (QuantWeight, DeviceQuantWeight)):
        t = w.ggml_type
    elif isinstance(w, DenseWeight) and w.w.dtype == torch.float16:
        t = GGMLType.F16
    else:
        return None
    return t if gpu_kernels.supports(t, w.shape[1]) else None


def to_device(accel: Accelerator, t: Tensor | Weight) -> Tensor | Weight:
    """A persistent device copy, in the form the device computes with: the fused kernels' when
    they read the type (the file's bytes, one launch per product)."""
    if isinstance(t, Tensor):
        return accel.to_device(t)
    if isinstance(t, BiasedWeight):  # the matrix as any other, its bias beside it
        return BiasedWeight(to_device(accel, t.inner), accel.to_device(t.bias))
    if isinstance(t, TransposedWeight):  # a dense file's down matrix: its stored matrix
        return TransposedWeight(to_device(accel, t.inner))
    kind = _fused_type(t) if accel.fused else None
    if kind is not None:
        return DeviceQuantWeight.of(accel.to_device(t.storage), kind, t.shape[1])
    if isinstance(t, QuantWeight) and not accel.emulated:
        _warn_torch_decode(t.ggml_type)
    return t.with_storage(accel.to_device(t.storage))


def hot_rows(accel: Accelerator, gate: Weight | None, up: Weight, down_t: Weight, bucket: Tensor):
    """A layer's rows ``bucket`` (k,) of gate, up and down_t on the device: (gate, up, down_t,
    gate_up). With the fused kernels, gate and up are the halves of one stacked matrix; an
    ungated FFN (gate None) has only up's rows there."""
    if gate is None:
        placed = [to_device(accel, m.take_rows(bucket)) for m in (up, down_t)]
        fused = placed[0] if isinstance(placed[0], DeviceQuantWeight) else None
        return None, placed[0], placed[1], fused
    rows = [m.take_rows(bucket) for m in (gate, up, down_t)]  # raw rows, copied on the host
    kind = _fused_type(rows[0]) if accel.fused else None
    if kind is not None and kind == _fused_type(rows[1]) and rows[0].shape == rows[1].shape:
        stacked = torch.cat([m.storage.view(torch.uint8) for m in rows[:2]])  # (2k, row_bytes)
        gate_up = DeviceQuantWeight(accel.to_device(stacked), kind, rows[0].shape[1])
        k = bucket.numel()
        g, u = (DeviceQuantWeight(gate_up.raw.narrow(0, s, k), kind, gate_up.cols) for s in (0, k))
        return g, u, to_device(accel, rows[2]), gate_up
    return (*(to_device(accel, m) for m in rows), None)


def stack_qkv(accel: Accelerator, blk: Block) -> None:
    """q, k and v computed by the fused kernels on the device, of one block type and width
    (all with a bias or none), become one matrix (``Block.attn_qkv``: one product) and its row
    views, so the device holds their bytes once, as before."""
    parts = [blk.attn_q, blk.attn_k, blk.attn_v]
    biased = {isinstance(p, BiasedWeight) for p in parts}
    mats = [p.inner if isinstance(p, BiasedWeight) else p for p in parts]
    if len(biased) > 1 or not all(isinstance(m, DeviceQuantWeight) for m in mats):
        return
    qkv = DeviceQuantWeight.stacked(mats)
    if qkv is None or qkv.device != accel.device:
        return
    accel.adopt(qkv.raw)
    ends = np.cumsum([m.shape[0] for m in mats]).tolist()  # (narrow: fake CUDA has no [a:b])
    spans = [(e - m.shape[0], e) for m, e in zip(mats, ends, strict=True)]
    views = [
        DeviceQuantWeight(qkv.raw.narrow(0, s, e - s), qkv.ggml_type, qkv.cols) for s, e in spans
    ]
    if biased == {True}:
        bias = accel.adopt(torch.cat([p.bias for p in parts]))
        views = [
            BiasedWeight(v, bias.narrow(0, s, e - s))
            for v, (s, e) in zip(views, spans, strict=True)
        ]
        qkv = BiasedWeight(qkv, bias)
    blk.attn_q, blk.attn_k, blk.attn_v = views
    blk.attn_qkv = qkv


def ggml_type(w: Weight) -> GGMLType:
    """The file type of a loaded matrix (its float dtype's, or its blocks')."""
    if isinstance(w, (QuantWeight, DeviceQuantWeight)):
        return w.ggml_type
    return {torch.float32: GGMLType.F32, torch.bfloat16: GGMLType.BF16}.get(
        w.storage.dtype, GGMLType.F16
    )


def expert_hot(accel: Accelerator, ex: Experts, bucket: Tensor) -> ExpertHot:
    """A mixture's hot neurons ``bucket`` (k,) on the device: their gate and up rows (raw) and
    biases (GPT-OSS), and their down columns as rows (f16, or the stack's float type;
    placement.experts)."""
    gate, up = (to_device(accel, m.take_rows(bucket)) for m in (ex.gate, ex.up))
    dtype = {4: torch.float32, 2: torch.float16}[down_element_bytes(ggml_type(ex.down))]
    if ggml_type(ex.down) == GGMLType.BF16:
        dtype = torch.bfloat16
    rows = torch.empty(bucket.numel(), ex.n_embd, dtype=dtype)
    experts = bucket // ex.n_ff
    for e in torch.unique(experts).tolist():
        sel = (experts == e).nonzero().squeeze(1)
        cols = ex.expert(e)[2].dequantize()  # (n_embd, n_ff) f32, one expert at a time
        rows[sel] = cols[:, bucket[sel] - e * ex.n_ff].t().to(dtype)
    cold = torch.ones(ex.n_neurons, dtype=torch.bool)
    cold[bucket] = False
    per_expert = torch.bincount(experts, minlength=ex.n_expert)
    tau = None if ex.tau is None else accel.to_device(ex.tau[bucket])
    down_t = to_device(accel, DenseWeight(rows))
    gate_b, up_b = (
        None if b is None else accel.to_device(b.reshape(-1)[bucket]) for b in (ex.gate_b, ex.up_b)
    )
    return ExpertHot(
        bucket.numel(),
        gate,
        up,
        down_t,
        accel.to_device(bucket),
        cold,
        per_expert,
        tau,
        gate_b,
        up_b,
        accel.to_device(per_expert),
        int(cold.sum()),
    )


_warned: set[GGMLType] = set()


def _warn_torch_decode(t: GGMLType) -> None:
    if t not in _warned:
        _warned.add(t)
        logger.warning(
            "placed %s matrices decode with torch ops (many launches per token): the fused "
            "kernels read %s%s",
            t.name,
            ", ".join(k.name for k in gpu_kernels.TYPES),
            "" if gpu_kernels.available() else ", and need Triton (pip install triton)",
        )
