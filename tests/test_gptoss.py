"""GPT-OSS (``gpt-oss``): its mixture (a router bias, the k chosen logits' softmax as weights,
biased expert products, the clamped SwiGLU), attention sinks and the window on every other
layer, against float64 references on every runtime path; MXFP4 experts read in place; the
refusals of files that lack one of its tensors or keys.

The logits against llama.cpp are in ``test_moe_oracle.py``, MXFP4's products against ggml's in
``test_ggml_vec_dot.py``, its chat template in ``test_chat_families.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from moe_files import refused, write_gguf_py

from powerpy.api import load
from powerpy.errors import FileFormatError, ModelConfigError
from powerpy.formats.constants import GGMLType, Names, bias_name
from powerpy.model import (
    attention,
    ggml_numerics,
    kernels,
    moe,
    moe_host,
    numerics,
    routing,
    stack_decode,
)
from powerpy.model.numerics import Numerics
from powerpy.model.options import RunOptions
from powerpy.testing import TinySpec, tiny_tensors

OSS = TinySpec(
    arch="gpt-oss",
    n_layer=3,
    n_ff=128,
    n_ff_exp=64,
    n_expert=8,
    n_expert_used=2,
    sliding_window=8,
    key_length=32,
)
EXACT = Numerics(quantized_activations=False)
TOKENS = torch.tensor([1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33])


def _swiglu_oai(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    return g / (1 + np.exp(-1.702 * g)) * (u + 1)


def _reference(t: dict, l: int, x: np.ndarray, k: int) -> np.ndarray:
    """GPT-OSS's routed experts in float64: x (T, n_embd) -> (T, n_embd)."""

    def get(name: str, bias: bool = False) -> np.ndarray:
        name = name.format(l=l)
        return t[bias_name(name) if bias else name].astype(np.float64)

    r, rb = get(Names.FFN_GATE_INP), get(Names.FFN_GATE_INP, True)
    stacks = [
        (get(n), get(n, True))
        for n in (Names.FFN_GATE_EXPS, Names.FFN_UP_EXPS, Names.FFN_DOWN_EXPS)
    ]
    (g, gb), (u, ub), (d, db) = stacks
    logits = x @ r.T + rb
    out = np.zeros_like(x)
    for i in range(len(x)):
        top = np.argsort(-logits[i], kind="stable")[:k]
        w = np.exp(logits[i, top] - logits[i, top].max())
        for e, we in zip(top, w / w.sum(), strict=True):
            h = _swiglu_oai(g[e] @ x[i] + gb[e], u[e] @ x[i] + ub[e])
            out[i] += we * (d[e] @ h + db[e])
    return out


@pytest.fixture(scope="module")
def f32(tmp_path_factory):
    """(path, f32 tensors) of an F32 gpt-oss file whose expert products reach SwiGLU's clamps
    (the gate and up stacks scaled up)."""
    t = tiny_tensors(OSS, sparse=False, seed=3)
    for l in range(OSS.n_layer):
        for n in (Names.FFN_GATE_EXPS, Names.FFN_UP_EXPS):
            t[n.format(l=l)] *= 12.0
    path = tmp_path_factory.mktemp("oss") / "oss-f32.gguf"
    return path, write_gguf_py(path, OSS, GGMLType.F32, tensors=t)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    path = tmp_path_factory.mktemp("oss") / "oss-mxfp4.gguf"
    write_gguf_py(path, OSS, GGMLType.Q8_0, seed=2, experts=GGMLType.MXFP4)
    return path


def test_the_layout_is_read_from_the_file(f32):
    llm = load(f32[0])
    a, blk = llm.model.args, llm.model.weights.blk
    assert a.swa_layers == (0, 2) and a.sliding_window == 8  # llama.cpp's period 2
    assert (a.expert_gating, a.expert_norm, a.n_ff_exp) == ("softmax_weight", False, 64)
    assert blk[0].attn_sinks.shape == (4,) and blk[0].attn_q.bias.shape == (128,)
    ex = blk[1].moe
    assert ex.act == "swiglu_oai" and ex.routing.router_b.shape == (8,)
    assert ex.gate_b.shape == ex.up_b.shape == ex.down_b.shape == (8, 64) and not ex.plain
    assert a.to_gguf_kv()["gpt-oss.attention.sliding_window"][0] == 8


