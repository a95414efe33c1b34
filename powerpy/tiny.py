"""Tiny random LLaMA-family models for tests and notebooks (dense GGUF or sparse PWRI)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerpy.constants import GGMLType, GGUFValueType, Keys, Names, TokenType

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
    rms_eps: float = 1e-5
    n_ctx: int = 256


def tiny_tensors(spec: TinySpec, *, sparse: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random f32 weights with GGUF names and numpy shapes (PWRI layout when ``sparse``)."""
    rng = np.random.default_rng(seed)
    d, ff, hd = spec.n_embd, spec.n_ff, spec.n_embd // spec.n_head
    gqa = hd * spec.n_head_kv
    n_vocab = len(BYTE_VOCAB)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    t = {Names.TOKEN_EMBD: mat(n_vocab, d)}
    for l in range(spec.n_layer):
        f = {k: getattr(Names, k).format(l=l) for k in vars(Names) if k.isupper()}
        t[f["ATTN_NORM"]] = norm()
        t[f["ATTN_Q"]] = mat(d, d)
        t[f["ATTN_K"]] = mat(gqa, d)
        t[f["ATTN_V"]] = mat(gqa, d)
        t[f["ATTN_OUTPUT"]] = mat(d, d)
        t[f["FFN_NORM"]] = norm()
        t[f["FFN_GATE"]] = mat(ff, d)
        t[f["FFN_UP"]] = mat(ff, d)
        down = mat(d, ff)  # HF down_proj (n_embd, n_ff)
        if sparse:
            t[f["FFN_DOWN_T"]] = np.ascontiguousarray(down.T)
            t[f["FC1"]] = mat(spec.n_pred_hidden, d)
            t[f["FC2"]] = mat(ff, spec.n_pred_hidden)
        else:
            t[f["FFN_DOWN"]] = down
    t[Names.OUTPUT_NORM] = norm()
    t[Names.OUTPUT] = mat(n_vocab, d)
    return t


def tiny_kv(spec: TinySpec, *, threshold: float | None = None) -> dict:
    """GGUF key/values of a tiny llama-style model with a byte-fallback SPM vocabulary."""
    a = spec.arch
    kv: dict = {
        Keys.ARCHITECTURE: (a, GGUFValueType.STRING),
        Keys.NAME: ("powerpy-tiny", GGUFValueType.STRING),
        Keys.CONTEXT_LENGTH.format(arch=a): (spec.n_ctx, GGUFValueType.UINT32),
        Keys.EMBEDDING_LENGTH.format(arch=a): (spec.n_embd, GGUFValueType.UINT32),
        Keys.BLOCK_COUNT.format(arch=a): (spec.n_layer, GGUFValueType.UINT32),
        Keys.FEED_FORWARD_LENGTH.format(arch=a): (spec.n_ff, GGUFValueType.UINT32),
        Keys.ROPE_DIMENSION_COUNT.format(arch=a): (
            spec.n_embd // spec.n_head,
            GGUFValueType.UINT32,
        ),
        Keys.ROPE_FREQ_BASE.format(arch=a): (spec.rope_base, GGUFValueType.FLOAT32),
        Keys.HEAD_COUNT.format(arch=a): (spec.n_head, GGUFValueType.UINT32),
        Keys.HEAD_COUNT_KV.format(arch=a): (spec.n_head_kv, GGUFValueType.UINT32),
        Keys.RMS_EPS.format(arch=a): (spec.rms_eps, GGUFValueType.FLOAT32),
    }
    if threshold is not None:
        kv[Keys.SPARSE_THRESHOLD] = (threshold, GGUFValueType.FLOAT32)
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    types += [TokenType.BYTE] * 256
    kv[Keys.TOKENIZER_MODEL] = ("llama", GGUFValueType.STRING)
    kv[Keys.TOKENS] = (BYTE_VOCAB, GGUFValueType.ARRAY)
    kv[Keys.SCORES] = (np.zeros(len(BYTE_VOCAB), np.float32), GGUFValueType.ARRAY)
    kv[Keys.TOKEN_TYPE] = (np.array(types, np.int32), GGUFValueType.ARRAY)
    kv[Keys.BOS_ID] = (1, GGUFValueType.UINT32)
    kv[Keys.EOS_ID] = (2, GGUFValueType.UINT32)
    kv[Keys.UNK_ID] = (0, GGUFValueType.UINT32)
    return kv


def write_tiny_model(
    path: str | Path,
    spec: TinySpec = TinySpec(),
    *,
    sparse: bool = True,
    seed: int = 0,
    threshold: float | None = None,
    dtype: GGMLType = GGMLType.F32,
) -> dict[str, np.ndarray]:
    """Write a tiny random model; return its f32 tensors (numpy shapes) for reference checks.

    Args:
        path: output file (written atomically).
        spec: dimensions.
        sparse: PWRI magic with predictors and ffn_down_t; else a dense GGUF with ffn_down.
        seed: RNG seed.
        threshold: value of powerinfer.sparse_threshold, or None to leave the key out.
        dtype: F32 or F16 for 2-D tensors (1-D stay F32).
    """
    from powerpy.gguf_io import write_gguf

    tensors = tiny_tensors(spec, sparse=sparse, seed=seed)
    out = []
    for name, arr in tensors.items():
        if arr.ndim == 2 and dtype == GGMLType.F16:
            out.append((name, arr.astype(np.float16), GGMLType.F16))
        else:
            out.append((name, arr, GGMLType.F32))
    write_gguf(
        path,
        tiny_kv(spec, threshold=threshold),
        out,
        magic=b"PWRI" if sparse else b"GGUF",
    )
    return tensors
