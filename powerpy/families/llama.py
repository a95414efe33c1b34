"""LLaMA (GGUF arch ``llama``): RMSNorm before attention and FFN, RoPE in NORM mode, grouped
query attention, a gated FFN (SwiGLU dense; ReGLU in PowerInfer's ReluLLaMA and ProSparse PWRI
files), optionally tied output. Mistral, llama-3 (``rope_freqs``) and SmolLM2 files use it
too, and Mixtral: a file with ``llama.expert_count`` > 0 has a mixture of SwiGLU experts in
place of the dense FFN. A file's ``llama.attention.sliding_window`` is ignored, as llama.cpp
ignores it: its llama graph attends over the whole context (and its converter never writes the
key for llama files), so a Mistral GGUF runs in powerpy as it runs in llama.cpp. Biases on
attn_output and the FFN's matrices are read where a file has them, as llama.cpp reads them."""

from __future__ import annotations

from dataclasses import replace

from powerpy.families.base import Family, FFNVariant, LayerTensor, gated_ffn, qkv_block
from powerpy.families.experts import EXPERTS
from powerpy.formats.constants import Names

BLOCK = (
    LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",)),
    *qkv_block(),
    LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd_q")),
    LayerTensor("ffn_norm", Names.FFN_NORM, ("n_embd",)),
    LayerTensor("ffn_gate", Names.FFN_GATE, ("n_ff", "n_embd")),
    LayerTensor("ffn_up", Names.FFN_UP, ("n_ff", "n_embd")),
)

# llama.cpp's llama loader reads optional biases on attn_output and on the FFN's gate, up and
# down matrices too (HF's attention_bias and mlp_bias); the families built on BLOCK have none
BIASED = ("attn_output", "ffn_gate", "ffn_up")

# a dense file runs SwiGLU, a PWRI file ReGLU (ReluLLaMA, ProSparse) unless it says "silu"
FAMILY = Family(
    arch="llama",
    block=tuple(replace(t, bias="optional") if t.field in BIASED else t for t in BLOCK),
    ffn_variant=gated_ffn(FFNVariant.SWIGLU),
    down_bias="optional",
    experts=EXPERTS,
)
