"""A mixture of experts' routing as llama.cpp's ``build_moe_ffn`` computes it: the router's
logits, the probabilities (softmax, sigmoid, or the chosen logits' softmax), a selection bias,
expert groups, the top k, and their weights (docs/moe.md#routing).

For one token x (n_embd,), the FFN input after ffn_norm:

    z   = ffn_gate_inp · x  (+ its bias: GPT-OSS) (n_expert,) f32 in llama.cpp's f32 order
    p   = softmax(z) | sigmoid(z) | z            ggml's soft_max; 1 / (1 + expf(-z))
    s   = p + exp_probs_b                        the selection scores (DeepSeek-V3, GLM-4.5)
    s   = -inf outside the n_group_used groups of largest top-2 sum   (expert groups)
    E   = the k experts of largest s, largest first (ties: the lower id)
    w_i = p[E_i]   (softmax_weight: softmax over the k chosen z)
    w_i = w_i / max(Σ_i w_i, 2^-14)              expert_weights_norm; then · expert_weights_scale
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from powerpy.model import ggml_numerics
from powerpy.model.matrices import DenseWeight, Weight

F16_TINY = 6.103515625e-5  # llama.cpp clamps the weights' sum to the smallest normal f16
GATINGS = ("softmax", "sigmoid", "softmax_weight")


@dataclass
class Routing:
    """How one layer turns its router's logits into experts and weights (beyond top-k, the
    renormalization and the scale, which ``moe.Experts`` holds).

    Attributes:
        gating: "softmax", "sigmoid" or "softmax_weight" (GPT-OSS: the k chosen logits'
            softmax).
        probs_b: (n_expert,) f32, the selection bias ``exp_probs_b``, or None; on the
            router's device.
        n_groups, n_group_used: expert groups (DeepSeek-V3): the experts split into
            ``n_groups`` equal groups, and a token chooses its experts from the
            ``n_group_used`` groups whose two best scores sum highest (0 or 1: no groups).
    """

    gating: str = "softmax"
    probs_b: Tensor | None = None
    n_groups: int = 0
    n_group_used: int = 0
    router_b: Tensor | None = None  # (n_expert,) f32, the router's bias (GPT-OSS), or None

    def __post_init__(self) -> None:
        if self.gating not in GATINGS:
            raise ValueError(f"unknown gating {self.gating!r}: one of {GATINGS}")

    @staticmethod
    def of(args, probs_b: Tensor | None = None, router_b: Tensor | None = None) -> Routing:
        """A layer's routing from its ``ModelArgs``, its selection bias and its router's bias."""
        return Routing(
            args.expert_gating, probs_b, args.n_expert_groups, args.n_group_used, router_b
        )

    @property
    def code(self) -> int:
        """The native block's gating code (``csrc/moe.h``): 0 softmax, 1 sigmoid, 2 the chosen
        logits' softmax."""
        return GATINGS.index(self.gating)

    def moved(self, move) -> Routing:
        """This routing with its biases moved by ``move`` (a tensor -> its device copy: an
        accelerator's ``to_device``)."""
        b, rb = self.probs_b, self.router_b
        return Routing(
            self.gating,
            None if b is None else move(b),
            *self.groups,
            None if rb is None else move(rb),
        )

    @property
    def groups(self) -> tuple[int, int]:
        return self.n_groups, self.n_group_used


def softmax(logits: Tensor) -> Tensor:
    """ggml's soft_max of each row: exp(x - max) with ggml's exp, the sum in double, then one
    f32 multiply by 1/sum. logits (T, n) f32 -> (T, n) f32."""
    c = ggml_numerics.library(logits)
    if c is not None and logits.dim() == 2:
        return ggml_numerics.soft_max(c, logits)
    e = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
    return e * (1.0 / e.double().sum(dim=1, keepdim=True)).float()


def sigmoid(logits: Tensor) -> Tensor:
    """ggml's sigmoid of each value, 1 / (1 + expf(-x)) with libm's expf under llama.cpp's
    numerics (``pp_sigmoid``), else torch's: (T, n) f32 -> (T, n) f32."""
    c = ggml_numerics.library(logits)
    if c is None:
        return torch.sigmoid(logits)
    x = logits.contiguous()
    y = torch.empty_like(x)
    c.pp_sigmoid(x.data_ptr(), x.numel(), y.data_ptr())
    return y


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


def probabilities(r: Routing, logits: Tensor) -> Tensor:
    """The routing probabilities p of logits (T, n_expert) f32 (GPT-OSS: the logits)."""
    if r.gating == "softmax":
        return softmax(logits)
    return sigmoid(logits) if r.gating == "sigmoid" else logits


def selection(r: Routing, p: Tensor) -> Tensor:
    """The scores the top k is taken of: p plus the selection bias, -inf outside each token's
    best ``n_group_used`` groups (ranked by the sum of their two best scores, ties to the lower
    group): (T, n_expert) f32."""
    s = p if r.probs_b is None else p + r.probs_b
    if r.n_groups <= 1:
        return s
    T, n = s.shape
    g = s.view(T, r.n_groups, n // r.n_groups)
    top2 = torch.sort(g, dim=2, descending=True, stable=True).values[..., :2]
    score = top2[..., 0] + top2[..., 1]  # (T, n_groups), one f32 add (ggml's sum of two)
    keep = torch.sort(score, dim=1, descending=True, stable=True).indices[:, : r.n_group_used]
    mask = torch.ones(T, r.n_groups, dtype=torch.bool, device=s.device)
    mask.scatter_(1, keep, False)
    return g.masked_fill(mask[..., None], -torch.inf).view(T, n)


def route(ex, x: Tensor) -> tuple[Tensor, Tensor]:
    """The routed experts of each token: x (T, n_embd) -> ids (T, k) int64 (largest
    selection score first, ties to the lower id) and weights (T, k) f32, on the router's
    device. ``ex``: the layer's ``moe.Experts``."""
    r: Routing = ex.routing
    z = router_logits(ex.router, x)  # (T, n_expert)
    if r.router_b is not None:  # ggml_add after the f32 matmul
        z = z + r.router_b  # (on the router's device: Routing.moved)
    p = probabilities(r, z)
    s = selection(r, p)
    ids = torch.sort(s, dim=1, descending=True, stable=True).indices[:, : ex.n_used]
    w = p.gather(1, ids)
    if r.gating == "softmax_weight":
        w = softmax(w.contiguous())
    if ex.norm:  # ggml_sum_rows sums in double
        w = w / w.double().sum(dim=1, keepdim=True).float().clamp_min(F16_TINY)
    if ex.scale not in (0.0, 1.0):
        w = w * ex.scale
    return ids, w


def spread(ex, ids: Tensor, w: Tensor) -> Tensor:
    """Each neuron's routing weight: ids, w (T, k) -> (T, n_expert · n_ff) f32, 0 for the
    neurons of experts a token does not route to (on the tensors' device, no host sync)."""
    per_expert = w.new_zeros(ids.shape[0], ex.n_expert)
    per_expert.scatter_(1, ids, w)
    T, n = per_expert.shape
    return per_expert[:, :, None].expand(T, n, ex.n_ff).reshape(T, n * ex.n_ff)
