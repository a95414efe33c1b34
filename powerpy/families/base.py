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

from powerpy.errors import ModelConfigError, shown
from powerpy.formats.constants import Keys, Names


class FFNVariant(str, enum.Enum):
    """How the FFN activation h is computed from gate g and up u
    (docs/architecture.md#sparse-ffn). The last two have no gate."""

    SWIGLU = "swiglu"  # silu(g) * u        dense llama
    REGLU = "reglu"  # relu(g) * u          PWRI llama (ReluLLaMA, ProSparse)
    DRELU = "drelu"  # relu(g) * relu(u)    bamboo
    GEGLU = "geglu"  # gelu_tanh(g) * u    gemma
    RELU = "relu"  # relu(u)                OPT, ReluFalcon
    GELU = "gelu"  # gelu(u) (erf form)     dense Falcon

    @property
    def gated(self) -> bool:
        """The FFN has a gate matrix (``ffn_gate``)."""
        return self not in (FFNVariant.RELU, FFNVariant.GELU)

    @property
    def activation(self) -> str:
        """The activation name HF configs and ``--ffn-act`` use: "silu", "relu" or "gelu"."""
        if self is FFNVariant.SWIGLU:
            return "silu"
        return "gelu" if self in (FFNVariant.GELU, FFNVariant.GEGLU) else "relu"

    @staticmethod
    def of(act: str, gated: bool) -> FFNVariant:
        """The variant of activation ``act`` ("relu", "silu", "gelu") for a gated or ungated
        FFN; raises ``ValueError`` for a pair no family runs."""
        table = {
            (True, "relu"): FFNVariant.REGLU,
            (True, "silu"): FFNVariant.SWIGLU,
            (True, "gelu"): FFNVariant.GEGLU,
            (False, "relu"): FFNVariant.RELU,
            (False, "gelu"): FFNVariant.GELU,
        }
        if (gated, act) not in table:
            kind = "a gated" if gated else "an ungated"
            ok = sorted(a for g, a in table if g == gated)
            raise ValueError(f"{kind} FFN does not run {act!r} (it runs {', '.join(ok)})")
        return table[gated, act]


def ungated_ffn(kv: Mapping[str, Any], sparse: bool, source: str) -> FFNVariant:
    """``Family.ffn_variant`` of an ungated family (falcon, phi2): a dense file runs GELU
    (llama.cpp's), a PWRI file ReLU (ReluFalcon), unless it carries
    ``powerpy.sparse_activation`` "gelu".

    Raises:
        ModelConfigError: the key holds something other than "relu" or "gelu".
    """
    if not sparse:
        return FFNVariant.GELU
    act = kv.get(Keys.SPARSE_ACTIVATION, "relu")
    if not isinstance(act, str) or act not in ("relu", "gelu"):
        raise ModelConfigError(
            f'{source}: key {Keys.SPARSE_ACTIVATION!r} is {shown(act)}; an ungated FFN runs "relu" '
            'or "gelu": fix or remove the key'
        )
    return FFNVariant.of(act, gated=False)


def gated_ffn(dense: FFNVariant) -> Callable[[Mapping[str, Any], bool, str], FFNVariant]:
    """``Family.ffn_variant`` of a gated family: a dense file runs ``dense``; a PWRI file ReGLU
    unless it carries ``powerpy.sparse_activation`` ("silu" or "gelu": that activation, gated).
    """

    def variant(kv: Mapping[str, Any], sparse: bool, source: str) -> FFNVariant:
        if not sparse:
            return dense
        act = kv.get(Keys.SPARSE_ACTIVATION, "relu")
        if not isinstance(act, str) or act not in ("relu", "silu", "gelu"):
            raise ModelConfigError(
                f"{source}: key {Keys.SPARSE_ACTIVATION!r} is {shown(act)}; remove the key or "
                'set it to "relu", "silu" or "gelu"'
            )
        return FFNVariant.of(act, gated=True)

    return variant


