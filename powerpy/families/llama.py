"""LLaMA (GGUF arch ``llama``): RMSNorm before attention and FFN, RoPE in NORM mode, grouped
query attention, a gated FFN (SwiGLU dense; ReGLU in PowerInfer's ReluLLaMA and ProSparse PWRI
files), optionally tied output. Mistral-style and SmolLM2 files use it too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from powerpy.errors import ModelConfigError, shown
from powerpy.families.base import Family, FFNVariant, LayerTensor
from powerpy.formats.constants import Keys, Names

BLOCK = (
    LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",)),
    LayerTensor("attn_q", Names.ATTN_Q, ("n_embd", "n_embd")),
    LayerTensor("attn_k", Names.ATTN_K, ("n_embd_gqa", "n_embd")),
    LayerTensor("attn_v", Names.ATTN_V, ("n_embd_gqa", "n_embd")),
    LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd")),
    LayerTensor("ffn_norm", Names.FFN_NORM, ("n_embd",)),
    LayerTensor("ffn_gate", Names.FFN_GATE, ("n_ff", "n_embd")),
    LayerTensor("ffn_up", Names.FFN_UP, ("n_ff", "n_embd")),
)


def ffn_variant(kv: Mapping[str, Any], sparse: bool, source: str) -> FFNVariant:
    """GGUF has no activation key for llama: a dense file runs SwiGLU, a PWRI file ReGLU
    unless it carries ``powerpy.sparse_activation`` "silu".

    Raises:
        ModelConfigError: the key holds something other than "relu" or "silu".
    """
    if not sparse:
        return FFNVariant.SWIGLU
    act = kv.get(Keys.SPARSE_ACTIVATION, "relu")
    if not isinstance(act, str) or act not in ("relu", "silu"):
        raise ModelConfigError(
            f"{source}: key {Keys.SPARSE_ACTIVATION!r} is {shown(act)}; remove the key or set it "
            'to "relu" or "silu"'
        )
    return FFNVariant.REGLU if act == "relu" else FFNVariant.SWIGLU


FAMILY = Family(arch="llama", block=BLOCK, ffn_variant=ffn_variant)
