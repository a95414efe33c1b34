"""Hyperparameters derived from GGUF key/values, and the runtime options of a session."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from powerpy.constants import GGUFValueType, Keys

SUPPORTED_ARCHS = ("llama", "bamboo")

# FFN variants: how h is computed from gate g and up u (spec §9.2).
FFN_SWIGLU = "swiglu"  # silu(g) * u        dense llama
FFN_REGLU = "reglu"  # relu(g) * u          PWRI llama (ReluLLaMA, ProSparse)
FFN_DRELU = "drelu"  # relu(g) * relu(u)    bamboo


@dataclass(frozen=True)
class ModelArgs:
    """Hyperparameters of a LLaMA-family model, read from the file's key/values."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_rot: int  # rotary dims per head
    rope_base: float
    rms_eps: float
    n_ctx_train: int
    sparse: bool  # PWRI magic: predictor-gated FFN
    ffn_variant: str
    sparse_threshold: float  # from powerinfer.sparse_threshold, else 0.0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_gqa(self) -> int:
        return self.head_dim * self.n_head_kv

    @classmethod
    def from_gguf_kv(
        cls,
        kv: Mapping[str, Any],
        *,
        sparse: bool,
        n_vocab: int | None = None,
        kv_types: Mapping[str, GGUFValueType] | None = None,
        source: str = "model",
    ) -> ModelArgs:
        """Build the arguments from GGUF key/values.

        Args:
            kv: the file's key/values.
            sparse: True for a PWRI file.
            n_vocab: vocabulary size when the file has no token list.
            kv_types: value types, to check that the threshold key is FLOAT32.
            source: file name for error messages.

        Raises:
            ValueError: unsupported architecture, missing or inconsistent keys.
        """
        arch = kv.get(Keys.ARCHITECTURE)
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"{source}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHS)})"
            )

        def get(key: str, default: Any = None) -> Any:
            name = key.format(arch=arch)
            if name in kv:
                return kv[name]
            if default is None:
                raise ValueError(f"{source}: required key {name!r} is missing")
            return default

        n_embd = int(get(Keys.EMBEDDING_LENGTH))
        n_head = int(get(Keys.HEAD_COUNT))
        n_head_kv = int(get(Keys.HEAD_COUNT_KV, n_head))
        if n_embd % n_head or n_head % n_head_kv:
            raise ValueError(
                f"{source}: n_embd {n_embd}, head_count {n_head} and head_count_kv {n_head_kv} "
                "are inconsistent"
            )
        tokens = kv.get(Keys.TOKENS)
        vocab = len(tokens) if tokens is not None else n_vocab
        vocab = int(get(Keys.VOCAB_SIZE, vocab or 0))
        thr = 0.0
        if sparse and Keys.SPARSE_THRESHOLD in kv:
            found = (kv_types or {}).get(Keys.SPARSE_THRESHOLD, GGUFValueType.FLOAT32)
            if found != GGUFValueType.FLOAT32:
                raise ValueError(
                    f"{source}: key {Keys.SPARSE_THRESHOLD} must be FLOAT32, found {found!r}"
                )
            thr = float(kv[Keys.SPARSE_THRESHOLD])
        if arch == "bamboo":
            variant = FFN_DRELU
        elif sparse and kv.get(Keys.SPARSE_ACTIVATION, "relu") == "relu":
            variant = FFN_REGLU
        else:
            variant = FFN_SWIGLU
        head_dim = n_embd // n_head
        args = cls(
            arch=arch,
            n_vocab=vocab,
            n_embd=n_embd,
            n_layer=int(get(Keys.BLOCK_COUNT)),
            n_ff=int(get(Keys.FEED_FORWARD_LENGTH)),
            n_head=n_head,
            n_head_kv=n_head_kv,
            n_rot=int(get(Keys.ROPE_DIMENSION_COUNT, head_dim)),
            rope_base=float(get(Keys.ROPE_FREQ_BASE, 10000.0)),
            rms_eps=float(get(Keys.RMS_EPS, 1e-5)),
            n_ctx_train=int(get(Keys.CONTEXT_LENGTH, 2048)),
            sparse=sparse,
            ffn_variant=variant,
            sparse_threshold=thr,
        )
        if args.n_rot > head_dim or args.n_rot % 2:
            raise ValueError(f"{source}: rope dimension {args.n_rot} does not fit head {head_dim}")
        if not math.isfinite(args.sparse_threshold) and args.sparse_threshold > 0:
            raise ValueError(f"{source}: sparse threshold {args.sparse_threshold} is not usable")
        return args

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
        variants = {"relu": FFN_REGLU, "silu": FFN_SWIGLU}
        if act not in variants:
            raise ValueError(f"{source}: FFN activation {act!r} is not one of relu, silu")
        if self.arch == "bamboo":
            if act != "relu":
                raise ValueError(f"{source}: bamboo's FFN is dReLU; --ffn-act {act} does not apply")
            return self
        return dataclasses.replace(self, ffn_variant=variants[act])
