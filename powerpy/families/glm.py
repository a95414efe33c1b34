"""GLM-4.5 and GLM-4.5-Air (GGUF arch ``glm4moe``): grouped-query attention with q, k and v
biases and an optional RMSNorm of each q and k head (the 355B model's), RoPE in NEOX pairs over
part of each head (``rope.dimension_count``, half of it in the released models), then a
mixture of experts after ``leading_dense_block_count`` dense layers. Experts are routed by a
sigmoid of the router's logits plus a per-expert selection bias (``exp_probs_b``), and one or
more shared experts (``expert_shared_count`` · ``expert_feed_forward_length`` wide) add their
output unscaled. The FFN's input norm is the file's ``post_attention_norm`` (there is no
``ffn_norm``). The last ``nextn_predict_layers`` layers of ``block_count`` are the NextN
(multi-token prediction) layers, which llama.cpp loads and does not run; neither does powerpy.
"""

from __future__ import annotations

from powerpy.families.base import Family, FFNVariant, LayerTensor, Rope, gated_ffn, qkv_block
from powerpy.families.experts import (
    EXPERTS,
    PROBS_BIAS,
    SHARED_BY_COUNT_KEYS,
    UNGATED_SHARED_EXPERT,
)
from powerpy.formats.constants import Keys, Names

BLOCK = (
    LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",)),
    *qkv_block(),
    LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd_q")),
    LayerTensor("attn_q_norm", Names.ATTN_Q_NORM, ("head_dim",), optional=True),
    LayerTensor("attn_k_norm", Names.ATTN_K_NORM, ("head_dim",), optional=True),
    # llama.cpp's attn_post_norm: the norm of the FFN's input
    LayerTensor("ffn_norm", Names.POST_ATTN_NORM, ("n_embd",)),
    LayerTensor("ffn_gate", Names.FFN_GATE, ("n_ff", "n_embd")),  # the leading dense layers
    LayerTensor("ffn_up", Names.FFN_UP, ("n_ff", "n_embd")),
    *UNGATED_SHARED_EXPERT,
)

FAMILY = Family(
    arch="glm4moe",
    block=BLOCK,
    ffn_variant=gated_ffn(FFNVariant.SWIGLU),
    rope=Rope.NEOX,
    experts=(*EXPERTS, PROBS_BIAS),
    moe_required=True,
    expert_ff_key=Keys.EXPERT_FEED_FORWARD_LENGTH,
    expert_gating="sigmoid",
    shared_by_count=True,
    key_defaults=((Keys.EXPERT_WEIGHTS_NORM, False),),
    reads=frozenset(
        {
            Keys.LEADING_DENSE_BLOCK_COUNT,
            Keys.EXPERT_SHARED_COUNT,
            Keys.EXPERT_GATING_FUNC,
            Keys.NEXTN_PREDICT_LAYERS,
        }
    ),
    requires=SHARED_BY_COUNT_KEYS,
)