class Norm(str, enum.Enum):
    """The normalisation of the residual stream before attention, the FFN and the output."""

    RMS = "rms"  # x / sqrt(mean(x²) + eps) · w, eps from {arch}.attention.layer_norm_rms_epsilon
    LAYER = "layer"  # (x - mean) / sqrt(var + eps) · w + b, eps from ….layer_norm_epsilon

    @property
    def eps_key(self) -> str:
        """The GGUF key of the norm's epsilon (format with ``arch``)."""
        return Keys.RMS_EPS if self is Norm.RMS else Keys.LAYERNORM_EPS


class Rope(str, enum.Enum):
    """How positions enter attention."""

    NORM = "norm"  # ggml's NORM mode: rotate adjacent pairs (2i, 2i+1) of the first n_rot dims
    NEOX = "neox"  # ggml's NEOX mode (HF rotate_half): rotate pairs (i, i + n_rot/2)
    LEARNED = "learned"  # no rotation: rows of ``position_embd`` added to the embeddings


class Residual(str, enum.Enum):
    """How a block adds its attention and FFN to the residual stream."""

    SEQUENTIAL = "sequential"  # h = x + attn(norm(x)); out = h + ffn(norm'(h))
    # out = x + attn(norm2(x)) + ffn(norm(x)): one norm (attn_norm) feeds both, or attention
    # reads its own (attn_norm_2, falcon-40B); the predictor reads x
    PARALLEL = "parallel"


@dataclass(frozen=True)
class LayerTensor:
    """One per-layer tensor: the ``Block`` field it fills, its GGUF name (with ``{l}``) and its
    shape in the model's dimensions (names of ``ModelArgs`` attributes, e.g. "n_ff").

    A matrix's bias, ``{name}.bias`` of shape (rows,), is read with it whenever the file has
    one (``bias="optional"``), must be there (``"required"``), or is refused (``"none"``). A
    vector's bias is the norm's (LayerNorm). ``optional`` tensors may be absent (the field is
    then None). A part of a fused matrix (``part_of``: the fused one's field) is read from the
    file where the fused one is absent, else it is a row view of it (``qkv_block``)."""

    field: str
    name: str
    # (rows, cols) of a matrix, (n,) of a vector, (n_expert, rows, cols) of a stack of experts'
    # matrices (numpy order)
    shape: tuple[str, ...]
    optional: bool = False
    bias: str = "none"  # "none" | "optional" | "required"
    # a fused matrix read as row views: (field, rows as a ModelArgs dimension) per part, in
    # order (falcon's and phi3's attn_qkv -> attn_q, attn_k, attn_v; phi3's ffn_up -> gate, up)
    split: tuple[tuple[str, str], ...] = ()
    # the field of the fused matrix this one is a row block of (attn_q, attn_k, attn_v:
    # "attn_qkv"); a file holds either the fused matrix or each part as its own tensor
    part_of: str = ""


# attn_qkv's row blocks: q, then k, then v
QKV_SPLIT = (("attn_q", "n_embd_q"), ("attn_k", "n_embd_gqa"), ("attn_v", "n_embd_gqa"))


def qkv_block(fused: bool = False) -> tuple[LayerTensor, ...]:
    """The attention projections as llama.cpp's loader takes them for llama, qwen2/3, gemma2/3
    and phi3 (``create_tensor_qkv``): ``attn_q``, ``attn_k`` and ``attn_v``, or one fused
    ``attn_qkv`` (q rows, then k, then v) read as row views of the three. Each has an optional
    bias; a fused matrix takes its own bias or the three parts' (llama.cpp adds either).
    ``fused``: the family's converter writes the fused matrix (phi3), so the parts are the
    optional layout (``optional`` marks the layout files seldom have: the tiny test files
    leave it out); the loader takes either."""
    part = dict(bias="optional", part_of="attn_qkv", optional=fused)
    return (
        LayerTensor(
            "attn_qkv",
            Names.ATTN_QKV,
            ("n_embd_qkv", "n_embd"),
            optional=not fused,
            bias="optional",
            split=QKV_SPLIT,
        ),
        LayerTensor("attn_q", Names.ATTN_Q, ("n_embd_q", "n_embd"), **part),
        LayerTensor("attn_k", Names.ATTN_K, ("n_embd_gqa", "n_embd"), **part),
        LayerTensor("attn_v", Names.ATTN_V, ("n_embd_gqa", "n_embd"), **part),
    )


