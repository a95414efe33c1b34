"""HF checkpoints as data, one record per model family (:class:`HFFamily`): how its
``config.json`` becomes ``ModelArgs`` (and what it refuses, naming the config key), and one
table from its tensor names to GGUF names, expected shapes and value transforms.
``pipeline.convert`` reads these records and has no per-family code.

A table row (:class:`HFTensor`) names an HF tensor (``{l}``: the layer), its GGUF name
(``formats.constants.Names``), its HF shape in ``ModelArgs`` dimensions (plus the family's
own, e.g. OPT's ``n_pos``), a transform of its values, whether its ``.bias`` comes along, and
the config flag it depends on. The converter turns ``ffn_down`` into PowerInfer's
``ffn_down_t`` (transposed; its bias renamed) for every family alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from powerpy.config import ModelArgs
from powerpy.errors import ModelConfigError, shown
from powerpy.families import FFNVariant
from powerpy.families.values import scalar as _scalar
from powerpy.formats.constants import GGUFValueType, Keys, Names, bias_name

Transform = Callable[[np.ndarray, ModelArgs], np.ndarray]  # values -> same shape
LM_HEAD = "lm_head.weight"


# ----------------------------------------------------------------------------------- transforms
def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> ggml interleaved pairs, per head (llama.cpp's permute).

    Within each head of ``d`` rows, new row ``2m`` = old row ``m`` and new row ``2m+1`` = old row
    ``m + d/2``: w (n_head * d, n_embd) -> same shape.
    """
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ValueError(f"cannot permute {rows} rows into {n_head} heads of even size")
    d = rows // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk` (ggml interleaved -> HF rotate-half)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute_q(w: np.ndarray, a: ModelArgs) -> np.ndarray:
    return permute_qk(w, a.n_head)


def _permute_k(w: np.ndarray, a: ModelArgs) -> np.ndarray:
    return permute_qk(w, a.n_head_kv)


def jploski_qkv(w: np.ndarray, a: ModelArgs) -> np.ndarray:
    """Falcon's fused ``query_key_value`` rows -> the "jploski" layout: every q head, then the
    k heads, then the v heads.

    HF stores ``n_head_kv`` groups, each ``n_head / n_head_kv`` q heads then one k and one v head
    (7B: one group; 40B: one per kv head): w (n_embd_qkv, n_embd) or its bias (n_embd_qkv,)
    -> same shape.
    """
    g, rest = a.n_head // a.n_head_kv, w.shape[1:]
    qkv = w.reshape(a.n_head_kv, g + 2, a.head_dim, *rest)  # (groups, g q + k + v, head_dim, ..)
    q = qkv[:, :g].reshape(-1, *rest)  # (n_head * head_dim, ..)
    k, v = qkv[:, g].reshape(-1, *rest), qkv[:, g + 1].reshape(-1, *rest)  # (n_embd_gqa, ..)
    return np.concatenate([q, k, v])


# ----------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class HFTensor:
    """One row of a family's table (see the module docstring).

    Attributes:
        hf: the checkpoint's name (``{l}``: the layer).
        gguf: the GGUF name (``Names``), ``{l}`` likewise.
        shape: the HF shape in dimensions (``ModelArgs`` attributes or the family's ``dims``),
            space-separated.
        transform: values -> values of the same shape (applied to the bias too).
        bias: ``{hf}.bias`` -> ``{gguf}.bias`` (rows,) too: True always, a flag name when set.
        when: the row exists only when this flag is set (``"!flag"``: when it is not).
        optional: the row is skipped when the checkpoint lacks the tensor.
    """

    hf: str
    gguf: str
    shape: str
    transform: Transform | None = None
    bias: bool | str = False
    when: str | None = None
    optional: bool = False


