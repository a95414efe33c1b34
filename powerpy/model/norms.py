"""The norms of the residual stream (``Model.norm``) and of q/k heads: RMSNorm and LayerNorm, in
ggml's order under llama.cpp's numerics (``ggml_numerics``: the same C functions as the native
decode blocks), else torch's; RMSNorm in one launch where the accelerator runs fused kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.model import ggml_numerics, gpu_kernels

_HAS_RMS_NORM = hasattr(F, "rms_norm")


def layer_norm(x: Tensor, w: Tensor, b: Tensor | None, eps: float) -> Tensor:
    """x (..., n) f32 -> (x - mean) / sqrt(var + eps) · w + b (biased variance, as ggml and
    torch compute it; in ggml's order under llama.cpp's numerics)."""
    c = ggml_numerics.library(x)
    if c is not None:
        return ggml_numerics.layer_norm(c, x, w, b, eps)
    return F.layer_norm(x, w.shape, w, b, eps)


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
