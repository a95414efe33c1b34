"""Falcon (GGUF arch ``falcon``; PowerInfer's ReluFalcon-40B PWRI files): a parallel block,
``x + attn(norm(x)) + mlp(norm(x))``, with LayerNorm (weight and bias), NeoX RoPE and one fused
``attn_qkv`` in the "jploski" layout (every q head, then the k heads, then the v heads). 7B is
multi-query (one kv head), 40B grouped with its own attention norm (``attn_norm_2``; then
``attn_norm`` feeds the MLP). The MLP has no gate: ``ffn_up`` -> GELU (dense) or ReLU
(ReluFalcon, every PWRI file) -> the down matrix. The predictor reads the block's input."""

from __future__ import annotations

from powerpy.families.base import (
    QKV_SPLIT,
    Family,
    LayerTensor,
    Norm,
    Residual,
    Rope,
    ungated_ffn,
)
from powerpy.formats.constants import Names

BLOCK = (
    LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",), bias="required"),
    LayerTensor("attn_norm_2", Names.ATTN_NORM_2, ("n_embd",), optional=True, bias="required"),
    LayerTensor(
        "attn_qkv", Names.ATTN_QKV, ("n_embd_qkv", "n_embd"), bias="optional", split=QKV_SPLIT
    ),
    LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd"), bias="optional"),
    LayerTensor("ffn_up", Names.FFN_UP, ("n_ff", "n_embd"), bias="optional"),
)


FAMILY = Family(
    arch="falcon",
    block=BLOCK,
    ffn_variant=ungated_ffn,
    ffn_acts=("relu", "gelu"),
    norm=Norm.LAYER,
    rope=Rope.NEOX,
    residual=Residual.PARALLEL,
    gated=False,
    down_bias="optional",
    output_norm_bias=True,
    notes="falcon's MLP has no gate: --ffn-act relu (ReluFalcon) or gelu",
)
