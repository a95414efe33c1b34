"""Bamboo (GGUF arch ``bamboo``, PowerInfer's Bamboo-7B): a LLaMA block whose FFN is dReLU,
relu(gate) · relu(up), so both halves are sparse. Same tensors and hyperparameter keys as
llama, under the ``bamboo.`` prefix."""

from __future__ import annotations

from powerpy.families.base import Family, FFNVariant
from powerpy.families.llama import BLOCK

FAMILY = Family(
    arch="bamboo",
    block=BLOCK,
    ffn_variant=lambda kv, sparse, source: FFNVariant.DRELU,
    ffn_acts=("relu",),
    notes="bamboo's FFN is dReLU",
)
