"""What a model family declares: the data the loader and the one forward read.

A family (one module in this package, registered in ``__init__``) says how its GGUF names its
hyperparameters and tensors and which of the core's choices its blocks take: the norm, where it
sits, RoPE, the residual layout, the FFN activation and gating, biases, a tied output. The core
(``powerpy.model``) implements each choice once for every family; a new family that needs a
choice the core lacks adds it there, with its test (docs/adding-a-family.md).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class FFNVariant(str, enum.Enum):
    """How the FFN activation h is computed from gate g and up u
    (docs/architecture.md#sparse-ffn)."""

    SWIGLU = "swiglu"  # silu(g) * u        dense llama
    REGLU = "reglu"  # relu(g) * u          PWRI llama (ReluLLaMA, ProSparse)
    DRELU = "drelu"  # relu(g) * relu(u)    bamboo

    @property
    def activation(self) -> str:
        """The activation name HF configs and ``--ffn-act`` use: "silu" or "relu"."""
        return "silu" if self is FFNVariant.SWIGLU else "relu"


class Norm(str, enum.Enum):
    """The normalisation of the residual stream before attention, the FFN and the output."""

    RMS = "rms"  # x / sqrt(mean(x²) + eps) · w, eps from {arch}.attention.layer_norm_rms_epsilon


class Rope(str, enum.Enum):
    """How positions enter attention."""

    NORM = "norm"  # ggml's NORM mode: rotate adjacent pairs (2i, 2i+1) of the first n_rot dims


class Residual(str, enum.Enum):
    """How a block adds its attention and FFN to the residual stream."""

    SEQUENTIAL = "sequential"  # h = x + attn(norm(x)); out = h + ffn(norm'(h))


@dataclass(frozen=True)
class LayerTensor:
    """One per-layer tensor: the ``Block`` field it fills, its GGUF name (with ``{l}``) and its
    shape in the model's dimensions (names of ``ModelArgs`` attributes, e.g. "n_ff")."""

    field: str
    name: str
    shape: tuple[str, ...]  # (rows, cols) of a matrix, (n,) of a vector


@dataclass(frozen=True)
class Family:
    """A model family as data (see the module docstring).

    Attributes:
        arch: the GGUF ``general.architecture`` value.
        norm, rope, residual: the core's choices for this family's blocks.
        block: the per-layer tensors every file of the family has. The FFN's down matrix and
            the predictors are in the dense layout (``ffn_down`` (n_embd, n_ff)) or PowerInfer's
            PWRI layout (``ffn_down_t`` (n_ff, n_embd), ``fc1``, ``fc2``), which the loader
            reads for every family (docs/formats.md#powerinfer-model-file).
        tied_output: a file without ``output.weight`` reads its logits from ``token_embd``.
        ffn_variant: the FFN activation a file of this family runs: (key/values, sparse, file
            name for errors) -> variant; ``ffn_acts`` the ``--ffn-act`` values a user may set
            (None: any).
        notes: what a user should know about the family (``powerpy dump``, errors).
    """

    arch: str
    block: tuple[LayerTensor, ...]
    ffn_variant: Callable[[Mapping[str, Any], bool, str], FFNVariant]
    ffn_acts: tuple[str, ...] | None = None
    norm: Norm = Norm.RMS
    rope: Rope = Rope.NORM
    residual: Residual = Residual.SEQUENTIAL
    tied_output: bool = True
    notes: str = ""
