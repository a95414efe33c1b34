"""Hyperparameters (``ModelArgs``) from GGUF key/values, and to GGUF key/values (an HF
config.json's: ``pipeline.hf_families``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from powerpy.errors import ModelConfigError
from powerpy.families import SUPPORTED_ARCHS, Family, FFNVariant, Rope, family
from powerpy.families.base import FAMILY_KEYS
from powerpy.families.experts import check_experts, expert_args
from powerpy.families.gguf_keys import model_kv
from powerpy.families.rope_scaling import attn_factor, read_scaling
from powerpy.families.values import float_list, layer_list, scalar, windowed_layers
from powerpy.formats.constants import GGUFValueType, Keys, Names

if TYPE_CHECKING:
    from powerpy.formats.gguf_reader import GGUFFile

__all__ = ["SUPPORTED_ARCHS", "FFNVariant", "ModelArgs", "DEFAULT_CTX", "ACTIVATIONS"]


DEFAULT_CTX = 4096  # positions of a KV cache when none is given (llama-server's default)
MAX_LAYERS = 1 << 16  # a block_count above this is a corrupt file (the largest models have ~200)


ACTIVATIONS = ("relu", "silu", "gelu")  # --ffn-act, config.json sparse_activation, hidden_act


# the key each hyperparameter is read from (named by the refusals of ``ModelArgs.validate``)
_FIELD_KEYS = {
    "rope_base": Keys.ROPE_FREQ_BASE,
    "rope_scale": Keys.ROPE_SCALING_FACTOR,
    "rope_attn_factor": Keys.ROPE_SCALING_ATTN_FACTOR,
    "key_length": Keys.KEY_LENGTH,
    "sliding_window": Keys.SLIDING_WINDOW,
    "rope_orig_ctx": Keys.ROPE_SCALING_ORIG_CTX,
    "rope_base_swa": Keys.ROPE_FREQ_BASE_SWA,
    "attn_scale": Keys.ATTENTION_SCALE,
    "attn_softcap": Keys.ATTN_SOFTCAP,
    "final_softcap": Keys.FINAL_SOFTCAP,
    "n_rot": Keys.ROPE_DIMENSION_COUNT,
    "rope_ext_factor": Keys.ROPE_SCALING_YARN_EXT_FACTOR,
    "rope_yarn_beta_fast": Keys.ROPE_SCALING_YARN_BETA_FAST,
    "rope_yarn_beta_slow": Keys.ROPE_SCALING_YARN_BETA_SLOW,
    "rope_yarn_log_mul": Keys.ROPE_SCALING_YARN_LOG_MUL,
}


@dataclass(frozen=True)
class ModelArgs:
    """Hyperparameters of a model of one family (``powerpy.families``), read from the file's
    key/values."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_rot: int  # rotary dims per head
    rope_base: float
    norm_eps: float
    n_ctx_train: int
    sparse: bool  # PWRI magic: predictor-gated FFN
    ffn_variant: FFNVariant
    sparse_threshold: float  # from powerinfer.sparse_threshold, else 0.0
    # powerpy.dense_layers: layers whose FFN runs ungated in sparse mode (their predictor
    # costs more than it saves), sorted; () gates every layer, as PowerInfer does
    dense_layers: tuple[int, ...] = ()
    # powerpy.ffn_down_threshold: per layer, the cut t_l >= 0 on |h_j|·‖ffn_down_t[j]‖ below
    # which a computed neuron's down row is skipped in sparse mode; () or 0: no cut
    down_thresholds: tuple[float, ...] = ()
    # a mixture of experts (docs/moe.md): experts per layer (0: a dense FFN), experts routed per
    # token, each expert's FFN width, whether the k routing weights are renormalized to sum to 1
    # and a factor on them (0 or 1: none)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_norm: bool = True
    expert_scale: float = 0.0
    n_ff_shexp: int = 0  # the shared expert's FFN width (qwen2moe); 0: no shared expert
    n_expert_shared: int = 0  # shared experts of n_ff_exp each (glm4moe, deepseek2)
    expert_gating: str = "softmax"  # "softmax", "sigmoid", "softmax_weight" (families.GATINGS)
    # expert groups: a token's experts come from its n_group_used best groups (0: no groups)
    n_expert_groups: int = 0
    n_group_used: int = 0
    n_layer_dense: int = 0  # the first layers' FFN is dense (leading_dense_block_count)
    n_layer_nextn: int = 0  # NextN layers after the n_layer the model runs (loaded, not run)
    key_length: int = 0  # head size, when the file sets it (gemma); 0: n_embd / n_head
    sliding_window: int = 0  # a query at p sees keys at p - window + 1 .. p; 0: all
    swa_layers: tuple[int, ...] = ()  # the layers that use the window (the family's pattern)
    rope_base_swa: float = 0.0  # the windowed layers' RoPE base (gemma3); 0: rope_base
    rope_scale_swa: float = 0.0  # … and their linear scaling (gemma3: 1); 0: rope_scale
    rope_scale: float = 1.0  # linear RoPE scaling: position p turns as p / rope_scale
    # YaRN (families/rope_scaling.py): the ramp's extrapolation mix (0: no YaRN), its corner
    # dims' betas, DeepSeek-2's log multiplier of the attention's magnitude
    rope_ext_factor: float = 0.0
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_log_mul: float = 0.0
    # DeepSeek-2's latent attention (families/deepseek.py, model/mla.py): q's low rank (0: a
    # plain attn_q), the latent each cache row holds (with the n_rot RoPE dims), a head's q·k
    # and value widths; kv_b: the file's attn_kv_b (not split into attn_k_b and attn_v_b)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    key_length_mla: int = 0
    value_length_mla: int = 0
    kv_b: bool = False
    rope_attn_factor: float = 1.0  # scales cos and sin (phi3's long-context factor)
    rope_orig_ctx: int = 0  # the context the short RoPE factors are for (phi3)
    attn_scale: float = 0.0  # the q·k scale; 0: 1 / sqrt(head size)
    attn_softcap: float = 0.0  # attention scores -> cap·tanh(s / cap) (gemma2); 0: none
    final_softcap: float = 0.0  # logits -> cap·tanh(l / cap) (gemma2); 0: none

    @property
    def family(self) -> Family:
        """What the model's family declares (its tensors, norm, RoPE, residual, FFN)."""
        return family(self.arch)

    @property
    def moe(self) -> bool:
        """The FFN is a mixture of experts (``n_expert`` > 0)."""
        return self.n_expert > 0

    def layer_moe(self, l: int) -> bool:
        """Whether layer l's FFN is a mixture of experts (the leading dense layers' is not)."""
        return self.moe and l >= self.n_layer_dense

    @property
    def rope_mscale(self) -> float:
        """What ggml's RoPE multiplies cos and sin by: llama.cpp's ``yarn_attn_factor``."""
        return attn_factor(self)

    @property
    def qk_nope(self) -> int:
        """MLA: the dims of a q·k head that RoPE does not turn."""
        return self.key_length_mla - self.n_rot

    @property
    def n_embd_mla_q(self) -> int:
        return self.n_head * self.key_length_mla

    @property
    def n_embd_mla_v(self) -> int:
        return self.n_head * self.value_length_mla

    @property
    def kv_a_rows(self) -> int:
        """MLA: rows of ``attn_kv_a_mqa``, the latent then the shared RoPE dims."""
        return self.kv_lora_rank + self.n_rot

    @property
    def n_embd_kv_b(self) -> int:
        """MLA: rows of a fused ``attn_kv_b``: per head its q·k rows, then its value rows."""
        return self.n_head * (self.qk_nope + self.value_length_mla)

    @property
    def ffn_neurons(self) -> int:
        """Neurons of one layer's FFN: ``n_ff``, or ``n_expert · n_ff_exp`` for a mixture of
        experts, where neuron ``e · n_ff_exp + j`` is neuron j of expert e (statistics, GPU
        indexes and placements count these)."""
        return self.n_expert * self.n_ff_exp if self.moe else self.n_ff

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head

    @property
    def n_embd_q(self) -> int:
        """Rows of ``attn_q`` (columns of ``attn_output``): every head's q."""
        return self.head_dim * self.n_head

    @property
    def n_embd_gqa(self) -> int:
        return self.head_dim * self.n_head_kv

    @property
    def n_ff_gate_up(self) -> int:
        """Rows of a fused ``ffn_up`` holding the gate, then the up rows (phi3)."""
        return 2 * self.n_ff

    @property
    def n_embd_qkv(self) -> int:
        """Rows of a fused ``attn_qkv``: q, then k, then v."""
        return self.n_embd_q + 2 * self.n_embd_gqa

    @property
    def default_n_ctx(self) -> int:
        """The context of a cache or a placement when none is given: the training context, at
        most :data:`DEFAULT_CTX` (one default for ``new_cache``, ``gen-gpuidx``, ``infer`` and
        ``serve``, so a placement's KV reservation and the caches agree)."""
        return min(self.n_ctx_train, DEFAULT_CTX) if self.n_ctx_train > 0 else DEFAULT_CTX

    @classmethod
    def from_gguf_kv(
        cls,
        kv: Mapping[str, Any],
        *,
        sparse: bool,
        n_vocab: int | None = None,
        kv_types: Mapping[str, GGUFValueType] | None = None,
        source: str = "model",
        n_positions: int | None = None,
    ) -> ModelArgs:
        """Build the arguments from GGUF key/values, checking every value's type and range.

        Args:
            kv: the file's key/values.
            sparse: True for a PWRI file.
            n_vocab: vocabulary size when the file has no token list (token_embd rows).
            kv_types: value types, to check that the threshold key is FLOAT32.
            source: file name for error messages.
            n_positions: positions a learned-position table holds (its rows less the family's
                offset): the training context is at most that.

        Raises:
            ModelConfigError: unsupported architecture, a missing key, a value of the wrong type
                or out of range, or inconsistent values (the message names key and value).
        """
        fam = family(kv.get(Keys.ARCHITECTURE), source)
        arch = fam.arch

        defaults = dict(fam.key_defaults)

        def get(key: str, default: Any = None, kind: type = int) -> Any:
            """The key's value checked as one ``kind``; an optional key (``default`` given)
            the family ignores, or absent, is the family's default for it, else ``default``."""
            name = key.format(arch=arch)
            if key in FAMILY_KEYS and key not in fam.reads:
                return default
            if name not in kv:
                default = None if key in fam.requires else defaults.get(key, default)
                if default is None:
                    raise ModelConfigError(f"{source}: required key {name!r} is missing")
                return default
            return scalar(kv[name], name, kind, source)

        tokens = kv.get(Keys.TOKENS)
        n_tokens = len(tokens) if isinstance(tokens, (list, tuple)) else None
        n_embd, n_head = get(Keys.EMBEDDING_LENGTH), get(Keys.HEAD_COUNT)
        thr = 0.0
        if sparse and Keys.SPARSE_THRESHOLD in kv:
            found = (kv_types or {}).get(Keys.SPARSE_THRESHOLD, GGUFValueType.FLOAT32)
            if found != GGUFValueType.FLOAT32:
                raise ModelConfigError(
                    f"{source}: key {Keys.SPARSE_THRESHOLD} must be FLOAT32, found {found!r}"
                )
            thr = scalar(kv[Keys.SPARSE_THRESHOLD], Keys.SPARSE_THRESHOLD, float, source)
        dense_layers: tuple[int, ...] = ()
        if sparse and Keys.DENSE_LAYERS in kv:
            dense_layers = layer_list(kv[Keys.DENSE_LAYERS], Keys.DENSE_LAYERS, source)
        n_expert = get(Keys.EXPERT_COUNT, 0)
        moe = expert_args(fam, n_expert, sparse, get, source)
        cuts: tuple[float, ...] = ()
        if (sparse or n_expert) and Keys.FFN_DOWN_THRESHOLD in kv:
            cuts = float_list(kv[Keys.FFN_DOWN_THRESHOLD], Keys.FFN_DOWN_THRESHOLD, source)
        variant = fam.ffn_variant(kv, sparse, source)
        n_blocks, nextn = get(Keys.BLOCK_COUNT), get(Keys.NEXTN_PREDICT_LAYERS, 0)
        n_layer = n_blocks - nextn  # llama.cpp loads the NextN layers and does not run them
        if not 0 < n_layer <= MAX_LAYERS or nextn < 0:
            raise ModelConfigError(
                f"{source}: {Keys.BLOCK_COUNT.format(arch=arch)} is {n_blocks} with {nextn} "
                f"NextN layers; it must run between 1 and {MAX_LAYERS}: the file's keys are "
                "corrupt: re-convert the model"
            )
        key_length = get(Keys.KEY_LENGTH, 0)
        head_dim = key_length or (n_embd // n_head if n_head > 0 else 0)
        if get(Keys.VALUE_LENGTH, head_dim) != head_dim and fam.attention != "mla":
            raise ModelConfigError(
                f"{source}: {Keys.VALUE_LENGTH.format(arch=arch)} differs from the key length "
                f"{head_dim}; powerpy runs heads whose keys and values have one size"
            )
        window = get(Keys.SLIDING_WINDOW, 0)
        extra = {} if fam.extra_args is None else fam.extra_args(get, n_layer, source)
        swa_layers: tuple[int, ...] = ()
        if window and fam.swa_pattern is not None:
            swa_layers = windowed_layers(kv, fam, n_layer, source)
        args = cls(
            arch=arch,
            n_vocab=get(Keys.VOCAB_SIZE, n_tokens or n_vocab or 0),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=get(Keys.FEED_FORWARD_LENGTH),
            n_head=n_head,
            n_head_kv=get(Keys.HEAD_COUNT_KV, n_head),
            n_rot=get(Keys.ROPE_DIMENSION_COUNT, head_dim),
            rope_base=get(Keys.ROPE_FREQ_BASE, 10000.0, float),
            norm_eps=get(fam.norm.eps_key, 1e-5, float),
            n_ctx_train=min(get(Keys.CONTEXT_LENGTH, 2048), n_positions or 2**62),
            sparse=sparse,
            ffn_variant=variant,
            sparse_threshold=thr,
            dense_layers=dense_layers,
            down_thresholds=cuts,
            key_length=key_length,
            sliding_window=window,
            swa_layers=swa_layers,
            rope_base_swa=get(Keys.ROPE_FREQ_BASE_SWA, 0.0, float),
            **read_scaling(kv, get, arch, source),
            rope_attn_factor=get(Keys.ROPE_SCALING_ATTN_FACTOR, 1.0, float),
            rope_orig_ctx=get(Keys.ROPE_SCALING_ORIG_CTX, 0),
            attn_scale=get(Keys.ATTENTION_SCALE, 0.0, float),
            attn_softcap=get(Keys.ATTN_SOFTCAP, 0.0, float),
            final_softcap=get(Keys.FINAL_SOFTCAP, 0.0, float),
            n_layer_nextn=nextn,
            **moe,
        )
        if extra:
            args = dataclasses.replace(args, **extra)
        args.validate(source, n_tokens=n_tokens)
        return args

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> ModelArgs:
        """The arguments of an open GGUF/PWRI file (header only; the vocabulary size comes from
        ``token_embd`` when the file has no token list).

        Raises:
            ModelConfigError: see :meth:`from_gguf_kv`.
        """
        te, pe = gf.tensors.get(Names.TOKEN_EMBD), gf.tensors.get(Names.POS_EMBD)
        fam = family(gf.kv.get(Keys.ARCHITECTURE), str(gf.path))
        n_pos = None
        if pe is not None and fam.rope is Rope.LEARNED and len(pe.shape) == 2:
            n_pos = max(pe.shape[0] - fam.position_offset, 1)
        return cls.from_gguf_kv(
            gf.kv,
            sparse=gf.sparse,
            n_vocab=te.shape[0] if te is not None else None,
            kv_types=gf.kv_types,
            source=str(gf.path),
            n_positions=n_pos,
        )

    def to_gguf_kv(self, *, name: str | None = None, vocab_size: bool = False) -> dict:
        """The architecture's GGUF key/values, ``{key: (value, GGUFValueType)}``.

        The inverse of :meth:`from_gguf_kv`: ``from_gguf_kv(plain, sparse=a.sparse,
        n_vocab=a.n_vocab) == a`` for every ``a`` it can return, where ``plain`` holds the
        values without their types. The file's magic carries ``sparse``. A sparse model's
        nonzero threshold and SiLU marker are written too (an absent threshold reads as 0.0); a
        dense file has no activation key (see :meth:`with_ffn_act`).

        Args:
            name: ``general.name``, or None to leave it out.
            vocab_size: write ``{arch}.vocab_size`` (else readers count the token list).
        """
        return model_kv(self, name=name, vocab_size=vocab_size)

    def validate(self, source: str = "model", *, n_tokens: int | None = None) -> None:
        """Check counts, divisibility and ranges once, where the arguments are built.

        Raises:
            ModelConfigError: the first value that makes no model, with what to do.
        """
        keys = dict(_FIELD_KEYS, norm_eps=self.family.norm.eps_key)

        def named(field: str) -> str:  # the field and the key it is read from
            key = keys.get(field)
            return field if key is None else f"{key.format(arch=self.arch)} ({field})"

        for key in ("n_vocab", "n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "n_ctx_train"):
            if getattr(self, key) <= 0:
                raise ModelConfigError(
                    f"{source}: {key} is {getattr(self, key)}, it must be > 0; the file's "
                    "hyperparameter keys are corrupt: re-convert the model"
                )
        if (not self.key_length and self.n_embd % self.n_head) or self.n_head % self.n_head_kv:
            raise ModelConfigError(
                f"{source}: n_embd {self.n_embd}, head_count {self.n_head} and head_count_kv "
                f"{self.n_head_kv} are inconsistent (n_embd and head_count must divide evenly)"
            )
        if not 0 < self.n_rot <= self.head_dim or self.n_rot % 2:
            raise ModelConfigError(
                f"{source}: {named('n_rot')} is {self.n_rot}, which does not fit head "
                f"{self.head_dim} (it must be even and between 2 and the head size)"
            )
        for field in (
            "rope_base",
            "norm_eps",
            "rope_scale",
            "rope_attn_factor",
            "rope_yarn_beta_fast",
            "rope_yarn_beta_slow",
        ):
            v = getattr(self, field)
            if not (math.isfinite(v) and v > 0):
                raise ModelConfigError(
                    f"{source}: {named(field)} is {v}, it must be a finite number > 0"
                )
        unset_zero = (
            "key_length",
            "sliding_window",
            "rope_orig_ctx",
            "rope_base_swa",
            "rope_scale_swa",
            "attn_scale",
            "attn_softcap",
            "final_softcap",
            "rope_ext_factor",
            "rope_yarn_log_mul",
        )
        for field in unset_zero:
            v = getattr(self, field)
            if not (math.isfinite(v) and 0 <= v < 2**31):
                raise ModelConfigError(
                    f"{source}: {named(field)} is {v}, it must be between 0 and 2^31 (0: unset)"
                )
        for field in ("rope_base", "rope_base_swa"):  # below 1 the angles grow past f32's range
            if 0 < getattr(self, field) < 1:
                raise ModelConfigError(
                    f"{source}: {named(field)} is {getattr(self, field)}, a RoPE base must be >= 1"
                )
        if math.isnan(self.sparse_threshold) or self.sparse_threshold == math.inf:
            raise ModelConfigError(
                f"{source}: sparse threshold {self.sparse_threshold} is not usable (NaN or +inf)"
            )
        if any(not 0 <= l < self.n_layer for l in self.dense_layers):
            raise ModelConfigError(
                f"{source}: {Keys.DENSE_LAYERS} lists layers {list(self.dense_layers)[:8]} "
                f"beyond the model's {self.n_layer}; re-convert the model"
            )
        if self.moe:
            check_experts(self, source)
        if self.down_thresholds:
            float_list(self.down_thresholds, Keys.FFN_DOWN_THRESHOLD, source, self.n_layer)
        if n_tokens is not None and self.n_vocab != n_tokens:
            raise ModelConfigError(
                f"{source}: vocab_size {self.n_vocab} differs from the {n_tokens} tokens of "
                "tokenizer.ggml.tokens; fix or remove the vocab_size key"
            )

    def with_ffn_act(self, act: str | None, *, source: str = "model") -> ModelArgs:
        """These arguments with the FFN activation set by the user (HF ``hidden_act``).

        GGUF has no activation key for llama: a dense file runs SiLU (SwiGLU) and a PWRI file
        ReLU (ReGLU) unless it carries ``powerpy.sparse_activation``. ``act`` overrides that:
        "relu" (ReGLU) or "silu" (SwiGLU); None keeps the file's. Bamboo is always dReLU.

        Raises:
            ValueError: an unknown activation, or one that the architecture cannot take.
        """
        if act is None:
            return self
        if act not in ACTIVATIONS:
            raise ModelConfigError(f"{source}: FFN activation {act!r} is not one of {ACTIVATIONS}")
        fam = self.family
        if fam.ffn_acts is not None and act not in fam.ffn_acts:
            raise ModelConfigError(
                f"{source}: {fam.notes or self.arch + ' fixes its FFN'}; --ffn-act {act} is wrong"
            )
        if fam.ffn_acts is not None and len(fam.ffn_acts) == 1:
            return self  # the family's one activation (bamboo's dReLU, OPT's ReLU)
        try:
            variant = FFNVariant.of(act, fam.gated)
        except ValueError as e:
            raise ModelConfigError(
                f"{source}: FFN activation {act!r} does not fit {self.arch}: {e}"
            ) from None
        return dataclasses.replace(self, ffn_variant=variant)
