"""Phi-3 (GGUF arch ``phi3``): LLaMA-like blocks with one fused ``attn_qkv`` (q, then k, then v
rows; separate ``attn_q``/``attn_k``/``attn_v`` load too, as in llama.cpp) and one fused
``ffn_up`` holding the gate rows, then the up rows (SwiGLU), NeoX RoPE, and the long/short RoPE
factors (``rope_factors_long``/``_short``) of the long-context models. As llama.cpp does, the
file's sliding window is not applied."""

from __future__ import annotations

from powerpy.families.base import Family, FFNVariant, LayerTensor, Rope, gated_ffn, qkv_block
from powerpy.formats.constants import Names

FAMILY = Family(
    arch="phi3",
    block=(
        LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",)),
        *qkv_block(fused=True),
        LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd_q")),
        LayerTensor("ffn_norm", Names.FFN_NORM, ("n_embd",)),
        LayerTensor(
            "ffn_up",
            Names.FFN_UP,
            ("n_ff_gate_up", "n_embd"),
            split=(("ffn_gate", "n_ff"), ("ffn_up", "n_ff")),
        ),
    ),
    ffn_variant=gated_ffn(FFNVariant.SWIGLU),
    rope=Rope.NEOX,
    scale_q=True,
    # llama.cpp's phi3 loader disables the window (its converters wrote wrong ones; the default
    # swa_pattern None keeps it unapplied) and reads none of ``FAMILY_KEYS``
)
