"""Qwen2 (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen; GGUF arch ``qwen2``) and Qwen3 (``qwen3``):
LLaMA blocks with NeoX RoPE. Qwen2's q, k and v have biases; Qwen3's have none, and an RMSNorm
over each q and k head (``attn_q_norm``, ``attn_k_norm``) before RoPE. The output is tied or
separate. Qwen3-MoE (``qwen3moe``) is Qwen3 with a mixture of SwiGLU experts for the FFN, each
``expert_feed_forward_length`` wide; llama.cpp renormalizes the routed experts' weights
(``norm_topk_prob``), and powerpy does too unless ``qwen3moe.expert_weights_norm`` is false.
Qwen2-MoE (``qwen2moe``: Qwen1.5-MoE, Qwen2-57B-A14B) is Qwen2 with routed experts whose weights
are not renormalized, plus a shared expert every token runs, scaled by a sigmoid gate
(``experts.SHARED_EXPERT``)."""

from __future__ import annotations

from powerpy.families.base import Family, FFNVariant, LayerTensor, Rope, gated_ffn
from powerpy.families.experts import EXPERTS, SHARED_EXPERT
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

QWEN2MOE = Family(
    arch="qwen2moe",
    block=(*LLAMA_BLOCK, *SHARED_EXPERT),  # ffn_gate and ffn_up are replaced by the experts
    ffn_variant=gated_ffn(FFNVariant.SWIGLU),
    rope=Rope.NEOX,
    experts=EXPERTS,
    moe_required=True,
    expert_ff_key=Keys.EXPERT_FEED_FORWARD_LENGTH,
    # HF's norm_topk_prob is false for Qwen2-MoE; llama.cpp never renormalizes them
    key_defaults=((Keys.EXPERT_WEIGHTS_NORM, False),),
)
