"""LLaMA (GGUF arch ``llama``): RMSNorm before attention and FFN, RoPE in NORM mode, grouped
query attention, a gated FFN (SwiGLU dense; ReGLU in PowerInfer's ReluLLaMA and ProSparse PWRI
files), optionally tied output. Mistral-style and SmolLM2 files use it too, and Mixtral: a file
with ``llama.expert_count`` > 0 has a mixture of SwiGLU experts in place of the dense FFN."""

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

# A mixture of experts (Mixtral; llama.cpp's build_moe_ffn): the router, then each expert's
# gate, up and down matrices stacked, the down stack as llama.cpp stores it, (n_embd, n_ff_exp)
# per expert.
EXPERTS = (
    LayerTensor("ffn_gate_inp", Names.FFN_GATE_INP, ("n_expert", "n_embd")),
    LayerTensor("ffn_gate_exps", Names.FFN_GATE_EXPS, ("n_expert", "n_ff_exp", "n_embd")),
    LayerTensor("ffn_up_exps", Names.FFN_UP_EXPS, ("n_expert", "n_ff_exp", "n_embd")),
    LayerTensor("ffn_down_exps", Names.FFN_DOWN_EXPS, ("n_expert", "n_embd", "n_ff_exp")),
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


FAMILY = Family(arch="llama", block=BLOCK, ffn_variant=ffn_variant, experts=EXPERTS)
