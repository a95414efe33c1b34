"""Qwen2 (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen; GGUF arch ``qwen2``) and Qwen3 (``qwen3``):
LLaMA blocks with NeoX RoPE. Qwen2's q, k and v have biases; Qwen3's have none, and an RMSNorm
over each q and k head (``attn_q_norm``, ``attn_k_norm``) before RoPE. The output is tied or
separate. Qwen3-MoE (``qwen3moe``) is Qwen3 with a mixture of SwiGLU experts for the FFN, each
``expert_feed_forward_length`` wide; llama.cpp renormalizes the routed experts' weights
(``norm_topk_prob``), and powerpy does too unless ``qwen3moe.expert_weights_norm`` is false."""

from __future__ import annotations

from powerpy.families.base import Family, FFNVariant, LayerTensor, Rope, gated_ffn
from powerpy.families.experts import EXPERTS
from powerpy.families.llama import BLOCK as LLAMA_BLOCK
from powerpy.formats.constants import Keys, Names

QWEN2 = Family(
    arch="qwen2",
    block=LLAMA_BLOCK,
    ffn_variant=gated_ffn(FFNVariant.SWIGLU),
    rope=Rope.NEOX,
)

QWEN3 = Family(
    arch="qwen3",
    block=(
        *LLAMA_BLOCK,
        LayerTensor("attn_q_norm", Names.ATTN_Q_NORM, ("head_dim",)),
        LayerTensor("attn_k_norm", Names.ATTN_K_NORM, ("head_dim",)),
    ),
    ffn_variant=gated_ffn(FFNVariant.SWIGLU),
    rope=Rope.NEOX,
)

QWEN3MOE = Family(
    arch="qwen3moe",
    block=QWEN3.block,  # its ffn_gate and ffn_up are replaced by the experts
    ffn_variant=gated_ffn(FFNVariant.SWIGLU),
    rope=Rope.NEOX,
    experts=EXPERTS,
    moe_required=True,
    expert_ff_key=Keys.EXPERT_FEED_FORWARD_LENGTH,
)