@dataclass(frozen=True)
class HFFamily:
    """How one HF model family's checkpoint becomes a GGUF file.

    Attributes:
        arch: the GGUF architecture written.
        model_types: config.json ``model_type`` values of the family.
        args: (config.json, source) -> ``ModelArgs`` (a dense model), refusing what the core
            cannot run with a ``ModelConfigError`` that names the key.
        head, block, tail: the tables: tensors before the layers, per layer, after them.
        flags: config.json -> the flags rows depend on; ``"tied"`` set means the output is the
            embeddings (an ``lm_head.weight`` in the checkpoint is their copy).
        dims: (config.json, args) -> dimensions beyond ``ModelArgs``'s.
        kv: (config.json, args) -> key/values beyond ``ModelArgs.to_gguf_kv``.
        drop_keys: ``to_gguf_kv`` keys (with ``{arch}``) the family's files do not have.
        aliases: (prefix, canonical prefix): checkpoints that name tensors differently.
        skip: checkpoint tensors that are not weights (a regex).
        vocab_pre: the default ``tokenizer.ggml.pre`` of a BPE vocabulary.
    """

    arch: str
    model_types: tuple[str, ...]
    args: Callable[[Mapping[str, Any], str], ModelArgs]
    head: tuple[HFTensor, ...]
    block: tuple[HFTensor, ...]
    tail: tuple[HFTensor, ...]
    flags: Callable[[Mapping[str, Any]], dict[str, bool]] = lambda cfg: {}
    dims: Callable[[Mapping[str, Any], ModelArgs], dict[str, int]] = lambda cfg, a: {}
    kv: Callable[[Mapping[str, Any], ModelArgs], dict[str, tuple]] = lambda cfg, a: {}
    drop_keys: tuple[str, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    skip: str = r".*\.rotary_emb\.inv_freq"
    vocab_pre: str = "default"


@dataclass(frozen=True)
class Planned:
    """One tensor to write: its checkpoint name, GGUF name, shape (HF's, kept by the transform)
    and transform."""

    hf: str
    gguf: str
    shape: tuple[int, ...]
    transform: Transform | None


# ----------------------------------------------------------------------------------- config.json
class _Config:
    """A config.json's values, checked one at a time; errors start with the file's name."""

    def __init__(self, cfg: Mapping[str, Any], source: str) -> None:
        self.cfg, self.source = cfg, source

    def get(self, key: str, default: Any = None, kind: type = int) -> Any:
        """``key``'s one number, or ``default`` (None: required)."""
        if self.cfg.get(key) is None:
            if default is None:
                raise ModelConfigError(f"{self.source}: config.json needs {kind.__name__} {key!r}")
            return default
        return _scalar(self.cfg[key], key, kind, self.source)

    def refuse(self, key: str, bad: bool, why: str) -> None:
        """Raise when ``bad``: ``key``'s value is not supported, and ``why``."""
        if bad:
            raise ModelConfigError(
                f"{self.source}: {key} {shown(self.cfg.get(key))} is not supported: {why}"
            )

    def rope_base(self) -> float:
        """RoPE's base: ``rope_theta``, or transformers 5's ``rope_parameters.rope_theta``;
        scaled RoPE is refused."""
        self.refuse("rope_scaling", bool(self.cfg.get("rope_scaling")), "powerpy runs plain RoPE")
        rp = self.cfg.get("rope_parameters")
        if isinstance(rp, Mapping):
            kind = rp.get("rope_type", rp.get("type", "default"))
            if kind not in (None, "default"):
                raise ModelConfigError(
                    f"{self.source}: rope_parameters rope_type {kind!r} is not supported: "
                    "powerpy runs plain RoPE"
                )
            if rp.get("rope_theta") is not None:
                return _scalar(rp["rope_theta"], "rope_parameters.rope_theta", float, self.source)
        return self.get("rope_theta", 10000.0, float)


def _llama_args(cfg: Mapping[str, Any], source: str) -> ModelArgs:
    """LLaMA and Mistral: GQA, RMSNorm, SwiGLU (ReGLU for ``hidden_act`` relu), no biases."""
    c = _Config(cfg, source)
    rope_base = c.rope_base()
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelConfigError(f"{source}: attention/MLP biases are not supported")
    n_embd, n_head = c.get("hidden_size"), c.get("num_attention_heads")
    head_dim = c.get("head_dim", n_embd // n_head if n_head > 0 else 0)
    if head_dim * n_head != n_embd:
        raise ModelConfigError(
            f"{source}: hidden_size {n_embd}, num_attention_heads {n_head} and head_dim "
            f"{head_dim} are not a supported LLaMA layout (head_dim x heads = hidden_size)"
        )
    act = cfg.get("hidden_act", "silu")  # HF LlamaConfig's default
    act = "silu" if act == "swish" else act
    if act not in ("relu", "silu"):
        raise ModelConfigError(f"{source}: hidden_act {act!r} is not one of relu, silu")
    args = ModelArgs(
        arch="llama",
        n_vocab=c.get("vocab_size"),
        n_embd=n_embd,
        n_layer=c.get("num_hidden_layers"),
        n_ff=c.get("intermediate_size"),
        n_head=n_head,
        n_head_kv=c.get("num_key_value_heads", n_head),
        n_rot=head_dim,
        rope_base=rope_base,
        norm_eps=c.get("rms_norm_eps", 1e-5, float),
        n_ctx_train=c.get("max_position_embeddings", 2048),
        sparse=False,
        ffn_variant=FFNVariant.REGLU if act == "relu" else FFNVariant.SWIGLU,
        sparse_threshold=0.0,
    )
    args.validate(source)
    return args


def _falcon_norms(cfg: Mapping[str, Any], source: str) -> bool:
    """Whether each block has two norms (``ln_attn``, ``ln_mlp``): new_decoder_architecture
    with num_ln_in_parallel_attn 2 (its default)."""
    new = bool(cfg.get("new_decoder_architecture"))
    n_ln = cfg.get("num_ln_in_parallel_attn")
    _Config(cfg, source).refuse(
        "num_ln_in_parallel_attn",
        n_ln not in (None, 1, 2) or (n_ln == 2 and not new),
        "a block has 1 norm, or 2 with new_decoder_architecture",
    )
    return new and n_ln in (None, 2)


def _falcon_args(cfg: Mapping[str, Any], source: str) -> ModelArgs:
    """Falcon: parallel attention and MLP, LayerNorm, NeoX RoPE, multi-query (7B) or grouped
    (40B, new_decoder_architecture) attention, an ungated GELU or ReLU MLP."""
    c = _Config(cfg, source)
    c.refuse("alibi", bool(cfg.get("alibi")), "powerpy's falcon runs RoPE")
    c.refuse(
        "parallel_attn",
        cfg.get("parallel_attn", True) is False,
        "powerpy's falcon runs attention and MLP in parallel",
    )
    rope_base = c.rope_base()
    _falcon_norms(cfg, source)
    act = cfg.get("activation", "gelu")  # HF FalconConfig's default
    c.refuse("activation", act not in ("gelu", "relu"), 'falcon runs "gelu" or "relu"')
    n_embd, n_head = c.get("hidden_size"), c.get("num_attention_heads")
    if cfg.get("new_decoder_architecture"):
        n_head_kv = c.get("num_kv_heads", n_head)
    else:
        n_head_kv = 1 if cfg.get("multi_query", True) else n_head
    args = ModelArgs(
        arch="falcon",
        n_vocab=c.get("vocab_size"),
        n_embd=n_embd,
        n_layer=c.get("num_hidden_layers"),
        n_ff=c.get("ffn_hidden_size", 4 * n_embd),
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_rot=n_embd // n_head if n_head > 0 else 0,
        rope_base=rope_base,
        norm_eps=c.get("layer_norm_epsilon", 1e-5, float),
        n_ctx_train=c.get("max_position_embeddings", 2048),
        sparse=False,
        ffn_variant=FFNVariant.of(act, gated=False),
        sparse_threshold=0.0,
    )
    args.validate(source)
    return args


def _opt_args(cfg: Mapping[str, Any], source: str) -> ModelArgs:
    """OPT: pre-LayerNorm blocks, learned positions, biases everywhere, a ReLU MLP."""
    c = _Config(cfg, source)
    n_embd, n_head = c.get("hidden_size"), c.get("num_attention_heads")
    proj = cfg.get("word_embed_proj_dim")
    c.refuse(
        "word_embed_proj_dim",
        proj is not None and proj != n_embd,
        f"embeddings projected in and out of hidden_size {n_embd} (project_in/project_out, "
        "OPT-350M) are not supported",
    )
    for key, default, why in (
        ("do_layer_norm_before", True, "powerpy runs OPT's pre-norm blocks only"),
        ("_remove_final_layer_norm", False, "powerpy's OPT has a final norm"),
        ("layer_norm_elementwise_affine", True, "powerpy's OPT norms have a weight and a bias"),
        ("activation_function", "relu", 'OPT runs "relu"'),
        ("enable_bias", True, "powerpy's OPT has biases on every linear layer"),
    ):
        c.refuse(key, cfg.get(key, default) != default, why)
    args = ModelArgs(
        arch="opt",
        n_vocab=c.get("vocab_size"),
        n_embd=n_embd,
        n_layer=c.get("num_hidden_layers"),
        n_ff=c.get("ffn_dim"),
        n_head=n_head,
        n_head_kv=n_head,
        n_rot=n_embd // n_head if n_head > 0 else 0,  # unused: learned positions
        rope_base=10000.0,
        norm_eps=1e-5,  # HF OPT's nn.LayerNorm default
        n_ctx_train=c.get("max_position_embeddings", 2048),
        sparse=False,
        ffn_variant=FFNVariant.RELU,
        sparse_threshold=0.0,
    )
    args.validate(source)
    return args


# ----------------------------------------------------------------------------------- tables
_L = "model.layers.{l}."
LLAMA = HFFamily(
    arch="llama",
    model_types=("llama", "mistral"),
    args=_llama_args,
    head=(HFTensor("model.embed_tokens.weight", Names.TOKEN_EMBD, "n_vocab n_embd"),),
    block=(
        HFTensor(_L + "input_layernorm.weight", Names.ATTN_NORM, "n_embd"),
        HFTensor(_L + "self_attn.q_proj.weight", Names.ATTN_Q, "n_embd n_embd", _permute_q),
        HFTensor(_L + "self_attn.k_proj.weight", Names.ATTN_K, "n_embd_gqa n_embd", _permute_k),
        HFTensor(_L + "self_attn.v_proj.weight", Names.ATTN_V, "n_embd_gqa n_embd"),
        HFTensor(_L + "self_attn.o_proj.weight", Names.ATTN_OUTPUT, "n_embd n_embd"),
        HFTensor(_L + "post_attention_layernorm.weight", Names.FFN_NORM, "n_embd"),
        HFTensor(_L + "mlp.gate_proj.weight", Names.FFN_GATE, "n_ff n_embd"),
        HFTensor(_L + "mlp.up_proj.weight", Names.FFN_UP, "n_ff n_embd"),
        HFTensor(_L + "mlp.down_proj.weight", Names.FFN_DOWN, "n_embd n_ff"),
    ),
    tail=(
        HFTensor("model.norm.weight", Names.OUTPUT_NORM, "n_embd"),
        HFTensor(LM_HEAD, Names.OUTPUT, "n_vocab n_embd", optional=True),
    ),
)

_F = "transformer.h.{l}."
FALCON = HFFamily(
    arch="falcon",
    model_types=("falcon",),
    args=_falcon_args,
    head=(HFTensor("transformer.word_embeddings.weight", Names.TOKEN_EMBD, "n_vocab n_embd"),),
    block=(
        HFTensor(
            _F + "input_layernorm.weight",
            Names.ATTN_NORM,
            "n_embd",
            bias=True,
            when="!two_norms",
        ),
        # 40B: ln_mlp feeds the MLP (attn_norm), ln_attn the attention (attn_norm_2)
        HFTensor(_F + "ln_mlp.weight", Names.ATTN_NORM, "n_embd", bias=True, when="two_norms"),
        HFTensor(_F + "ln_attn.weight", Names.ATTN_NORM_2, "n_embd", bias=True, when="two_norms"),
        HFTensor(
            _F + "self_attention.query_key_value.weight",
            Names.ATTN_QKV,
            "n_embd_qkv n_embd",
            jploski_qkv,
            bias="bias",
        ),
        HFTensor(
            _F + "self_attention.dense.weight", Names.ATTN_OUTPUT, "n_embd n_embd", bias="bias"
        ),
        HFTensor(_F + "mlp.dense_h_to_4h.weight", Names.FFN_UP, "n_ff n_embd", bias="bias"),
        HFTensor(_F + "mlp.dense_4h_to_h.weight", Names.FFN_DOWN, "n_embd n_ff", bias="bias"),
    ),
    tail=(
        HFTensor("transformer.ln_f.weight", Names.OUTPUT_NORM, "n_embd", bias=True),
        HFTensor(LM_HEAD, Names.OUTPUT, "n_vocab n_embd", when="!tied"),
    ),
    flags=lambda cfg: {
        "bias": bool(cfg.get("bias", False)),
        "two_norms": _falcon_norms(cfg, "config.json"),
        "tied": cfg.get("tie_word_embeddings", True) is not False,
    },
    kv=lambda cfg, a: {
        Keys.TENSOR_DATA_LAYOUT.format(arch=a.arch): ("jploski", GGUFValueType.STRING)
    },
    vocab_pre="falcon",
)

_O = "model.decoder.layers.{l}."
OPT = HFFamily(
    arch="opt",
    model_types=("opt",),
    args=_opt_args,
    head=(
        HFTensor("model.decoder.embed_tokens.weight", Names.TOKEN_EMBD, "n_vocab n_embd"),
        # the whole table: position p is row p + 2 (HF's offset), as the family reads it
        HFTensor("model.decoder.embed_positions.weight", Names.POS_EMBD, "n_pos n_embd"),
    ),
    block=(
        HFTensor(_O + "self_attn_layer_norm.weight", Names.ATTN_NORM, "n_embd", bias=True),
        HFTensor(_O + "self_attn.q_proj.weight", Names.ATTN_Q, "n_embd n_embd", bias=True),
        HFTensor(_O + "self_attn.k_proj.weight", Names.ATTN_K, "n_embd_gqa n_embd", bias=True),
        HFTensor(_O + "self_attn.v_proj.weight", Names.ATTN_V, "n_embd_gqa n_embd", bias=True),
        HFTensor(_O + "self_attn.out_proj.weight", Names.ATTN_OUTPUT, "n_embd n_embd", bias=True),
        HFTensor(_O + "final_layer_norm.weight", Names.FFN_NORM, "n_embd", bias=True),
        HFTensor(_O + "fc1.weight", Names.FFN_UP, "n_ff n_embd", bias=True),
        HFTensor(_O + "fc2.weight", Names.FFN_DOWN, "n_embd n_ff", bias=True),
    ),
    tail=(
        HFTensor("model.decoder.final_layer_norm.weight", Names.OUTPUT_NORM, "n_embd", bias=True),
    ),
    flags=lambda cfg: {"tied": True},  # the family's output is always token_embd
    dims=lambda cfg, a: {"n_pos": a.n_ctx_train + 2},
    drop_keys=(Keys.ROPE_DIMENSION_COUNT, Keys.ROPE_FREQ_BASE),  # learned positions
    aliases=(("decoder.", "model.decoder."),),  # checkpoints saved from OPTModel
    vocab_pre="gpt-2",
)

HF_FAMILIES = (LLAMA, FALCON, OPT)


# ----------------------------------------------------------------------------------- lookups
def hf_family(cfg: Mapping[str, Any], source: str = "config.json") -> HFFamily:
    """The family of a config.json's ``model_type``.

    Raises:
        ModelConfigError: a model type no family converts (the message lists those that do).
    """
    mt = cfg.get("model_type")
    for fam in HF_FAMILIES:
        if mt in fam.model_types:
            return fam
    known = tuple(t for f in HF_FAMILIES for t in f.model_types)
    raise ModelConfigError(f"{source}: model_type {mt!r} is not supported (supported: {known})")


def args_from_hf_config(cfg: Mapping[str, Any], source: str = "config.json") -> ModelArgs:
    """The ``ModelArgs`` (a dense model) of an HF ``config.json``.

    Raises:
        ModelConfigError: an unsupported model type or layout (naming the config key), or a
            missing/bad value.
    """
    return hf_family(cfg, source).args(cfg, source)


def plan_tensors(
    fam: HFFamily,
    cfg: Mapping[str, Any],
    args: ModelArgs,
    shapes: Mapping[str, tuple[int, ...]],
    source: str,
) -> tuple[list[Planned], tuple[str, str] | None]:
    """The tensors to write from a checkpoint holding ``shapes`` (HF name -> shape), in order,
    and ``(lm_head, embeddings)`` names when the checkpoint holds a tied output's copy (the
    caller checks the values are equal, then drops it).

    Raises:
        ValueError: a tensor is missing or has another shape, or the checkpoint holds tensors
            that are not part of the model (the message names them).
    """
    flags = fam.flags(cfg)
    dims = fam.dims(cfg, args)
    names: dict[str, str] = {}  # canonical name -> the checkpoint's
    for name in shapes:
        canon = name
        for alias, prefix in fam.aliases:
            if name.startswith(alias):
                canon = prefix + name[len(alias) :]
        names[canon] = name

    def on(flag: str | bool | None) -> bool:
        if flag is None or isinstance(flag, bool):
            return flag is not False
        return not flags[flag[1:]] if flag.startswith("!") else flags[flag]

    out: list[Planned] = []

    def add(hf: str, gguf: str, shape: tuple[int, ...], t: HFTensor) -> None:
        if hf not in names:
            raise ValueError(f"{source}: tensor {hf!r} is missing")
        found = shapes[names[hf]]
        if found != shape:
            raise ValueError(f"{source}: tensor {hf!r} has shape {found}, expected {shape}")
        out.append(Planned(names.pop(hf), gguf, shape, t.transform))

    rows = [(t, None) for t in fam.head]
    rows += [(t, l) for l in range(args.n_layer) for t in fam.block]
    rows += [(t, None) for t in fam.tail]
    for t, l in rows:
        hf, gguf = t.hf.format(l=l), t.gguf.format(l=l)
        if not on(t.when) or (t.optional and hf not in names):
            continue
        shape = tuple(dims[d] if d in dims else getattr(args, d) for d in t.shape.split())
        add(hf, gguf, shape, t)
        if t.bias is not False and on(t.bias):
            add(bias_name(hf), bias_name(gguf), shape[:1], t)
    tied = None
    if flags.get("tied") and LM_HEAD in names:
        tied = (names.pop(LM_HEAD), next(p.hf for p in out if p.gguf == Names.TOKEN_EMBD))
    skip = re.compile(fam.skip)
    left = sorted(n for c, n in names.items() if not skip.fullmatch(c))
    if left:
        raise ValueError(
            f"{source}: {len(left)} tensors are not part of the {fam.arch} layout, e.g. {left[:3]}"
        )
    return out, tied