def test_the_mixture_matches_a_float64_reference(f32):
    path, t = f32
    ex = load(path).model.weights.blk[1].moe
    x = 2 * torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    opts = RunOptions(numerics=EXACT)
    with numerics.using(EXACT):
        got = moe.moe_ffn(1, ex, x, opts, None)  # the prompt's path: tokens grouped by expert
        one = torch.cat([moe.moe_ffn(1, ex, x[i : i + 1], opts, None) for i in range(6)])
    want = _reference(t, 1, x.double().numpy(), 2)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(one.numpy(), want, rtol=0, atol=2e-5 * scale)  # the decode path
    g = x @ torch.from_numpy(t[Names.FFN_GATE_EXPS.format(l=1)][0]).T
    assert g.max() > 7 and g.min() < -7  # the clamps bite


def test_the_clamped_swiglu_in_c_is_the_torch_formula():
    g = torch.linspace(-20, 20, 4001)
    u = torch.linspace(9, -9, 4001)
    ref = torch.from_numpy(_swiglu_oai(g.double().numpy(), u.double().numpy()))
    native = moe_host.swiglu_oai(g, u)
    with numerics.using(EXACT):  # no native numerics: torch's
        plain = moe_host.swiglu_oai(g, u)
    torch.testing.assert_close(native.double(), ref, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(plain.double(), ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("window", [0, 5])
def test_sinks_take_their_share_of_the_softmax(f32, window):
    """A sink is one more logit per head without a value: ggml's order (f16 cache) and torch's
    (f32 cache) against float64, with and without the window."""
    a = load(f32[0]).model.args
    gen = torch.Generator().manual_seed(1)
    sinks = torch.tensor([-2.0, 0.0, 1.5, 4.0])
    sk = sinks.double().numpy()
    n, p0 = 3, 9
    q = torch.randn(n, a.n_head, a.head_dim, generator=gen)
    kv = torch.randn(2, p0 + n, a.n_head_kv, a.head_dim, generator=gen)
    group = a.n_head // a.n_head_kv
    want = np.zeros((n, a.n_head, a.head_dim))
    k64, v64 = kv.half().double().numpy()
    for i in range(n):
        lo = max(0, p0 + i - window + 1) if window else 0
        for h in range(a.n_head):
            s = k64[lo : p0 + i + 1, h // group] @ q[i, h].double().numpy() / a.head_dim**0.5
            e = np.exp(np.append(s, sk[h]) - max(s.max(), sk[h]))
            want[i, h] = (e[:-1] / e.sum()) @ v64[lo : p0 + i + 1, h // group]
    for dtype in (torch.float16, torch.float32):
        cache = load(f32[0]).model.new_cache(32)
        cache.k, cache.v = cache.k.to(dtype), cache.v.to(dtype)
        cache.k[0, : p0 + n], cache.v[0, : p0 + n] = kv[0].to(dtype), kv[1].to(dtype)
        got = attention.attend(a, q, cache, 0, p0, window=window, sinks=sinks)
        if dtype is torch.float16 and kernels.library() is not None:
            assert ggml_numerics.library(q) is not None  # ggml's path ran
        np.testing.assert_allclose(got.view(n, a.n_head, -1).numpy(), want, atol=2e-3)
    none = attention.attend(a, q, cache, 0, p0, window=window, sinks=torch.full((4,), -1e30))
    plain = attention.attend(a, q, cache, 0, p0, window=window)
    torch.testing.assert_close(none, plain)  # a sink of -inf changes nothing


def test_decode_is_one_native_call_with_the_per_op_bits(mxfp4, monkeypatch):
    """MXFP4 experts read in place (their file bytes); a decode step runs every layer in one
    native call (sinks, the window, the biased experts) with the per-op path's bits."""
    llm = load(mxfp4)
    ex = llm.model.weights.blk[0].moe
    assert ex.gate.ggml_type == GGMLType.MXFP4 and ex.down.ggml_type == GGMLType.MXFP4
    assert stack_decode.plan_for(llm.model, RunOptions()) is not None
    native_cache, cache = llm.model.new_cache(32), llm.model.new_cache(32)
    llm.model.forward(TOKENS[:12], native_cache)
    llm.model.forward(TOKENS[:12], cache)  # past the window of 8
    routed = []
    monkeypatch.setattr(moe, "route", lambda ex, x: routed.append(1) or routing.route(ex, x))
    native = llm.model.forward(TOKENS[12:13], native_cache)
    assert not routed
    traced = llm.model.forward(TOKENS[12:13], cache, RunOptions(observer=lambda *a: None))
    assert routed and torch.equal(native, traced)


def test_decode_equals_the_prompt_and_the_exact_numerics_stay_close(mxfp4):
    llm = load(mxfp4)
    full = llm.model.forward(TOKENS, llm.model.new_cache(32), all_logits=True)
    cache = llm.model.new_cache(32)
    steps = [llm.model.forward(TOKENS[:4], cache, all_logits=True)]
    steps += [llm.model.forward(TOKENS[i : i + 1], cache) for i in range(4, len(TOKENS))]
    torch.testing.assert_close(torch.cat(steps), full, rtol=0, atol=1e-4 * full.abs().max())
    exact = load(mxfp4, exact_activations=True).logits(TOKENS.tolist())
    spread = full.max() - full.min()
    assert (exact - full).abs().max() < 0.05 * spread  # MXFP4 values exact, f32 activations


@pytest.mark.parametrize("experts", [GGMLType.F16, GGMLType.MXFP4])
def test_hybrid_equals_cpu_only(tmp_path, experts):
    """The emulated accelerator: attention (its sinks and biases), the router with its bias and
    200 hot expert neurons a layer (their gate/up biases beside them) placed; the same logits
    as CPU-only (f32 activations); on fake CUDA tensors no host sync or cross-device op."""
    from fake_cuda import FakeCuda, run_prefill_and_decode

    from powerpy.formats.gpuidx import GpuIndex
    from powerpy.model.device import Accelerator
    from powerpy.placement.placement import Placement
    from powerpy.placement.runtime import build_hybrid

    path = tmp_path / "m.gguf"
    write_gguf_py(path, OSS, GGMLType.F16, seed=2, experts=experts)
    llm = load(path)
    n = OSS.n_expert * OSS.n_ff_exp
    rng = np.random.default_rng(0)
    index = GpuIndex.from_buckets(
        [np.sort(rng.choice(n, 200, replace=False)) for _ in range(OSS.n_layer)], n, vram_capacity=0
    )
    placement = Placement.for_model(llm.file, 1 << 30, index, n_ctx=32, kv_elem_bytes=4)
    for name in ("blk.1.ffn_gate_inp.bias", "blk.1.attn_sinks.weight", "blk.1.attn_q.bias"):
        assert name in placement.gpu_tensors
    opts = RunOptions(numerics=EXACT)
    cache = llm.model.new_cache(32, dtype=torch.float32)
    ref = llm.model.forward(TOKENS, cache, opts, all_logits=True)
    rt = build_hybrid(llm.model, placement, Accelerator("cpu"), file=llm.file)
    assert not rt.skipped and rt.model.weights.blk[0].moe.hot.gate_b.shape == (200,)
    got = rt.model.forward(
        TOKENS, rt.model.new_cache(32, dtype=torch.float32), opts, all_logits=True
    )
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-3 * ref.abs().max())
    fake = build_hybrid(llm.model, placement, FakeCuda(), file=llm.file)
    logits = run_prefill_and_decode(fake.model, TOKENS, 32, 6, 3, llm.options)
    assert logits.shape == (1, OSS.n_vocab)


def _refused(tmp_path, exc, match, drop=()):
    refused(tmp_path, OSS, exc, match, drop=drop, seed=0)


@pytest.mark.parametrize(
    "name",
    [
        "blk.1.attn_sinks.weight",
        "blk.0.attn_v.bias",
        "blk.2.attn_output.bias",
        "blk.1.ffn_gate_inp.bias",
        "blk.0.ffn_up_exps.bias",
        "blk.2.ffn_down_exps.bias",
    ],
)
def test_a_missing_tensor_is_named(tmp_path, name):
    _refused(tmp_path, FileFormatError, f"tensor {re.escape(repr(name))} is missing", [name])


def test_a_misshapen_expert_bias_and_a_missing_window_are_named(tmp_path):
    t = tiny_tensors(OSS, sparse=False, seed=0)
    t["blk.1.ffn_gate_exps.bias"] = t["blk.1.ffn_gate_exps.bias"][:, :32]
    path = tmp_path / "shape.gguf"
    write_gguf_py(path, OSS, GGMLType.F32, tensors=t)
    bad = r"'blk\.1\.ffn_gate_exps\.bias' has shape \(8, 32\)"
    with pytest.raises(ModelConfigError, match=bad):
        load(path)
    from powerpy.formats.gguf_reader import read_gguf

    write_gguf_py(path, OSS, GGMLType.F32)
    with read_gguf(path) as f:
        kv = dict(f.kv)
    del kv["gpt-oss.attention.sliding_window"]
    from powerpy.config import ModelArgs

    with pytest.raises(ModelConfigError, match=r"gpt-oss\.attention\.sliding_window"):
        ModelArgs.from_gguf_kv(kv, sparse=False)
