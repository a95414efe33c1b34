"""Phi-2 (GGUF arch ``phi2``: microsoft/phi-2, phi-1.5): falcon's parallel block,
``x + attn(norm(x)) + mlp(norm(x))`` with one LayerNorm (weight and bias), NeoX RoPE over the
first ``rope.dimension_count`` dims of each head (32 of 80), q scaled by 1/sqrt(head size) before
q·k (llama.cpp's graph), biases on q, k, v, the attention output, ``ffn_up``, the down matrix
and the output matrix, and an ungated GELU MLP."""

from __future__ import annotations

from dataclasses import replace

from powerpy.families.base import LayerTensor, qkv_block
from powerpy.families.falcon import FAMILY as FALCON
from powerpy.formats.constants import Names

BLOCK = (
    LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",), bias="required"),
    *qkv_block(),
    LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd_q"), bias="required"),
    LayerTensor("ffn_up", Names.FFN_UP, ("n_ff", "n_embd"), bias="required"),
)

# falcon's LayerNorm, NeoX RoPE, parallel residual and ungated FFN, with phi2's tensors
FAMILY = replace(
    FALCON,
    arch="phi2",
    block=BLOCK,
    scale_q=True,
    down_bias="required",
    tied_output=False,
    output_bias=True,
    notes="phi2's MLP has no gate: --ffn-act relu or gelu",
)
