"""DeepSeek-2's latent attention (``model/mla.py``, family ``deepseek2``): the cache holds the
latent, the absorbed heads match the heads a float64 reference expands, the fused ``attn_kv_b``
of older files gives the same model as ``attn_k_b``/``attn_v_b``, YaRN's tables, sessions in a
batch, and the refusals of files whose latent attention does not fit their keys.

The logits against llama.cpp are in ``test_moe_oracle.py`` (``deepseek2-*``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from moe_files import DEEPSEEK, write_gguf_py

from powerpy.api import load
from powerpy.config import ModelArgs
from powerpy.errors import FileFormatError, ModelConfigError
from powerpy.formats.constants import GGMLType, Keys, Names
from powerpy.formats.constants import GGUFValueType as V
from powerpy.formats.gguf_reader import read_gguf
from powerpy.model import ggml_numerics, numerics, rope_yarn
from powerpy.model.cache import KVCache
from powerpy.model.numerics import Numerics
from powerpy.model.options import RunOptions
from powerpy.testing import tiny_tensors

SPEC = DEEPSEEK
TOKENS = torch.tensor([1, 72, 101, 108, 108, 111, 44, 32, 119, 111])
EXACT = RunOptions(numerics=Numerics(quantized_activations=False))
YARN = {
    "deepseek2.rope.scaling.type": ("yarn", V.STRING),
    "deepseek2.rope.scaling.factor": (40.0, V.FLOAT32),
    "deepseek2.rope.scaling.original_context_length": (64, V.UINT32),
    "deepseek2.rope.scaling.yarn_log_multiplier": (0.0707, V.FLOAT32),
}


def _run(model, opts=EXACT, n_prefill=6) -> torch.Tensor:
    cache = model.new_cache(32, dtype=torch.float32)
    out = [model.forward(TOKENS[:n_prefill], cache, opts, all_logits=True)]
    out += [model.forward(TOKENS[i : i + 1], cache, opts) for i in range(n_prefill, len(TOKENS))]
    return torch.cat(out)


def _reference_attention(t: dict, l: int, x: np.ndarray, kq_scale: float) -> np.ndarray:
    """The latent attention without absorption, in float64 (HF's DeepseekV2Attention, no
    RoPE scaling): per head k = [W_k c, k_r], v = W_v c over the whole prompt x (T, n_embd)
    normed; -> (T, n_embd)."""
    H, r, d_n, d_v, n_rot = 4, 64, 32, 32, 16
    f = {
        k: t[k.format(l=l)].astype(np.float64)
        for k in (
            Names.ATTN_Q_A,
            Names.ATTN_Q_A_NORM,
            Names.ATTN_Q_B,
            Names.ATTN_KV_A_MQA,
            Names.ATTN_KV_A_NORM,
            Names.ATTN_K_B,
            Names.ATTN_V_B,
            Names.ATTN_OUTPUT,
        )
    }
    names = dict(zip(("qa", "qan", "qb", "kva", "kvn", "kb", "vb", "o"), f.values(), strict=True))

    def rms(v, w, eps=1e-5):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    T = len(x)
    q = (rms(x @ names["qa"].T, names["qan"]) @ names["qb"].T).reshape(T, H, d_n + n_rot)
    kv = x @ names["kva"].T
    c, k_r = rms(kv[:, :r], names["kvn"]), kv[:, r:]
    theta = 10000.0 ** (-np.arange(0, n_rot, 2) / n_rot)
    ang = np.arange(T)[:, None] * theta[None]  # (T, n_rot/2), adjacent pairs

    def rope(v):  # (..., n_rot)
        a, b = v[..., 0::2], v[..., 1::2]
        cos, sin = np.cos(ang), np.sin(ang)
        if v.ndim == 3:
            cos, sin = cos[:, None], sin[:, None]
        out = np.empty_like(v)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    q_n, q_r, k_r = q[..., :d_n], rope(q[..., d_n:]), rope(k_r)
    out = np.zeros((T, H, d_v))
    for h in range(H):
        k_n = c @ names["kb"][h]  # (T, d_n): W_k[h] = attn_k_b[h].T
        v = c @ names["vb"][h].T  # (T, d_v)
        s = (q_n[:, h] @ k_n.T + q_r[:, h] @ k_r.T) * kq_scale
        s = np.where(np.tril(np.ones((T, T))) > 0, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (p / p.sum(1, keepdims=True)) @ v
    return out.reshape(T, H * d_v) @ names["o"].T


@pytest.fixture(scope="module")
def f32(tmp_path_factory):
    path = tmp_path_factory.mktemp("mla") / "f32.gguf"
    return path, write_gguf_py(path, SPEC, GGMLType.F32, seed=3)


def test_the_cache_holds_the_latent_not_the_heads(f32):
    model = load(f32[0]).model
    a = model.args
    assert (a.n_head_kv, a.head_dim, a.kv_lora_rank, a.key_length_mla) == (1, 80, 64, 48)
    cache = model.new_cache(32)
    assert cache.k.shape == (3, 32, 1, 64 + 16) and cache.v.shape == (3, 32, 1, 64)
    assert cache.v.data_ptr() == cache.k.data_ptr()  # the values are the latent's dims
    assert cache.nbytes == 3 * 32 * 80 * 2  # f16; the expanded heads would take 4 · (48 + 32)
    blk = model.weights.blk[1]
    assert blk.attn_q is None and blk.mla is not None and len(blk.mla.k_b) == 4


def test_absorbed_heads_match_the_expanded_float64_reference(f32):
    path, t = f32
    model = load(path).model
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    blk = model.weights.blk[1]
    from powerpy.model.transformer import Step

    with numerics.using(EXACT.numerics):
        rot = model_rotations(model, 7)
        cache = KVCache(model.args, 16, torch.float32)
        got = model.attention(1, blk, x, Step([cache], [7]), rot)
    want = _reference_attention(t, 1, x.double().numpy(), blk.mla.kq_scale)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=2e-5)
    assert blk.mla.kq_scale == pytest.approx(48**-0.5)


def model_rotations(model, n):
    from powerpy.model.attention import layer_rotations
    from powerpy.model.device import OnDevices

    return OnDevices(None, layer_rotations(model.args, model.weights, torch.arange(n), 32)[1])


def test_decode_equals_prefill_and_sessions_batch_alike(f32):
    model = load(f32[0]).model
    whole = model.forward(TOKENS, model.new_cache(32, dtype=torch.float32), EXACT, all_logits=True)
    torch.testing.assert_close(_run(model, n_prefill=1), whole, rtol=0, atol=3e-5)
    caches = [model.new_cache(32, dtype=torch.float32) for _ in range(2)]
    model.forward(TOKENS[:5], caches[0], EXACT)
    model.forward(TOKENS[2:6], caches[1], EXACT)
    solo = [model.forward(TOKENS[6:7], c, EXACT) for c in caches]
    for c, p in zip(caches, (5, 4), strict=True):
        c.pos = p
    both = model.decode_batch(TOKENS[6:8][:1].repeat(2), caches, EXACT)
    torch.testing.assert_close(both, torch.cat(solo), rtol=0, atol=1e-5)


def test_the_fused_kv_b_of_older_files_is_the_same_model(tmp_path):
    """attn_kv_b holds per head the k rows (d_n) then the v rows (d_v) over the latent:
    attn_k_b[h] is its k rows transposed, attn_v_b[h] its v rows."""
    fused = replace(SPEC, kv_b=True)
    t = tiny_tensors(fused, sparse=False, seed=5)
    write_gguf_py(tmp_path / "kv_b.gguf", fused, GGMLType.F32, tensors=t)
    split = {}
    for name, a in t.items():
        if "attn_kv_b" not in name:
            split[name] = a
            continue
        per_head = a.reshape(4, 32 + 32, 64)
        k_b = np.ascontiguousarray(per_head[:, :32].transpose(0, 2, 1))  # (H, r, d_n)
        split[name.replace("attn_kv_b", "attn_k_b")] = k_b
        split[name.replace("attn_kv_b", "attn_v_b")] = np.ascontiguousarray(per_head[:, 32:])
    write_gguf_py(tmp_path / "split.gguf", SPEC, GGMLType.F32, tensors=split)
    a, b = load(tmp_path / "kv_b.gguf").model, load(tmp_path / "split.gguf").model
    assert a.args.kv_b and not b.args.kv_b and a.args.head_dim == b.args.head_dim == 80
    torch.testing.assert_close(_run(a), _run(b), rtol=0, atol=1e-5)
    with read_gguf(
        tmp_path / "kv_b.gguf"
    ) as f:  # its keys: the heads' widths, one head per KV head
        assert ModelArgs.from_gguf(f).to_gguf_kv()["deepseek2.attention.head_count_kv"][0] == 4


def test_yarn_tables_native_and_float64_agree(tmp_path):
    write_gguf_py(tmp_path / "y.gguf", SPEC, GGMLType.F32, extra_kv=YARN)
    a = load(tmp_path / "y.gguf").model.args
    assert a.rope_ext_factor == 1.0 and a.rope_yarn_log_mul == pytest.approx(0.707)
    assert rope_yarn.corr_dims(a) == (0.0, 3.0)  # pairs 0 to 3 of 8 ramp
    pos = torch.arange(0, 200, 7)
    want = rope_yarn.tables(a, pos, a.rope_base, a.rope_scale, None)
    got = ggml_numerics.rope_table(ggml_numerics.library(), a, pos, scale=a.rope_scale)
    torch.testing.assert_close(got, want, rtol=0, atol=3e-5)  # f32 angles at p < 200
    # dims 0 and 1 turn as extrapolated, the rest interpolated: the magnitude ~1 + 0.1 ln 40
    assert abs(float(want[1].abs().mean()) - 1.0) < 1e-6  # (llama.cpp cancels it in cos, sin)


# ------------------------------------------------------------------------------ refusals
def _refused(tmp_path, err, match, *, spec=SPEC, drop=(), add=None, extra_kv=None, kv_drop=()):
    t = tiny_tensors(spec, sparse=False, seed=1)
    for name in drop:
        del t[name]
    t |= add or {}
    path = tmp_path / "bad.gguf"
    write_gguf_py(path, spec, GGMLType.F32, tensors=t, extra_kv=extra_kv)
    if kv_drop:
        with read_gguf(path) as f:
            kv = {k: v for k, v in f.kv.items() if k not in kv_drop}
        with pytest.raises(err, match=match):
            ModelArgs.from_gguf_kv(kv, sparse=False, source=str(path))
        return
    with pytest.raises(err, match=match):
        load(path)


def test_a_missing_latent_tensor_or_both_layouts_are_named(tmp_path):
    _refused(
        tmp_path,
        FileFormatError,
        r"tensor 'blk\.1\.attn_k_b\.weight' is missing; a deepseek2 layer with q_lora_rank "
        r"32 and attention\.key_length_mla set needs attn_q_a, attn_q_a_norm, attn_q_b, "
        r"attn_k_b, attn_v_b",
        drop=[Names.ATTN_K_B.format(l=1)],
    )
    plain_q = {Names.ATTN_Q.format(l=0): np.zeros((4 * 48, 64), np.float32)}
    _refused(
        tmp_path, ModelConfigError, r"tensor 'blk\.0\.attn_q\.weight' does not fit", add=plain_q
    )
    _refused(
        tmp_path,
        FileFormatError,
        r"'blk\.2\.attn_kv_a_mqa\.weight' is missing",
        drop=[Names.ATTN_KV_A_MQA.format(l=2)],
    )


def test_latent_keys_that_make_no_attention_are_refused(tmp_path):
    _refused(
        tmp_path,
        ModelConfigError,
        r"required key 'deepseek2\.attention\.kv_lora_rank'",
        kv_drop=("deepseek2.attention.kv_lora_rank",),
    )
    _refused(
        tmp_path,
        ModelConfigError,
        r"required key 'deepseek2\.attention\.q_lora_rank'",
        kv_drop=("deepseek2.attention.q_lora_rank",),
    )
    _refused(
        tmp_path,
        ModelConfigError,
        r"deepseek2\.attention\.key_length_mla is 16; DeepSeek-2's latent attention needs",
        extra_kv={Keys.KEY_LENGTH_MLA.format(arch="deepseek2"): (16, V.UINT32)},
    )
    _refused(
        tmp_path,
        ModelConfigError,
        r"rope\.scaling\.type is 'longrope'",
        extra_kv={"deepseek2.rope.scaling.type": ("longrope", V.STRING)},
    )


def test_the_native_block_decodes_the_stack_with_the_per_op_bits(tmp_path, monkeypatch):
    """Q8_0, llama.cpp's numerics, f16 cache: decode is one native call for the whole stack (the
    latent attention block, csrc/mla.h), with the bits of the per-op path."""
    from powerpy.model import mla, stack_decode, transformer

    write_gguf_py(tmp_path / "q8.gguf", SPEC, GGMLType.Q8_0, seed=2, extra_kv=YARN)
    model = load(tmp_path / "q8.gguf").model
    assert stack_decode.plan_for(model, RunOptions()).first == 0  # every layer, the dense one too
    calls, stacks = [], []
    attention, stack_run = mla.attention, stack_decode.StackPlan.run
    monkeypatch.setattr(mla, "attention", lambda *a: calls.append(1) or attention(*a))
    monkeypatch.setattr(stack_decode.StackPlan, "run", lambda *a: stacks.append(1) or stack_run(*a))

    def run() -> torch.Tensor:
        cache = model.new_cache(32)
        out = [model.forward(TOKENS[:6], cache, all_logits=True)]
        return torch.cat(out + [model.forward(TOKENS[i : i + 1], cache) for i in range(6, 10)])

    native = run()
    assert len(calls) == 3  # the prompt's, per op; no decode step's
    assert len(stacks) == 4  # each decode step one call (the latent cache: v a view of k)
    monkeypatch.setattr(transformer, "attention_block", lambda *a: None)  # the per-op path
    monkeypatch.setattr(stack_decode, "usable", lambda *a: False)
    per_op = run()
    assert len(calls) == 3 + 3 + 4 * 3 and torch.equal(native, per_op)
