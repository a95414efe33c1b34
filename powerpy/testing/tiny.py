"""Tiny models of every family for tests and notebooks: random weights (dense GGUF or sparse PWRI),
or a zero-data PWRI header for placement tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerpy.config import ModelArgs
from powerpy.families import Rope, family
from powerpy.families.deepseek import mla_layout
from powerpy.families.values import windowed_layers
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys, Names, TokenType, bias_name

BYTE_VOCAB = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]


@dataclass(frozen=True)
class TinySpec:
    n_embd: int = 64
    n_layer: int = 2
    n_ff: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    n_pred_hidden: int = 32
    arch: str = "llama"
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    n_ctx: int = 256
    tied: bool = False  # no output.weight: the logits read token_embd
    # a mixture of experts (the family's ``experts`` replace its dense FFN): experts per layer,
    # experts per token, each expert's FFN width (0: n_ff)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0  # a shared expert's width, in families with one (0: n_ff)
    n_expert_shared: int = 1  # shared experts of n_ff_exp each (glm4moe, deepseek2)
    n_layer_dense: int = 0  # leading layers with a dense FFN in a mixture of experts
    n_nextn: int = 0  # NextN layers after n_layer (glm4moe: written, not run)
    n_vocab: int = len(BYTE_VOCAB)  # more than the byte vocabulary: unused filler tokens
    key_length: int = 0  # the head size when not n_embd / n_head (qwen3, gemma)
    n_rot: int = 0  # rotated dims per head (0: all of them)
    # DeepSeek-2's latent attention: q's low rank (0: attn_q), the latent, a head's q·k and
    # value widths, the fused attn_kv_b (families/deepseek.py)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    key_length_mla: int = 0
    value_length_mla: int = 0
    kv_b: bool = False
    biases: bool = False  # write the optional biases too (q/k/v of glm4moe, qwen2)
    sliding_window: int = 0  # the window of the family's windowed layers (gpt-oss, gemma3)


def tensor_table(
    spec: TinySpec, *, sparse: bool, args: ModelArgs | None = None
) -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor of a model of ``spec`` in file order: (GGUF name, numpy shape, kind), kind
    "matrix" (a 2-D matrix or a 3-D stack), "norm" (a norm's weight), "bias" (a bias, the
    routing's selection bias) or "row" (another vector: a gate's row). The tensors the spec's
    family declares (``Family.block``, a mixture's experts in its MoE layers, leading dense
    layers' FFN, NextN layers), with their required biases, learned positions where the family
    has them, the down matrix and predictors (PWRI layout when ``sparse``). ``args`` (of the
    spec's dimensions) gives the shapes where they are not the spec's own (a head size)."""
    fam = family(spec.arch)
    args = args or spec_args(spec, sparse=sparse)
    d, ff, n_vocab = spec.n_embd, spec.n_ff, spec.n_vocab
    out = [(Names.TOKEN_EMBD, (n_vocab, d), "matrix")]
    if fam.rope is Rope.LEARNED:
        out.append((Names.POS_EMBD, (spec.n_ctx + fam.position_offset, d), "matrix"))
    usual = set(fam.usual_block)
    if fam.attention == "mla":  # the latent attention's tensors of the spec's layout
        usual -= {t for t in fam.block if t.field in mla_layout(args)[1]}
    for l in range(spec.n_layer + spec.n_nextn):
        moe = args.layer_moe(l)
        for lt in fam.layer_block(moe):
            if lt not in usual:
                continue
            name, shape = lt.name.format(l=l), tuple(getattr(args, x) for x in lt.shape)
            kind = "matrix" if len(shape) > 1 else "norm" if "norm" in lt.field else "row"
            out.append((name, shape, kind))
            if lt.bias == "required" or (lt.bias == "optional" and spec.biases):
                out.append((bias_name(name), shape[:1], "bias"))
        if l >= spec.n_layer:  # a NextN layer's own tensors (llama.cpp checks their shapes)
            out.append((f"blk.{l}.nextn.eh_proj.weight", (d, 2 * d), "matrix"))
            for part in ("enorm", "hnorm", "shared_head_norm"):
                out.append((f"blk.{l}.nextn.{part}.weight", (d,), "norm"))
        if moe:  # the router and the experts' stacks, in place of the dense FFN
            for lt in fam.experts:
                name, shape = lt.name.format(l=l), tuple(getattr(args, x) for x in lt.shape)
                out.append((name, shape, "bias" if len(shape) == 1 else "matrix"))
                if lt.bias == "required" or (lt.bias == "optional" and spec.biases):
                    out.append((bias_name(name), shape[:-1], "bias"))  # a stack's: (n_expert, rows)
            continue
        name = (Names.FFN_DOWN_T if sparse else Names.FFN_DOWN).format(l=l)
        out.append((name, (ff, d) if sparse else (d, ff), "down_t" if sparse else "matrix"))
        if fam.down_bias == "required":
            out.append((bias_name(name), (d,), "bias"))
        if sparse:
            out.append((Names.FC1.format(l=l), (spec.n_pred_hidden, d), "matrix"))
            out.append((Names.FC2.format(l=l), (ff, spec.n_pred_hidden), "matrix"))
    out.append((Names.OUTPUT_NORM, (d,), "norm"))
    if fam.output_norm_bias:
        out.append((bias_name(Names.OUTPUT_NORM), (d,), "bias"))
    if (not spec.tied or not fam.tied_output) and fam.output_tensor:  # tied where it can be
        out.append((Names.OUTPUT, (n_vocab, d), "matrix"))
        if fam.output_bias:
            out.append((bias_name(Names.OUTPUT), (n_vocab,), "bias"))
    return out


