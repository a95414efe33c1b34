"""Hyperparameters (``ModelArgs``) from GGUF key/values, and to GGUF key/values (an HF
config.json's: ``pipeline.hf_families``)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from powerpy.errors import ModelConfigError, shown
from powerpy.families import SUPPORTED_ARCHS, Family, FFNVariant, Rope, family
from powerpy.families.experts import check_experts, expert_args
from powerpy.formats.constants import GGUFValueType, Keys, Names

if TYPE_CHECKING:
    from powerpy.formats.gguf_reader import GGUFFile

__all__ = ["SUPPORTED_ARCHS", "FFNVariant", "ModelArgs", "DEFAULT_CTX", "ACTIVATIONS"]


DEFAULT_CTX = 4096  # positions of a KV cache when none is given (llama-server's default)
MAX_LAYERS = 1 << 16  # a block_count above this is a corrupt file (the largest models have ~200)


ACTIVATIONS = ("relu", "silu", "gelu")  # --ffn-act, config.json sparse_activation, hidden_act


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
    key_length: int = 0  # head size, when the file sets it (gemma); 0: n_embd / n_head
    sliding_window: int = 0  # a query at p sees keys at p - window + 1 .. p; 0: all
    swa_layers: tuple[int, ...] = ()  # the layers that use the window (the family's pattern)
    rope_base_swa: float = 0.0  # the windowed layers' RoPE base (gemma3); 0: rope_base
    rope_scale_swa: float = 0.0  # … and their linear scaling (gemma3: 1); 0: rope_scale
    rope_scale: float = 1.0  # linear RoPE scaling: position p turns as p / rope_scale
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

        def get(key: str, default: Any = None, kind: type = int) -> Any:
            name = key.format(arch=arch)
            if name not in kv:
                if default is None:
                    raise ModelConfigError(f"{source}: required key {name!r} is missing")
                return default
            return _scalar(kv[name], name, kind, source)

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
            thr = _scalar(kv[Keys.SPARSE_THRESHOLD], Keys.SPARSE_THRESHOLD, float, source)
        dense_layers: tuple[int, ...] = ()
        if sparse and Keys.DENSE_LAYERS in kv:
            dense_layers = layer_list(kv[Keys.DENSE_LAYERS], Keys.DENSE_LAYERS, source)
        n_expert = get(Keys.EXPERT_COUNT, 0)
        moe = expert_args(fam, n_expert, sparse, get, source)
        cuts: tuple[float, ...] = ()
        if (sparse or n_expert) and Keys.FFN_DOWN_THRESHOLD in kv:
            cuts = float_list(kv[Keys.FFN_DOWN_THRESHOLD], Keys.FFN_DOWN_THRESHOLD, source)
        variant = fam.ffn_variant(kv, sparse, source)
        n_layer = get(Keys.BLOCK_COUNT)
        if not 0 < n_layer <= MAX_LAYERS:
            raise ModelConfigError(
                f"{source}: {Keys.BLOCK_COUNT.format(arch=arch)} is {n_layer}, it must be "
                f"between 1 and {MAX_LAYERS}; the file's keys are corrupt: re-convert the model"
            )
        key_length = get(Keys.KEY_LENGTH, 0)
        head_dim = key_length or (n_embd // n_head if n_head > 0 else 0)
        if get(Keys.VALUE_LENGTH, head_dim) != head_dim:
            raise ModelConfigError(
                f"{source}: {Keys.VALUE_LENGTH.format(arch=arch)} differs from the key length "
                f"{head_dim}; powerpy runs heads whose keys and values have one size"
            )
        window = get(Keys.SLIDING_WINDOW, 0)
        scaling = kv.get(Keys.ROPE_SCALING_TYPE.format(arch=arch), "none")
        if not isinstance(scaling, str) or scaling not in ("none", "linear"):
            raise ModelConfigError(
                f"{source}: {Keys.ROPE_SCALING_TYPE.format(arch=arch)} is {shown(scaling)}; "
                'powerpy runs "none" and "linear" RoPE scaling'
            )
        extra = {} if fam.extra_args is None else fam.extra_args(get, n_layer)
        pattern = fam.swa_pattern
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
            swa_layers=tuple(
                l
                for l in range(n_layer)
                if window and pattern is not None and (not pattern or l % pattern < pattern - 1)
            ),
            rope_base_swa=get(Keys.ROPE_FREQ_BASE_SWA, 0.0, float),
            rope_scale=get(Keys.ROPE_SCALING_FACTOR, 1.0, float) if scaling == "linear" else 1.0,
            rope_attn_factor=get(Keys.ROPE_SCALING_ATTN_FACTOR, 1.0, float),
            rope_orig_ctx=get(Keys.ROPE_SCALING_ORIG_CTX, 0),
            attn_scale=get(Keys.ATTENTION_SCALE, 0.0, float),
            attn_softcap=get(Keys.ATTN_SOFTCAP, 0.0, float),
            final_softcap=get(Keys.FINAL_SOFTCAP, 0.0, float),
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
        u32, f32, a = GGUFValueType.UINT32, GGUFValueType.FLOAT32, self.arch
        kv: dict = {Keys.ARCHITECTURE: (a, GGUFValueType.STRING)}
        if name is not None:
            kv[Keys.NAME] = (name, GGUFValueType.STRING)
        kv.update({
            Keys.CONTEXT_LENGTH.format(arch=a): (self.n_ctx_train, u32),
            Keys.EMBEDDING_LENGTH.format(arch=a): (self.n_embd, u32),
            Keys.BLOCK_COUNT.format(arch=a): (self.n_layer, u32),
            Keys.FEED_FORWARD_LENGTH.format(arch=a): (self.n_ff, u32),
            Keys.ROPE_DIMENSION_COUNT.format(arch=a): (self.n_rot, u32),
            Keys.ROPE_FREQ_BASE.format(arch=a): (self.rope_base, f32),
            Keys.HEAD_COUNT.format(arch=a): (self.n_head, u32),
            Keys.HEAD_COUNT_KV.format(arch=a): (self.n_head_kv, u32),
            self.family.norm.eps_key.format(arch=a): (self.norm_eps, f32),
        })  # fmt: skip
        if vocab_size:
            kv[Keys.VOCAB_SIZE.format(arch=a)] = (self.n_vocab, u32)
        optional = (  # written when set: (key, value, unset value, type)
            (Keys.KEY_LENGTH, self.key_length, 0, u32),
            (Keys.VALUE_LENGTH, self.key_length, 0, u32),
            (Keys.SLIDING_WINDOW, self.sliding_window, 0, u32),
            (Keys.ROPE_FREQ_BASE_SWA, self.rope_base_swa, 0.0, f32),
            (Keys.ROPE_SCALING_FACTOR, self.rope_scale, 1.0, f32),
            (Keys.ROPE_SCALING_ATTN_FACTOR, self.rope_attn_factor, 1.0, f32),
            (Keys.ROPE_SCALING_ORIG_CTX, self.rope_orig_ctx, 0, u32),
            (Keys.ATTENTION_SCALE, self.attn_scale, 0.0, f32),
            (Keys.ATTN_SOFTCAP, self.attn_softcap, 0.0, f32),
            (Keys.FINAL_SOFTCAP, self.final_softcap, 0.0, f32),
        )
        for key, value, unset, kind in optional:
            if value != unset:
                kv[key.format(arch=a)] = (value, kind)
        if self.rope_scale != 1.0:
            kv[Keys.ROPE_SCALING_TYPE.format(arch=a)] = ("linear", GGUFValueType.STRING)
        if self.sparse and self.sparse_threshold != 0.0:
            kv[Keys.SPARSE_THRESHOLD] = (self.sparse_threshold, f32)
        if self.sparse and self.ffn_variant in (FFNVariant.SWIGLU, FFNVariant.GELU):
            kv[Keys.SPARSE_ACTIVATION] = (self.ffn_variant.activation, GGUFValueType.STRING)
        if self.sparse and self.dense_layers:
            kv[Keys.DENSE_LAYERS] = (list(self.dense_layers), GGUFValueType.ARRAY, u32)
        if self.moe:
            kv[Keys.EXPERT_COUNT.format(arch=a)] = (self.n_expert, u32)
            kv[Keys.EXPERT_USED_COUNT.format(arch=a)] = (self.n_expert_used, u32)
            if self.family.expert_ff_key is not None:
                kv[self.family.expert_ff_key.format(arch=a)] = (self.n_ff_exp, u32)
            if not self.expert_norm:
                kv[Keys.EXPERT_WEIGHTS_NORM.format(arch=a)] = (False, GGUFValueType.BOOL)
            if self.expert_scale != 0.0:
                kv[Keys.EXPERT_WEIGHTS_SCALE.format(arch=a)] = (self.expert_scale, f32)
        if (self.sparse or self.moe) and any(self.down_thresholds):
            kv[Keys.FFN_DOWN_THRESHOLD] = (list(self.down_thresholds), GGUFValueType.ARRAY, f32)
        return kv

    def validate(self, source: str = "model", *, n_tokens: int | None = None) -> None:
        """Check counts, divisibility and ranges once, where the arguments are built.

        Raises:
            ModelConfigError: the first value that makes no model, with what to do.
        """
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
                f"{source}: rope dimension {self.n_rot} does not fit head {self.head_dim} "
                "(it must be even and between 2 and the head size)"
            )
        for key in ("rope_base", "norm_eps", "rope_scale", "rope_attn_factor"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v > 0):
                raise ModelConfigError(f"{source}: {key} is {v}, it must be a finite number > 0")
        unset_zero = ("key_length", "sliding_window", "rope_orig_ctx", "rope_base_swa",
                      "rope_scale_swa", "attn_scale", "attn_softcap", "final_softcap")  # fmt: skip
        for key in unset_zero:
            v = getattr(self, key)
            if not (math.isfinite(v) and 0 <= v < 2**31):
                raise ModelConfigError(
                    f"{source}: {key} is {v}, it must be a finite number >= 0 (0: unset)"
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


def layer_list(value: Any, key: str, source: str, n_layer: int | None = None) -> tuple[int, ...]:
    """A key's array of distinct layer numbers (below ``n_layer`` when given), sorted.

    Raises:
        ModelConfigError: anything else; the message names the source and the key.
    """
    seq = hasattr(value, "__len__") and not isinstance(value, (str, bytes, Mapping))
    items = list(value) if seq else None  # a list, or the reader's numpy array
    top = n_layer if n_layer is not None else float("inf")
    ok = items is not None and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and 0 <= v < top for v in items
    )
    if not ok or len(set(items)) != len(items):
        below = f" below {n_layer}" if n_layer is not None else ""
        raise ModelConfigError(
            f"{source}: {key} must be an array of distinct layer numbers{below}, got {shown(value)}"
        )
    return tuple(sorted(int(v) for v in items))


def float_list(value: Any, key: str, source: str, n: int | None = None) -> tuple[float, ...]:
    """A key's array of numbers as floats; with ``n``, exactly n finite values >= 0 (one per
    layer).

    Raises:
        ModelConfigError: anything else; the message names the source and the key.
    """
    seq = hasattr(value, "__len__") and not isinstance(value, (str, bytes, Mapping))
    items = list(value) if seq else None  # a list, or the reader's numpy array
    if items is None or not all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in items
    ):
        raise ModelConfigError(f"{source}: {key} must be an array of numbers, got {shown(value)}")
    out = tuple(float(v) for v in items)
    if n is not None and (len(out) != n or not all(0 <= t < math.inf for t in out)):
        raise ModelConfigError(
            f"{source}: {key} must hold {n} finite values >= 0 (one per layer), found "
            f"{len(out)}: {list(out)[:4]}; fix the values or remove the key"
        )
    return out


def _scalar(v: Any, key: str, kind: type, source: str) -> Any:
    """``v`` as one int (or finite-or-not float, or a bool for ``kind`` bool), refusing
    arrays, strings and bools where a number belongs, by name."""
    if isinstance(v, (list, tuple)) and len(v) == 1:
        v = v[0]
    if kind is bool:
        if isinstance(v, (bool, np.bool_)):
            return bool(v)
        raise ModelConfigError(
            f"{source}: key {key!r} must be a BOOL, got {shown(v)} ({type(v).__name__}); the "
            "file is corrupt: re-convert the model"
        )
    ok = isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
    if ok and kind is int:
        ok = float(v).is_integer() and abs(v) < 2**63
    if not ok:
        raise ModelConfigError(
            f"{source}: key {key!r} must be one {'integer' if kind is int else 'number'}, got "
            f"{shown(v)} ({type(v).__name__}); the file is corrupt: re-convert the model"
        )
    return kind(v)
