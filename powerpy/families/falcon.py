"""Falcon (GGUF arch ``falcon``; PowerInfer's ReluFalcon-40B PWRI files): a parallel block,
``x + attn(norm(x)) + mlp(norm(x))``, with LayerNorm (weight and bias), NeoX RoPE and one fused
``attn_qkv`` in the "jploski" layout (every q head, then the k heads, then the v heads). 7B is
multi-query (one kv head), 40B grouped with its own attention norm (``attn_norm_2``; then
``attn_norm`` feeds the MLP). The MLP has no gate: ``ffn_up`` -> GELU (dense) or ReLU
(ReluFalcon, every PWRI file) -> the down matrix. The predictor reads the block's input."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from powerpy.errors import ModelConfigError, shown
from powerpy.families.base import (
    QKV_SPLIT,
    Family,
    FFNVariant,
    LayerTensor,
    Norm,
    Residual,
    Rope,
)
from powerpy.formats.constants import Keys, Names

BLOCK = (
    LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",), bias="required"),
    LayerTensor("attn_norm_2", Names.ATTN_NORM_2, ("n_embd",), optional=True, bias="required"),
    LayerTensor(
        "attn_qkv", Names.ATTN_QKV, ("n_embd_qkv", "n_embd"), bias="optional", split=QKV_SPLIT
    ),
    LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd"), bias="optional"),
    LayerTensor("ffn_up", Names.FFN_UP, ("n_ff", "n_embd"), bias="optional"),
)


def ffn_variant(kv: Mapping[str, Any], sparse: bool, source: str) -> FFNVariant:
    """A dense file runs GELU (llama.cpp's falcon), a PWRI file ReLU (ReluFalcon), unless it
    carries ``powerpy.sparse_activation`` "gelu".

    Raises:
        ModelConfigError: the key holds something other than "relu" or "gelu".
    """
    if not sparse:
        return FFNVariant.GELU
    act = kv.get(Keys.SPARSE_ACTIVATION, "relu")
    if not isinstance(act, str) or act not in ("relu", "gelu"):
        raise ModelConfigError(
            f'{source}: key {Keys.SPARSE_ACTIVATION!r} is {shown(act)}; falcon runs "relu" '
            'or "gelu": fix or remove the key'
        )
    return FFNVariant.of(act, gated=False)


FAMILY = Family(
    arch="falcon",
    block=BLOCK,
    ffn_variant=ffn_variant,
    ffn_acts=("relu", "gelu"),
    norm=Norm.LAYER,
    rope=Rope.NEOX,
    residual=Residual.PARALLEL,
    gated=False,
    down_bias="optional",
    output_norm_bias=True,
    notes="falcon's MLP has no gate: --ffn-act relu (ReluFalcon) or gelu",
)