def random_tensor(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    """A random f32 tensor of a ``tensor_table`` kind: matrices N(0, 1) / sqrt(columns) (a
    "down_t" one drawn as HF's (n_embd, n_ff) and transposed), norms 1 + 0.1·N(0, 1), biases
    0.1·N(0, 1) (a stack's: (n_expert, rows)), rows as one matrix row."""
    if kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape[0])).astype(np.float32)
    if kind == "bias":
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "down_t":
        return np.ascontiguousarray(random_tensor(shape[::-1], "matrix", rng).T)
    rows, cols = (1, shape[0]) if kind == "row" else (int(np.prod(shape[:-1])), shape[-1])
    a = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    return a.reshape(shape)


def tiny_tensors(
    spec: TinySpec, *, sparse: bool, seed: int = 0, args: ModelArgs | None = None
) -> dict[str, np.ndarray]:
    """Random f32 weights with GGUF names and numpy shapes (PWRI layout when ``sparse``): the
    tensors of :func:`tensor_table`, drawn in its order from one generator."""
    rng = np.random.default_rng(seed)
    return {
        name: random_tensor(shape, kind, rng)
        for name, shape, kind in tensor_table(spec, sparse=sparse, args=args)
    }


def vocab_kv(n_vocab: int = len(BYTE_VOCAB)) -> dict:
    """A byte-fallback SPM vocabulary (<unk>, <s>, </s>, 256 byte tokens, then unused filler
    up to ``n_vocab``) as GGUF key/values."""
    tokens = BYTE_VOCAB + [f"<unused{i}>" for i in range(n_vocab - len(BYTE_VOCAB))]
    if len(tokens) != n_vocab:
        raise ValueError(f"a vocabulary of {n_vocab} cannot hold the {len(BYTE_VOCAB)} base tokens")
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.UNUSED] * (n_vocab - len(types))
    return {
        Keys.TOKENIZER_MODEL: ("llama", GGUFValueType.STRING),
        Keys.TOKENS: (tokens, GGUFValueType.ARRAY),
        Keys.SCORES: (np.zeros(n_vocab, np.float32), GGUFValueType.ARRAY),
        Keys.TOKEN_TYPE: (np.array(types, np.int32), GGUFValueType.ARRAY),
        Keys.BOS_ID: (1, GGUFValueType.UINT32),
        Keys.EOS_ID: (2, GGUFValueType.UINT32),
        Keys.UNK_ID: (0, GGUFValueType.UINT32),
    }


