"""The model families powerpy runs, one module each (``base.Family``: what a family declares).

``family(arch)`` finds one by its GGUF ``general.architecture``.
"""

from __future__ import annotations

from powerpy.errors import ModelConfigError, shown
from powerpy.families import (
    bamboo,
    deepseek,
    falcon,
    gemma,
    glm,
    gptoss,
    llama,
    opt,
    phi2,
    phi3,
    qwen,
    stablelm,
)
from powerpy.families.base import Family, FFNVariant, LayerTensor, Norm, Residual, Rope

FAMILIES: dict[str, Family] = {
    f.arch: f
    for f in (
        llama.FAMILY,
        bamboo.FAMILY,
        falcon.FAMILY,
        opt.FAMILY,
        qwen.QWEN2,
        qwen.QWEN3,
        qwen.QWEN3MOE,
        qwen.QWEN2MOE,
        gemma.GEMMA,
        gemma.GEMMA2,
        gemma.GEMMA3,
        phi3.FAMILY,
        phi2.FAMILY,
        stablelm.FAMILY,
        glm.FAMILY,
        deepseek.FAMILY,
        gptoss.FAMILY,
    )
}
SUPPORTED_ARCHS = tuple(FAMILIES)

__all__ = [
    "FAMILIES",
    "SUPPORTED_ARCHS",
    "Family",
    "FFNVariant",
    "LayerTensor",
    "Norm",
    "Residual",
    "Rope",
    "family",
]


def family(arch: object, source: str = "model") -> Family:
    """The family of GGUF architecture ``arch``.

    Raises:
        ModelConfigError: an architecture powerpy does not run (the message lists those it
            does).
    """
    if isinstance(arch, str) and arch in FAMILIES:
        return FAMILIES[arch]
    raise ModelConfigError(
        f"{source}: architecture {shown(arch)} is not supported (supported: {', '.join(FAMILIES)})"
    )
