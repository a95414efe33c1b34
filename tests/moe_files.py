"""Tiny mixture-of-experts GGUF files written with gguf-py (the reference writer, not powerpy's),
for the llama.cpp oracle and the MoE tests: any family with experts, F32/F16/Q8_0/Q4_K."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from powerpy.formats.constants import GGMLType, GGUFValueType, Keys, Names
from powerpy.testing import TinySpec, tiny_tensors
from powerpy.testing.tiny import spec_args, vocab_kv

QK_K = 256

# The oracle tests' tiny files of the new families (shared by the MoE, MLA and plan tests).
# glm4moe: a leading dense layer, two MoE layers, a NextN layer, q/k/v biases, partial RoPE
GLM = TinySpec(
    arch="glm4moe",
    n_layer=3,
    n_ff=128,
    n_ff_exp=32,
    n_expert=8,
    n_expert_used=2,
    n_layer_dense=1,
    n_nextn=1,
    n_rot=8,
    biases=True,
)
# deepseek2: latent attention with q's low rank, a leading dense layer
DEEPSEEK = TinySpec(
    arch="deepseek2",
    n_embd=64,
    n_layer=3,
    n_ff=128,
    n_head=4,
    n_ff_exp=32,
    n_expert=8,
    n_expert_used=2,
    n_layer_dense=1,
    n_rot=16,
    q_lora_rank=32,
    kv_lora_rank=64,
    key_length_mla=48,
    value_length_mla=32,
)


def _pack_q4_k(x: np.ndarray) -> np.ndarray:
    """A valid Q4_K encoding of x (..., k), k % 256 == 0 (a simple min/scale fit, not ggml's
    search): (..., k // 256 * 144) uint8."""
    shape = x.shape
    b = x.reshape(-1, 8, 32).astype(np.float32)  # sub-blocks of 32
    lo, hi = b.min(axis=2), b.max(axis=2)  # (nb, 8)
    scale, mins = np.maximum(hi - lo, 1e-8) / 15, np.maximum(-lo, 0)
    d = (scale.max(axis=1) / 63).astype(np.float16).astype(np.float32)  # (nb,)
    dmin = (mins.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.maximum(d, 1e-12)[:, None]), 1, 63).astype(np.uint8)
    mq = np.clip(np.rint(mins / np.maximum(dmin, 1e-12)[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[:, :, None]
    q = np.clip(np.rint((b + (dmin[:, None] * mq)[:, :, None]) / step), 0, 15).astype(np.uint8)
    s = np.zeros((len(b), 12), np.uint8)
    s[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = mq[:, 0:4] | ((mq[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mq[:, 4:8] & 0xF) << 4)
    q = q.reshape(-1, 4, 2, 32)  # 64-element chunks: sub-block 2c in the low nibbles, 2c+1 high
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    head = np.stack([d, dmin], axis=1).astype(np.float16).view(np.uint8)  # (nb, 4)
    out = np.concatenate([head, s, qs], axis=1)  # (nb, 144)
    return out.reshape(*shape[:-1], shape[-1] // QK_K * 144)


def encode(a: np.ndarray, dtype: GGMLType) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """f32 -> (data for GGUFWriter.add_tensor, raw_dtype)."""
    if dtype == GGMLType.F32:
        return a, None
    if dtype == GGMLType.F16:
        return a.astype(np.float16), None
    if dtype == GGMLType.Q4_K:
        return _pack_q4_k(a), gguf.GGMLQuantizationType.Q4_K
    qt = gguf.GGMLQuantizationType[dtype.name]
    return gguf.quants.quantize(a, qt), qt


def write_gguf_py(
    path: str | Path,
    spec: TinySpec,
    dtype: GGMLType = GGMLType.F16,
    *,
    seed: int = 0,
    router: GGMLType = GGMLType.F32,
    experts: GGMLType | None = None,
    extra_kv: dict | None = None,
    tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """A dense GGUF of ``spec`` (its family's experts when ``spec.n_expert``) through gguf-py's
    ``GGUFWriter``: matrices in ``dtype``, the experts' stacks in ``experts`` (None: ``dtype``;
    MXFP4 as GPT-OSS ships them), the router in ``router``, vectors and biases F32. Returns the
    f32 tensors written (before encoding)."""
    t = tiny_tensors(spec, sparse=False, seed=seed) if tensors is None else tensors
    args = spec_args(spec, sparse=False)
    w = gguf.GGUFWriter(str(path), args.arch)
    kv = args.to_gguf_kv(name="powerpy-moe-tiny") | vocab_kv() | (extra_kv or {})
    for key, spec_v in kv.items():
        if key == Keys.ARCHITECTURE:
            continue
        value, vtype, *sub = spec_v
        sub_t = gguf.GGUFValueType(int(sub[0])) if sub else None
        if vtype == GGUFValueType.ARRAY and sub_t is None:
            item = np.asarray(value)
            sub_t = (
                gguf.GGUFValueType.STRING
                if item.dtype.kind in "US"
                else gguf.GGUFValueType.get_type(item.flat[0].item())
            )
            if item.dtype == np.int32:
                sub_t = gguf.GGUFValueType.INT32
            value = list(value)
        w.add_key_value(key, value, gguf.GGUFValueType(int(vtype)), sub_t)
    for name, a in t.items():
        kind = router if name.endswith(Names.FFN_GATE_INP[7:]) else dtype
        if a.ndim == 3 and experts is not None:
            kind = experts
        data, raw = encode(a, kind if a.ndim >= 2 and name.endswith(".weight") else GGMLType.F32)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return t


def refused(
    tmp_path, spec: TinySpec, err, match: str, *, drop=(), edit=None, extra_kv=None, seed: int = 1
) -> None:
    """An F32 file of ``spec`` less the tensors ``drop``, edited by ``edit`` (its f32 tensors)
    and with ``extra_kv``, whose load raises ``err`` matching ``match``."""
    import pytest

    from powerpy.api import load

    t = tiny_tensors(spec, sparse=False, seed=seed)
    for name in drop:
        del t[name]
    if edit is not None:
        edit(t)
    path = Path(tmp_path) / "bad.gguf"
    write_gguf_py(path, spec, GGMLType.F32, tensors=t, extra_kv=extra_kv)
    with pytest.raises(err, match=match):
        load(path)