def spec_args(spec: TinySpec, n_vocab: int | None = None, *, sparse: bool = True) -> ModelArgs:
    """The ``ModelArgs`` of a spec (the GGUF keys are written from them); ``n_vocab`` replaces
    the spec's."""
    head_dim = spec.key_length or spec.n_embd // spec.n_head
    fam = family(spec.arch)
    mla = {}
    if fam.attention == "mla":  # one cache head of the latent and the RoPE dims
        head_dim = spec.kv_lora_rank + spec.n_rot
        mla = dict(
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            key_length_mla=spec.key_length_mla,
            value_length_mla=spec.value_length_mla,
            kv_b=spec.kv_b,
        )
    return ModelArgs(
        arch=spec.arch,
        n_vocab=n_vocab or spec.n_vocab,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_ff=spec.n_ff,
        n_head=spec.n_head,
        n_head_kv=1 if mla else spec.n_head_kv,
        n_rot=spec.n_rot or head_dim,
        key_length=head_dim if mla else spec.key_length,
        rope_base=spec.rope_base,
        norm_eps=spec.norm_eps,
        n_ctx_train=spec.n_ctx,
        sparse=sparse,
        ffn_variant=fam.ffn_variant({}, True, "tiny"),  # the family's sparse one
        sparse_threshold=0.0,
        n_expert=spec.n_expert,
        n_expert_used=spec.n_expert_used,
        n_ff_exp=(spec.n_ff_exp or spec.n_ff) if spec.n_expert else 0,
        expert_norm=dict(fam.key_defaults).get(Keys.EXPERT_WEIGHTS_NORM, True),
        n_ff_shexp=_shared_width(spec, fam) if spec.n_expert and fam.shared_expert else 0,
        n_expert_shared=spec.n_expert_shared if spec.n_expert and fam.shared_by_count else 0,
        expert_gating=fam.expert_gating,
        n_layer_dense=spec.n_layer_dense if spec.n_expert else 0,
        n_layer_nextn=spec.n_nextn,
        sliding_window=spec.sliding_window,
        swa_layers=windowed_layers({}, fam, spec.n_layer, "tiny") if spec.sliding_window else (),
        **mla,
    )


def _shared_width(spec: TinySpec, fam) -> int:
    """The shared expert's width: count · the experts' (glm4moe, deepseek2), or its own."""
    if fam.shared_by_count:
        return spec.n_expert_shared * (spec.n_ff_exp or spec.n_ff)
    return spec.n_ff_shexp or spec.n_ff


def tiny_kv(spec: TinySpec, *, threshold: float | None = None) -> dict:
    """GGUF key/values of a tiny llama-style model with a byte-fallback SPM vocabulary."""
    kv = spec_args(spec).to_gguf_kv(name="powerpy-tiny")
    if threshold is not None:
        kv[Keys.SPARSE_THRESHOLD] = (threshold, GGUFValueType.FLOAT32)
    kv.update(vocab_kv(spec.n_vocab))
    return kv


