"""Tiny models of every family for tests and notebooks: random weights (dense GGUF or sparse PWRI),
or a zero-data PWRI header for placement tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerpy.config import ModelArgs
from powerpy.families import Rope, family
from powerpy.families.base import DENSE_FFN
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
    n_vocab: int = len(BYTE_VOCAB)  # more than the byte vocabulary: unused filler tokens
    key_length: int = 0  # the head size when not n_embd / n_head (qwen3, gemma)


def tiny_tensors(
    spec: TinySpec, *, sparse: bool, seed: int = 0, args: ModelArgs | None = None
) -> dict[str, np.ndarray]:
    """Random f32 weights with GGUF names and numpy shapes (PWRI layout when ``sparse``): the
    tensors the spec's family declares (``Family.block``), with their biases, learned
    positions where the family has them, the down matrix and predictors. ``args`` (of the
    spec's dimensions) gives the shapes where they are not the spec's own (a head size)."""
    rng = np.random.default_rng(seed)
    fam = family(spec.arch)
    args = args or spec_args(spec, sparse=sparse)
    d, ff = spec.n_embd, spec.n_ff
    n_vocab = spec.n_vocab

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int = d) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {Names.TOKEN_EMBD: mat(n_vocab, d)}
    if fam.rope is Rope.LEARNED:
        t[Names.POS_EMBD] = mat(spec.n_ctx + fam.position_offset, d)
    for l in range(spec.n_layer):
        for lt in fam.usual_block:
            if args.moe and lt.field in DENSE_FFN:
                continue
            name, shape = lt.name.format(l=l), tuple(getattr(args, x) for x in lt.shape)
            if len(shape) > 1:
                t[name] = mat(*shape)
            else:  # a norm's weight near 1; another vector (a gate's row) as a matrix row
                t[name] = norm(*shape) if "norm" in lt.field else mat(1, *shape)[0]
            if lt.bias == "required":  # optional biases are left out, as most files do
                t[bias_name(name)] = bias(shape[0])
        if args.moe:  # the router and the experts' stacks, in place of the dense FFN
            for lt in fam.experts:
                shape = tuple(getattr(args, x) for x in lt.shape)
                t[lt.name.format(l=l)] = mat(int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
            continue
        down = mat(d, ff)  # HF down_proj (n_embd, n_ff)
        name = (Names.FFN_DOWN_T if sparse else Names.FFN_DOWN).format(l=l)
        t[name] = np.ascontiguousarray(down.T) if sparse else down
        if fam.down_bias == "required":
            t[bias_name(name)] = bias(d)
        if sparse:
            t[Names.FC1.format(l=l)] = mat(spec.n_pred_hidden, d)
            t[Names.FC2.format(l=l)] = mat(ff, spec.n_pred_hidden)
    t[Names.OUTPUT_NORM] = norm()
    if fam.output_norm_bias:
        t[bias_name(Names.OUTPUT_NORM)] = bias(d)
    if (not spec.tied or not fam.tied_output) and fam.output_tensor:  # tied where it can be
        t[Names.OUTPUT] = mat(n_vocab, d)
        if fam.output_bias:
            t[bias_name(Names.OUTPUT)] = bias(n_vocab)
    return t


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
    return ModelArgs(
        arch=spec.arch,
        n_vocab=n_vocab or spec.n_vocab,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_ff=spec.n_ff,
        n_head=spec.n_head,
        n_head_kv=spec.n_head_kv,
        n_rot=head_dim,
        key_length=spec.key_length,
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
        n_ff_shexp=(spec.n_ff_shexp or spec.n_ff) if spec.n_expert and fam.shared_expert else 0,
    )


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
