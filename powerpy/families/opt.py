"""OPT (PowerInfer's GGUF arch ``opt``): pre-LayerNorm blocks (weight and bias), learned
positions (``position_embd``, position p at row p + 2 as in HF's OPT), q/k/v/output with biases,
and a ReLU MLP without a gate, ``ffn_up`` (+bias) -> ReLU -> the down matrix (+bias). The
output is tied to ``token_embd``. OPT is natively ReLU, so it is sparse without retraining."""

from __future__ import annotations

from powerpy.families.base import Family, FFNVariant, LayerTensor, Norm, Rope
from powerpy.formats.constants import Names

BLOCK = (
    LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",), bias="required"),
    LayerTensor("attn_q", Names.ATTN_Q, ("n_embd", "n_embd"), bias="required"),
    LayerTensor("attn_k", Names.ATTN_K, ("n_embd_gqa", "n_embd"), bias="required"),
    LayerTensor("attn_v", Names.ATTN_V, ("n_embd_gqa", "n_embd"), bias="required"),
    LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd"), bias="required"),
    LayerTensor("ffn_norm", Names.FFN_NORM, ("n_embd",), bias="required"),
    LayerTensor("ffn_up", Names.FFN_UP, ("n_ff", "n_embd"), bias="required"),
)

FAMILY = Family(
    arch="opt",
    block=BLOCK,
    ffn_variant=lambda kv, sparse, source: FFNVariant.RELU,
    ffn_acts=("relu",),
    norm=Norm.LAYER,
    rope=Rope.LEARNED,
    gated=False,
    down_bias="required",
    output_norm_bias=True,
    position_offset=2,
    notes="OPT's MLP is ReLU without a gate",
)
