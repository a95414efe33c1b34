"""llama.cpp's float numerics (powerpy.model.ggml_numerics): exp and SiLU, RoPE, RMSNorm and
f16-cache attention against float64 references, the vector and scalar paths against each other,
and the batched integer GEMM against the one-token order bit for bit. The end-to-end oracle
(bit-identical logits against llama.cpp) is tests/test_llama_cpp_oracle.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_fixtures import random_blocks

from powerpy.config import FFNVariant, ModelArgs
from powerpy.formats.constants import GGMLType
from powerpy.model import ggml_numerics as gn
from powerpy.model import kernels


@pytest.fixture(scope="module")
def c():
    lib = gn.library()
    if lib is None:
        pytest.skip("native kernels unavailable")
    return lib


def _args(n_head=4, n_head_kv=2, head_dim=64, n_rot=None, base=10000.0) -> ModelArgs:
    return ModelArgs(
        arch="llama",
        n_vocab=8,
        n_embd=n_head * head_dim,
        n_layer=1,
        n_ff=16,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_rot=n_rot or head_dim,
        rope_base=base,
        norm_eps=1e-5,
        n_ctx_train=4096,
        sparse=False,
        ffn_variant=FFNVariant.SWIGLU,
        sparse_threshold=0.0,
    )


def test_swiglu_vector_and_scalar_paths_agree(c) -> None:
    """17 values: 16 take the vector path, the 17th the scalar one; each value also alone."""
    g = torch.tensor(
        [
            -200.0,
            -88.0,
            -20.0,
            -1.5,
            -1e-3,
            0.0,
            1e-3,
            0.5,
            1.0,
            3.0,
            10.0,
            30.0,
            87.0,
            89.0,
            200.0,
            float("-inf"),
            2.5,
        ]
    )
    u = torch.linspace(-2, 2, g.numel())
    got = gn.swiglu_(c, g.clone(), u)
    one_by_one = torch.stack(
        [gn.swiglu_(c, g[i : i + 1].clone(), u[i : i + 1])[0] for i in range(17)]
    )
    assert torch.equal(got.isnan(), one_by_one.isnan())
    assert torch.equal(got.nan_to_num(), one_by_one.nan_to_num())
    want = (g.double() * torch.sigmoid(g.double()) * u.double()).float()
    ok = g.isfinite()
    torch.testing.assert_close(got[ok], want[ok], rtol=3e-7, atol=1e-30)


def test_expf_matches_float64_over_the_range(c) -> None:
    x = torch.linspace(-80.0, 88.0, 4001)  # silu(x) stays a normal float
    # silu(x) = x / (1 + exp(-x)), so exp(-x) = x / silu(x) - 1 where both are well defined
    s = gn.swiglu_(c, x.clone(), torch.ones_like(x)).double()
    want = x.double() * torch.sigmoid(x.double())
    rel = ((s - want).abs() / want.abs().clamp_min(1e-38))[x.abs() > 1e-3]
    assert float(rel.max()) < 4e-7


def test_rms_norm_matches_float64(c) -> None:
    x = torch.randn(5, 576)
    w = torch.randn(576)
    got = gn.rms_norm(c, x, w, 1e-5)
    xd = x.double()
    want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("base", [10000.0, 100000.0])
def test_rope_table_follows_f32_recurrence(c, base) -> None:
    a = _args(base=base)
    pos = torch.tensor([0, 1, 7, 100, 4095])
    rot = torch.view_as_real(gn.rope_table(c, a, pos)).double()  # (n, n_rot/2, 2)
    inv = base ** (-torch.arange(0, a.n_rot, 2, dtype=torch.float64) / a.n_rot)
    ang = pos.double()[:, None] * inv[None]
    assert torch.equal(rot[0, :, 0], torch.ones(a.n_rot // 2, dtype=torch.float64))
    assert torch.equal(rot[0, :, 1], torch.zeros(a.n_rot // 2, dtype=torch.float64))
    # f32 angles: the error grows with the position and the pair index (ggml's recurrence)
    tol = 4 * np.finfo(np.float32).eps * (ang.abs() + 1) * (1 + torch.arange(a.n_rot // 2))
    assert bool(((rot[..., 0] - ang.cos()).abs() <= tol).all())
    assert bool(((rot[..., 1] - ang.sin()).abs() <= tol).all())


def test_rope_rotates_pairs(c) -> None:
    a = _args(n_rot=32)
    x = torch.randn(3, 4, 64)
    rot = gn.rope_table(c, a, torch.tensor([0, 5, 9]))
    got = gn.rope(c, x, rot, 32).double()
    z = torch.view_as_complex(x[..., :32].double().reshape(3, 4, 16, 2).contiguous())
    want = torch.view_as_real(z * rot.to(torch.complex128)[:, None]).flatten(-2)
    torch.testing.assert_close(got[..., :32], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., 32:], x[..., 32:].double())  # beyond n_rot: unchanged


def _reference_attention(a: ModelArgs, q, k, v, p0: int) -> torch.Tensor:
    """float64 causal GQA attention over f16-rounded q (as llama.cpp rounds it)."""
    T = q.shape[0]
    qd = q.half().double()
    kd, vd = k.double(), v.double()
    out = torch.empty(T, a.n_head, a.head_dim, dtype=torch.float64)
    group = a.n_head // a.n_head_kv
    for i in range(T):
        n = p0 + i + 1
        for h in range(a.n_head):
            s = kd[:n, h // group] @ qd[i, h] / a.head_dim**0.5
            out[i, h] = torch.softmax(s, 0) @ vd[:n, h // group]
    return out.reshape(T, -1)


@pytest.mark.parametrize("head_dim", [64, 40, 6])  # tinyBLAS order, its q·k fallback, both
@pytest.mark.parametrize(("p0", "T"), [(0, 1), (0, 9), (37, 1), (70, 5)])
def test_attention_matches_float64(c, head_dim, p0, T) -> None:
    a = _args(n_head=6, n_head_kv=2, head_dim=head_dim)
    g = torch.Generator().manual_seed(p0 + T + head_dim)
    n_ctx = 96
    k = torch.randn(n_ctx, 2, head_dim, generator=g).half()
    v = torch.randn(n_ctx, 2, head_dim, generator=g).half()
    k[p0 + T :] = float("nan")  # cells past the filled ones must never be read
    v[p0 + T :] = float("nan")
    q = torch.randn(T, 6, head_dim, generator=g) * 2
    got = gn.attention(c, a, q, k, v, p0)
    want = _reference_attention(a, q, k[: p0 + T].float(), v[: p0 + T].float(), p0)
    # the softmax weights are rounded to f16: a relative error of about 2^-11 per weight
    torch.testing.assert_close(got.double(), want, rtol=0, atol=3e-3)


def test_model_attention_uses_ggml_order_only_with_an_f16_cache(c) -> None:
    """An f32 cache keeps torch's exact attention; f16 (the default) takes ggml's."""
    from powerpy.model.attention import attend
    from powerpy.model.cache import KVCache

    a = _args()
    q = torch.randn(3, a.n_head, a.head_dim)
    caches = {dt: KVCache(a, 8, dt) for dt in (torch.float16, torch.float32)}
    kv = torch.randn(2, 3, a.n_head_kv, a.head_dim).half()
    for cache in caches.values():
        cache.k[0, :3], cache.v[0, :3] = kv[0], kv[1]
    ggml = attend(a, q, caches[torch.float16], 0, 0)
    exact = attend(a, q, caches[torch.float32], 0, 0)
    assert torch.equal(
        ggml, gn.attention(c, a, q, caches[torch.float16].k[0], caches[torch.float16].v[0], 0)
    )
    assert not torch.equal(ggml, exact)
    torch.testing.assert_close(ggml, exact, rtol=0, atol=3e-3)


@pytest.mark.parametrize("qt", [GGMLType.Q8_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1])
def test_batched_gemm_equals_one_token_bit_for_bit(qt) -> None:
    """Prompt batches (8+ tokens take the wide AVX-512 path) sum each token in the one-token
    order, as llama.cpp's batched matmuls of these types do."""
    lib = kernels.library()
    if lib is None:
        pytest.skip("native kernels unavailable")
    raw = random_blocks(np.random.default_rng(int(qt)), qt, 37, 8)
    m = kernels.Matrix.of_quant(torch.from_numpy(raw), qt, 256)
    x = torch.randn(19, 256)
    got = lib.gemm(m, x)
    for t in range(19):
        assert torch.equal(got[t], lib.gather_gemv(m, x[t], None)), t


