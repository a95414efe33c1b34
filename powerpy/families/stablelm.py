"""StableLM (GGUF arch ``stablelm``: StableLM 2 1.6B, StableLM Zephyr 3B, StableLM 3B 4E1T):
LLaMA's block with LayerNorm (weight and bias) before attention, before the FFN and at the
output, NeoX RoPE over the first ``rope.dimension_count`` dims of each head (a quarter of
them), optional q/k/v biases, a SwiGLU FFN and a separate output matrix.

StableLM 2 12B is refused by name: its per-head q/k LayerNorms (a weight per head) and its
parallel residual without ``ffn_norm`` are not this layout."""

from __future__ import annotations

from powerpy.families.base import Family, FFNVariant, LayerTensor, Norm, Rope, gated_ffn, qkv_block
from powerpy.formats.constants import Names

BLOCK = (
    LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",), bias="required"),
    *qkv_block(),
    LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd_q")),
    LayerTensor("ffn_norm", Names.FFN_NORM, ("n_embd",), bias="required"),
    LayerTensor("ffn_gate", Names.FFN_GATE, ("n_ff", "n_embd")),
    LayerTensor("ffn_up", Names.FFN_UP, ("n_ff", "n_embd")),
)

FAMILY = Family(
    arch="stablelm",
    block=BLOCK,
    ffn_variant=gated_ffn(FFNVariant.SWIGLU),
    norm=Norm.LAYER,
    rope=Rope.NEOX,
    tied_output=False,
    output_norm_bias=True,
    notes="StableLM 2 12B (per-head q/k LayerNorms, parallel residual) is not supported",
)