def encode_array(a: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """f32 array -> the array written to the file (typed for floats, raw blocks for Q8_0 and
    Q4_0)."""
    if ggml_type == GGMLType.F32:
        return a
    if ggml_type == GGMLType.F16:
        return a.astype(np.float16)
    from powerpy.formats import quants

    fn = quants.quantize_q8_0 if ggml_type == GGMLType.Q8_0 else quants.quantize_q4_0
    return np.ascontiguousarray(fn(np.ascontiguousarray(a, dtype=np.float32)))


def write_tiny_model(
    path: str | Path,
    spec: TinySpec = TinySpec(),
    *,
    sparse: bool = True,
    seed: int = 0,
    threshold: float | None = None,
    dtype: GGMLType = GGMLType.F32,
    extra_kv: dict[str, tuple] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny random model; return its f32 tensors (numpy shapes) for reference checks.

    Args:
        path: output file (written atomically).
        spec: dimensions.
        sparse: PWRI magic with predictors and ffn_down_t; else a dense GGUF with ffn_down.
        seed: RNG seed.
        threshold: value of powerinfer.sparse_threshold, or None to leave the key out.
        dtype: F32, F16, Q8_0 or Q4_0 for 2-D tensors (1-D stay F32).
        extra_kv: more keys, ``{key: (value, GGUFValueType[, element type])}``.
        tensors: write these f32 tensors (``tiny_tensors``' names and shapes, e.g. edited by a
            test) instead of random ones.
    """
    from powerpy.formats.gguf_writer import write_gguf

    if tensors is None:
        tensors = tiny_tensors(spec, sparse=sparse, seed=seed)
    out = []
    if dtype not in (GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0):
        raise ValueError(f"tiny models are written in F32, F16, Q8_0 or Q4_0, not {dtype.name}")
    for name, arr in tensors.items():
        if arr.ndim >= 2 and dtype != GGMLType.F32 and Names.FFN_GATE_INP[7:] not in name:
            out.append((name, encode_array(arr, dtype), dtype, arr.shape))
        else:  # vectors and a router stay F32, as llama.cpp's converters write them
            out.append((name, arr, GGMLType.F32))
    write_gguf(
        path,
        tiny_kv(spec, threshold=threshold) | (extra_kv or {}),
        out,
        magic=b"PWRI" if sparse else b"GGUF",
    )
    return tensors


def write_zero_model(
    path: Path, spec: TinySpec = TinySpec(n_ff=512), *, n_vocab: int = 32, n_pred: int = 16
) -> Path:
    """A PWRI header for placement tests: F16 matrices of zeros, F32 norms of ones, no
    tokenizer (only tensor sizes matter). File order: token_embd, output_norm, output, then per
    layer attn_norm, attn_q/k/v/output, ffn_norm, ffn_gate, ffn_up, ffn_down_t, fc1, fc2.
    """
    from powerpy.formats.gguf_writer import write_gguf

    d, ff = spec.n_embd, spec.n_ff
    gqa = d // spec.n_head * spec.n_head_kv
    kv = spec_args(spec, n_vocab).to_gguf_kv(name="gpuidx-test")

    def f16(rows: int, cols: int) -> tuple:
        return np.zeros((rows, cols), np.float16), GGMLType.F16

    def f32(n: int) -> tuple:
        return np.ones(n, np.float32), GGMLType.F32

    tensors = [(Names.TOKEN_EMBD, *f16(n_vocab, d)), (Names.OUTPUT_NORM, *f32(d))]
    tensors.append((Names.OUTPUT, *f16(n_vocab, d)))
    for layer in range(spec.n_layer):
        for template, t in (
            (Names.ATTN_NORM, f32(d)),
            (Names.ATTN_Q, f16(d, d)),
            (Names.ATTN_K, f16(gqa, d)),
            (Names.ATTN_V, f16(gqa, d)),
            (Names.ATTN_OUTPUT, f16(d, d)),
            (Names.FFN_NORM, f32(d)),
            (Names.FFN_GATE, f16(ff, d)),
            (Names.FFN_UP, f16(ff, d)),
            (Names.FFN_DOWN_T, f16(ff, d)),
            (Names.FC1, f16(n_pred, d)),
            (Names.FC2, f16(ff, n_pred)),
        ):
            tensors.append((template.format(l=layer), *t))
    write_gguf(path, kv, tensors, magic=b"PWRI")
    return path