def test_cache_type_option(smollm2_path) -> None:
    """Host KV caches are f16 by default (llama.cpp's), f32 on request; others are refused."""
    from powerpy.api import load

    assert load(smollm2_path).model.new_cache(4).k.dtype is torch.float16
    llm = load(smollm2_path, cache_type="f32")
    assert llm.model.new_cache(4).v.dtype is torch.float32
    assert llm.model.new_cache(4, dtype=torch.float16).k.dtype is torch.float16
    with pytest.raises(ValueError, match="'q8_0'"):
        load(smollm2_path, cache_type="q8_0")


def test_cli_cache_types_must_match() -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "powerpy", "infer", "-n", "1", "-ctk", "f32", "-ctv", "f16"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "-ctk f32 and -ctv f16 differ" in res.stderr and "Traceback" not in res.stderr


def test_cache_type_survives_a_hybrid_placement(tmp_path) -> None:
    from powerpy.api import load
    from powerpy.testing.tiny import TinySpec, write_tiny_model

    path = tmp_path / "h.powerinfer.gguf"
    write_tiny_model(path, TinySpec(), sparse=True, seed=3)
    llm = load(path, cache_type="f32", vram_budget=1.0, device="cpu")
    assert llm.runtime is not None and llm.model.cache_dtype is torch.float32