# The dense FFN's matrices (``Block`` fields) that a mixture of experts replaces, with the down
# matrix; its ffn_norm stays.
DENSE_FFN = ("ffn_gate", "ffn_up")

# Optional keys llama.cpp reads only in the loaders of the families that list them in
# ``Family.reads``: elsewhere a file may carry them (converters copy them) and llama.cpp's
# graph does not apply them, so neither does powerpy.
FAMILY_KEYS = frozenset(
    {
        Keys.ATTENTION_SCALE,
        Keys.ATTN_SOFTCAP,
        Keys.FINAL_SOFTCAP,
        Keys.ROPE_FREQ_BASE_SWA,
        Keys.LEADING_DENSE_BLOCK_COUNT,
        Keys.EXPERT_SHARED_COUNT,
        Keys.EXPERT_GATING_FUNC,
        Keys.NEXTN_PREDICT_LAYERS,
        Keys.ROPE_SCALING_YARN_LOG_MUL,
    }
)

# How a router's logits become the probabilities that choose a token's experts
# (``Keys.EXPERT_GATING_FUNC``'s values 1 to 3): softmax over all experts, a sigmoid of each
# (the weights are the chosen ones' sigmoids), or the chosen logits' softmax (GPT-OSS)
GATINGS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


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
        tied_output: a file without ``output.weight`` reads its logits from ``token_embd``;
            ``output_tensor``: see the field's comment.
        gated: the FFN has ``ffn_gate``.
        down_bias: the down matrix's bias (``ffn_down.bias`` dense, ``ffn_down_t.bias`` PWRI),
            as ``LayerTensor.bias``.
        output_norm_bias: ``output_norm.bias`` (LayerNorm families).
        position_offset: ``Rope.LEARNED`` families read position p at row p + offset.
        embed_scale, scale_q, swa_pattern, key_defaults, reads, extra_args: see the fields'
            comments.
        ffn_variant: the FFN activation a file of this family runs: (key/values, sparse, file
            name for errors) -> variant; ``ffn_acts`` the ``--ffn-act`` values a user may set
            (None: any).
        notes: what a user should know about the family (``powerpy dump``, errors).
        experts: the tensors of a mixture-of-experts FFN (router, gate, up and down stacks;
            docs/moe.md), which replace the dense FFN (``DENSE_FFN``) in a file whose
            ``{arch}.expert_count`` is > 0; () for a family without experts.
        moe_required: every file of the family has experts (qwen3moe); else experts are
            optional (llama: Mixtral-style files).
        expert_ff_key: the key of the experts' FFN width (None: ``feed_forward_length``).
    """

    arch: str
    block: tuple[LayerTensor, ...]
    ffn_variant: Callable[[Mapping[str, Any], bool, str], FFNVariant]
    ffn_acts: tuple[str, ...] | None = None
    norm: Norm = Norm.RMS
    rope: Rope = Rope.NORM
    residual: Residual = Residual.SEQUENTIAL
    tied_output: bool = True
    # the file may hold output.weight; False: the logits always read token_embd and llama.cpp
    # refuses a file with one (gemma2)
    output_tensor: bool = True
    notes: str = ""
    gated: bool = True  # the FFN has ffn_gate
    down_bias: str = "none"  # the down matrix's bias: "none", "optional", "required"
    output_norm_bias: bool = False  # output_norm.bias (LayerNorm families)
    output_bias: bool = False  # output.bias, added to the logits (phi2)
    position_offset: int = 0  # Rope.LEARNED: position p reads row p + offset (OPT: 2)
    embed_scale: bool = False  # the embeddings are scaled by sqrt(n_embd) (gemma)
    # llama.cpp's graph scales q (then rounded to f16 for the cache's dot products), not the
    # scores in the softmax (gemma, phi3): the two round differently
    scale_q: bool = False
    # which layers attend through the file's sliding window: 0 every layer; n: layer l iff
    # l % n < n - 1 (gemma2: 2, gemma3: 6), unless the file's attention.sliding_window_pattern
    # (a period, or one flag per layer) says otherwise; None: none, the key is ignored.
    # llama.cpp reads the window in gemma's graphs only (its llama, qwen2, qwen3, phi3 and
    # falcon graphs attend over the whole context whatever the file says), so None is the
    # default
    swa_pattern: int | None = None
    # (key, value): the value of an optional key (``Keys``, {arch} unformatted) in a file
    # without it, as llama.cpp's loader sets it for this family (gemma2: a 4096 window,
    # soft-caps 50 and 30)
    key_defaults: tuple[tuple[str, Any], ...] = ()
    # the family-specific optional keys (``FAMILY_KEYS``) llama.cpp reads for this family; a
    # file's value of any other is not applied, whatever it says (gemma2's soft-caps, gemma3's
    # final soft-cap and local RoPE base; llama, qwen, phi3 and falcon read none)
    reads: frozenset[str] = frozenset()
    # hyperparameters a family reads beyond the common ones: (key getter, n_layer, file name for
    # errors) -> ModelArgs fields (e.g. gemma's attention scale and local RoPE base)
    extra_args: Callable[[Callable[..., Any], int, str], dict] | None = None
    experts: tuple[LayerTensor, ...] = ()
    moe_required: bool = False
    expert_ff_key: str | None = None
    # the routing when the file's expert_gating_func is absent or 0 (``GATINGS``); a family
    # that does not read the key (``reads``) always routes so
    expert_gating: str = "softmax"
    # the shared expert is expert_shared_count experts wide (n_ff_exp each: glm4moe, deepseek2),
    # not expert_shared_feed_forward_length (qwen2moe)
    shared_by_count: bool = False
    # keys llama.cpp's loader requires for this family (a file without one does not load)
    requires: frozenset[str] = frozenset()
    # the attention: "gqa" (grouped-query heads over a K and a V cache), or "mla" (DeepSeek-2's
    # latent attention: one cache of the compressed latent; ``model/mla.py``)
    attention: str = "gqa"
    # the family's own keys from ``ModelArgs`` (the inverse of ``extra_args``), or None
    args_kv: Callable[[Any], dict] | None = None
    # the experts' activation: "swiglu", or GPT-OSS's clamped "swiglu_oai" (moe_host)
    expert_act: str = "swiglu"

    @property
    def usual_block(self) -> tuple[LayerTensor, ...]:
        """The block's tensors as the family's converter writes them: a fused matrix's other
        layout (the optional one of ``qkv_block``) left out, the tensors test and benchmark
        files are made of."""
        return tuple(
            t for t in self.block if not (t.optional and (t.part_of or self.has_parts(t.field)))
        )

    @property
    def shared_expert(self) -> bool:
        """The family's mixture has a shared expert (``experts.SHARED_EXPERT`` in its block)."""
        return any(t.field == "ffn_up_shexp" for t in self.block)

    def layer_block(self, moe: bool) -> tuple[LayerTensor, ...]:
        """The block's tensors of one layer: a mixture of experts' layer (``moe``: its shared
        expert, no dense FFN), or a dense one (a model's leading dense layers: no shared
        expert)."""
        if moe:
            return tuple(t for t in self.block if t.field not in DENSE_FFN)
        return tuple(t for t in self.block if not t.field.endswith("_shexp"))

    def has_parts(self, field: str) -> bool:
        """Whether the fused matrix ``field`` may come as its parts' own tensors instead."""
        return any(t.part_of == field for t in self.block)
