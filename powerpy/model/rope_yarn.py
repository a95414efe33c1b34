"""YaRN's RoPE tables in float64 (the torch path; under llama.cpp's numerics
``ggml_numerics.rope_table`` computes them as ggml does): pair j turns by a mix of its
interpolated angle θ_j·p/scale and its extrapolated one θ_j·p, 1 below the corner dims and 0
above (``families.rope_scaling``), and cos and sin are scaled by YaRN's magnitude."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def corr_dims(args) -> tuple[float, float]:
    """ggml's ``ggml_rope_yarn_corr_dims``: the pair dims where the ramp starts and ends, from
    the original context (``rope_orig_ctx``, else the training context) and the betas."""
    n_ctx = args.rope_orig_ctx or args.n_ctx_train

    def dim(beta: float) -> float:
        return args.n_rot * math.log(n_ctx / (beta * 2 * math.pi)) / (2 * math.log(args.rope_base))

    lo = max(0.0, float(math.floor(dim(args.rope_yarn_beta_fast))))
    return lo, min(args.n_rot - 1.0, float(math.ceil(dim(args.rope_yarn_beta_slow))))


def tables(args, positions: Tensor, base: float, scale: float, factors: Tensor | None) -> Tensor:
    """(n, n_rot/2) complex64 rotations of positions (n,) under YaRN (``rope_ext_factor`` > 0)."""
    inv = base ** (-torch.arange(0, args.n_rot, 2, dtype=torch.float64) / args.n_rot)
    if factors is not None:
        inv = inv / factors.to(torch.float64)
    extrap = positions.to(torch.float64)[:, None] * inv[None]
    lo, hi = corr_dims(args)
    y = (torch.arange(args.n_rot // 2, dtype=torch.float64) - lo) / max(0.001, hi - lo)
    mix = (1 - y.clamp(0, 1)) * args.rope_ext_factor
    ang = extrap / scale * (1 - mix) + extrap * mix
    mag = args.rope_mscale * (1 + 0.1 * math.log(scale))
    return torch.polar(torch.full_like(ang, mag), ang).to(torch.complex64)
