"""GPT-OSS 20B and 120B (GGUF arch ``gpt-oss``): grouped-query attention with biases on q, k, v
and the output, a sink logit per head in the softmax (``attn_sinks``, no value), and a sliding
window (``attention.sliding_window``) on every other layer (the even ones; llama.cpp's pattern
period 2, unless ``attention.sliding_window_pattern`` says otherwise); RoPE in NEOX pairs over
the whole head, YaRN-scaled. ``post_attention_norm`` is the FFN's input norm. The FFN is a
mixture of experts without a shared one: the router has a bias, the k chosen logits' softmax
gives the weights (llama.cpp's SOFTMAX_WEIGHT gating), each expert's gate, up and down products
have biases, and the activation is GPT-OSS's clamped SwiGLU (``moe_host.swiglu_oai``). Its
experts come as MXFP4 (ggml type 39) in the released GGUFs. The chat template is the file's
(OpenAI's harmony format)."""

from __future__ import annotations

from dataclasses import replace

from powerpy.families.base import Family, FFNVariant, LayerTensor, Rope, gated_ffn
from powerpy.families.experts import EXPERTS
from powerpy.formats.constants import Keys, Names

BLOCK = (
    LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",)),
    LayerTensor("attn_q", Names.ATTN_Q, ("n_embd_q", "n_embd"), bias="required"),
    LayerTensor("attn_k", Names.ATTN_K, ("n_embd_gqa", "n_embd"), bias="required"),
    LayerTensor("attn_v", Names.ATTN_V, ("n_embd_gqa", "n_embd"), bias="required"),
    LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd_q"), bias="required"),
    LayerTensor("attn_sinks", Names.ATTN_SINKS, ("n_head",)),
    # llama.cpp's attn_post_norm: the norm of the FFN's input
    LayerTensor("ffn_norm", Names.POST_ATTN_NORM, ("n_embd",)),
    LayerTensor("ffn_gate", Names.FFN_GATE, ("n_ff", "n_embd")),  # (no dense layer: unused)
    LayerTensor("ffn_up", Names.FFN_UP, ("n_ff", "n_embd")),
)

FAMILY = Family(
    arch="gpt-oss",
    block=BLOCK,
    ffn_variant=gated_ffn(FFNVariant.SWIGLU),
    rope=Rope.NEOX,
    tied_output=False,
    swa_pattern=2,
    experts=tuple(replace(t, bias="required") for t in EXPERTS),  # the router's, each stack's
    moe_required=True,
    expert_ff_key=Keys.EXPERT_FEED_FORWARD_LENGTH,
    expert_gating="softmax_weight",
    expert_act="swiglu_oai",
    key_defaults=((Keys.EXPERT_WEIGHTS_NORM, False),),
    reads=frozenset({Keys.ROPE_FREQ_BASE_SWA}),
    requires=frozenset(
        {
            Keys.EXPERT_COUNT,
            Keys.EXPERT_USED_COUNT,
            Keys.SLIDING_WINDOW,
            Keys.EXPERT_FEED_FORWARD_LENGTH,
        }
    ),
)
