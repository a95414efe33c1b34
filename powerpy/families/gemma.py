"""Gemma, Gemma 2 and Gemma 3 (GGUF arch ``gemma``, ``gemma2``, ``gemma3``): RMSNorm before
attention and the FFN (llama.cpp's converter stores Gemma's 1 + w in the norm weights),
embeddings scaled by sqrt(n_embd), NeoX RoPE, q scaled by 1/sqrt(head size) before q·k, GeGLU
(tanh GELU), a head size of its own (``key_length``) and a tied output. Gemma 2 and 3 add post
norms after attention and the FFN and sliding-window layers in a fixed pattern. Gemma 2
soft-caps the attention scores and the logits; Gemma 3 normalises each q and k head and turns
its windowed layers by a local RoPE base (10000, unscaled) while the global ones keep the
file's base and scaling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from powerpy.families.base import Family, FFNVariant, LayerTensor, Rope, gated_ffn, qkv_block
from powerpy.formats.constants import Keys, Names

_BLOCK = (
    LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",)),
    *qkv_block(),
    LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd_q")),
    LayerTensor("post_attention_norm", Names.POST_ATTN_NORM, ("n_embd",)),
    LayerTensor("ffn_norm", Names.FFN_NORM, ("n_embd",)),
    LayerTensor("ffn_gate", Names.FFN_GATE, ("n_ff", "n_embd")),
    LayerTensor("ffn_up", Names.FFN_UP, ("n_ff", "n_embd")),
    LayerTensor("post_ffw_norm", Names.POST_FFW_NORM, ("n_embd",)),
)
_QK_NORMS = (
    LayerTensor("attn_q_norm", Names.ATTN_Q_NORM, ("head_dim",)),
    LayerTensor("attn_k_norm", Names.ATTN_K_NORM, ("head_dim",)),
)


def _extra(n_layer_27b: int, local_base: bool) -> Callable[[Callable[..., Any], int, str], dict]:
    """Gemma's extra hyperparameters, as llama.cpp sets them: the q·k scale is 1/sqrt(head
    size), except in the 27B models (``n_layer_27b`` layers), which scale by
    1/sqrt(n_embd / n_head) (integer division); no file key sets it. Gemma 3's windowed
    layers turn by ``rope.freq_base_swa`` (10000 without it), unscaled."""

    def extra(get: Callable[..., Any], n_layer: int, source: str) -> dict:
        out: dict = {}
        if n_layer == n_layer_27b:
            out["attn_scale"] = (get(Keys.EMBEDDING_LENGTH) // get(Keys.HEAD_COUNT)) ** -0.5
        if local_base:
            out["rope_base_swa"] = get(Keys.ROPE_FREQ_BASE_SWA, 10000.0, float)
            out["rope_scale_swa"] = 1.0
        return out

    return extra


# Gemma (1: gemma-2b/7b, CodeGemma): no post norms, no window, no soft-caps
GEMMA = Family(
    arch="gemma",
    block=tuple(t for t in _BLOCK if not t.field.startswith("post_")),
    ffn_variant=gated_ffn(FFNVariant.GEGLU),
    rope=Rope.NEOX,
    embed_scale=True,
    scale_q=True,
    output_tensor=False,
)

GEMMA2 = Family(
    arch="gemma2",
    block=_BLOCK,
    ffn_variant=gated_ffn(FFNVariant.GEGLU),
    rope=Rope.NEOX,
    embed_scale=True,
    scale_q=True,
    swa_pattern=2,
    output_tensor=False,
    # llama.cpp's defaults for a file without the keys (llama_hparams, gemma2's loader)
    key_defaults=(
        (Keys.SLIDING_WINDOW, 4096),
        (Keys.ATTN_SOFTCAP, 50.0),
        (Keys.FINAL_SOFTCAP, 30.0),
    ),
    reads=frozenset({Keys.ATTN_SOFTCAP, Keys.FINAL_SOFTCAP, Keys.ROPE_FREQ_BASE_SWA}),
    extra_args=_extra(46, local_base=False),
)

GEMMA3 = Family(
    arch="gemma3",
    block=_BLOCK + _QK_NORMS,
    ffn_variant=gated_ffn(FFNVariant.GEGLU),
    rope=Rope.NEOX,
    embed_scale=True,
    scale_q=True,
    swa_pattern=6,
    # gemma3's attention scores are not capped; its logits only where the file says so
    reads=frozenset({Keys.FINAL_SOFTCAP, Keys.ROPE_FREQ_BASE_SWA}),
    extra_args=_extra(62, local_base=True),
)
