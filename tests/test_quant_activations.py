"""llama.cpp's activation rounding (ggml's vec_dot_type) in the native kernels.

Quantized weights multiply activations rounded to Q8_0 (Q8_0, Q4_0, Q5_0 weights), Q8_1 (Q4_1,
Q5_1) or Q8_K (K-quants) blocks with integer dot products. Every kernel and SIMD build is checked
against ``quant_fixtures.ref_qdot``: the gguf-py dequantized weights times the activations
rounded in numpy the same way, in float64.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from quant_fixtures import ACT_KIND, random_blocks, ref_qdot, ref_quantize_act

from powerpy.formats.constants import TYPE_TRAITS, GGMLType
from powerpy.model import kernels, numerics
from powerpy.model.ffn import glu
from powerpy.model.matrices import QuantWeight
from powerpy.model.numerics import Numerics

ROWS = 67
EPS = 2e-5  # relative to sum |w_i| |xq_i|: f32 accumulation of exact integer block sums


@pytest.fixture(scope="module", params=["native", "avx2", "scalar"])
def lib(request) -> kernels.KernelLibrary:
    """Each SIMD build (the AVX2 and scalar builds come from test_kernels' cached flags)."""
    from test_kernels import _VARIANT_FLAGS

    if kernels.find_compiler() is None or not kernels.available():
        pytest.skip("native kernels unavailable")
    if request.param == "native":
        return kernels.library()
    try:
        return kernels.build(flags=_VARIANT_FLAGS[request.param])
    except kernels.KernelBuildError as e:
        pytest.skip(str(e))


@pytest.fixture(autouse=True)
def quantized() -> Iterator[None]:
    with numerics.using(Numerics(quantized_activations=True)):
        yield


def weight(t: GGMLType, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray, kernels.Matrix]:
    """(raw blocks, exact values (rows, cols) float64, kernel matrix)."""
    import gguf

    bs = TYPE_TRAITS[t].block_size
    raw = random_blocks(np.random.default_rng(seed), t, ROWS, cols // bs)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t))).astype(np.float64)
    return raw, w, kernels.Matrix.of_quant(torch.from_numpy(raw), t, cols)


def bound(w: np.ndarray, x: np.ndarray, kind: str) -> np.ndarray:
    xq, _ = ref_quantize_act(x, kind)
    return np.abs(w) @ np.abs(xq) + 1e-30


def check(got: torch.Tensor, want: np.ndarray, tol: np.ndarray) -> None:
    err = np.abs(got.double().numpy() - want)
    assert (err <= EPS * tol).all(), f"max err {err.max():.3g}, worst {(err / tol).max():.3g}"


def activations(cols: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(cols).astype(np.float32)
    x[:32] = 0.0  # an all-zero block (d = 0)
    x[256:288] *= 100.0  # a block with a large dynamic range
    x[-5] = -50.0  # a negative extreme (Q8_K's scale sign)
    return x


@pytest.mark.parametrize("t", kernels.QUANT_TYPES, ids=lambda t: t.name)
def test_gemv_gather_and_glu(lib, t) -> None:
    cols = 512
    raw, w, m = weight(t, cols, seed=1)
    graw, gw, gm = weight(t, cols, seed=2)
    x = activations(cols, seed=3)
    kind = ACT_KIND[t]
    want, tol = ref_qdot(w, raw, t, x), bound(w, x, kind)
    check(lib.gather_gemv(m, torch.from_numpy(x), None), want, tol)
    gwant, gtol = ref_qdot(gw, graw, t, x), bound(gw, x, kind)
    for idx in (torch.tensor([], dtype=torch.int64), torch.tensor([3, 0, 66, 3]), None):
        sel = np.arange(ROWS) if idx is None else idx.numpy()
        if idx is not None:
            check(lib.gather_gemv(m, torch.from_numpy(x), idx), want[sel], tol[sel])
        full = torch.arange(ROWS) if idx is None else idx
        got = lib.glu(gm, m, torch.from_numpy(x), full, "reglu")
        ref = glu(torch.from_numpy(gwant[sel]), torch.from_numpy(want[sel]), "reglu").numpy()
        gb = np.maximum(gwant[sel], 0)
        check(got, ref, gtol[sel] * np.abs(want[sel]) + gb * tol[sel] + gtol[sel] * tol[sel])


@pytest.mark.parametrize("t", kernels.QUANT_TYPES, ids=lambda t: t.name)
def test_gemm_rounds_each_token(lib, t) -> None:
    cols = 512
    raw, w, m = weight(t, cols, seed=4)
    for T in (2, 5, 40):
        X = np.stack([activations(cols, seed=10 + i) * (1 + i % 3) for i in range(T)])
        got = lib.gemm(m, torch.from_numpy(X))
        for i in range(T):
            check(got[i], ref_qdot(w, raw, t, X[i]), bound(w, X[i], ACT_KIND[t]))


def test_f32_mode_is_exact_and_differs() -> None:
    """--exact-activations: the same call in f32 matches the float64 product, not the rounded."""
    if not kernels.available():
        pytest.skip("native kernels unavailable")
    raw, w, _ = weight(GGMLType.Q4_1, 256, seed=5)
    qw = QuantWeight(torch.from_numpy(raw), GGMLType.Q4_1, 256)
    x = activations(256, seed=6)
    rounded = qw.linear(torch.from_numpy(x)).double().numpy()
    with numerics.using(Numerics(quantized_activations=False)):
        exact = qw.linear(torch.from_numpy(x)).double().numpy()
    tol = np.abs(w) @ np.abs(x)
    assert np.all(np.abs(exact - w @ x) <= EPS * tol)
    assert np.all(np.abs(rounded - ref_qdot(w, raw, GGMLType.Q4_1, x)) <= EPS * tol)
    assert np.abs(rounded - exact).max() > 1e-3 * tol.max()  # the rounding is visible


def test_large_batches_use_the_integer_gemm() -> None:
    """T > 8 goes through the integer GEMM too (llama.cpp rounds prompt tokens the same way)."""
    if not kernels.available():
        pytest.skip("native kernels unavailable")
    raw, w, _ = weight(GGMLType.Q4_0, 256, seed=7)
    qw = QuantWeight(torch.from_numpy(raw), GGMLType.Q4_0, 256)
    X = np.random.default_rng(8).standard_normal((20, 256)).astype(np.float32)
    got = qw.linear(torch.from_numpy(X))
    for i in (0, 19):
        check(got[i], ref_qdot(w, raw, GGMLType.Q4_0, X[i]), bound(w, X[i], "q8_0"))


BLOCK32 = [t for t in kernels.QUANT_TYPES if TYPE_TRAITS[t].block_size == 32]


@pytest.mark.parametrize("t", BLOCK32, ids=lambda t: t.name)
@pytest.mark.parametrize("cols", [32, 96, 544, 608])
def test_rows_that_end_in_a_partial_group(lib, t, cols) -> None:
    """Rows of 1, 3, 17 and 19 blocks: a kernel reading blocks in pairs or groups (AVX-512's
    prompt tiles) ends in a partial group, whose bytes past the row must not count (the last row
    ends the buffer)."""
    raw, w, m = weight(t, cols, seed=cols)
    x = activations(cols, seed=cols + 1) if cols > 288 else np.random.default_rng(3).random(cols)
    x = x.astype(np.float32)
    want, tol = ref_qdot(w, raw, t, x), bound(w, x, ACT_KIND[t])
    check(lib.gather_gemv(m, torch.from_numpy(x), None), want, tol)
    idx = torch.tensor([66, 0, 65, 66])
    check(lib.gather_gemv(m, torch.from_numpy(x), idx), want[idx.numpy()], tol[idx.numpy()])
    X = np.stack([x * (1 + i % 3) - i for i in range(13)]).astype(np.float32)
    got = lib.gemm(m, torch.from_numpy(X))
    for i in range(13):
        check(got[i], ref_qdot(w, raw, t, X[i]), bound(w, X[i], ACT_KIND[t]))


def test_gemm_skips_tiles_no_token_needs(lib) -> None:
    """A predictor-gated prompt: the entries a token needs are those of the full GEMM (Q4_0:
    those of its decode's row gathers, which take the interleaved layout's order on AVX2 and
    AVX-512 builds); on those builds a Q4_0 group of 8 rows that no token of a 4-token tile
    needs comes back 0 (other types compute every entry)."""
    cols, T = 256, 21
    for t in (GGMLType.Q4_0, GGMLType.Q8_0):
        raw, w, m = weight(t, cols, seed=11)
        X = np.random.default_rng(12).standard_normal((T, cols)).astype(np.float32)
        X = torch.from_numpy(X)
        need = torch.from_numpy(np.random.default_rng(13).random((T, ROWS)) < 0.03)
        need[20, 5] = True  # a group needed by the last, one-token tile only
        full = lib.gemm(m, X)
        if t == GGMLType.Q4_0:
            full = torch.stack([lib.gather_gemv(m, x, torch.arange(ROWS)) for x in X])
        got = lib.gemm(m, X, need=need)
        assert torch.equal(got[need], full[need])
        if t == GGMLType.Q4_0 and lib is kernels.library() and lib.simd in ("AVX2", "AVX-512"):
            skipped = torch.ones(T, ROWS, dtype=torch.bool)  # tiles 4, 4, 4, 4, 4, 1 x groups
            for t0, t1 in ((0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 21)):
                for g in range(0, ROWS, 8):
                    skipped[t0:t1, g : g + 8] = not need[t0:t1, g : g + 8].any()
            assert skipped.sum() > T * ROWS // 4 and not skipped[20, 0:8].any()
            assert torch.equal(got[skipped], torch.zeros(int(skipped.sum())))
            assert torch.equal(got[~skipped], full[~skipped])  # a needed group: all its rows
        with pytest.raises(ValueError, match="need has shape"):
            lib.gemm(m, X, need=need.t().contiguous())


@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.Q4_1, GGMLType.Q6_K, GGMLType.MXFP4])
def test_a_cuts_down_product_reads_only_kept_groups(lib, t) -> None:
    """A mixture's cut down product (``down_runs``, the kept groups' chunks only) in every
    build: the rounded activations' product over the kept groups, as the whole product of h
    with the cut groups zero."""
    cols, g = 512, 256 if t == GGMLType.Q6_K else 32
    raw, w, m = weight(t, cols, seed=21)
    rng = np.random.default_rng(22)
    x = activations(cols, seed=23)
    x[np.repeat(rng.random(cols // g) < 0.5, g)] = 0.0
    got = lib.down_runs(m, torch.from_numpy(x)[None])[0]
    check(got, ref_qdot(w, raw, t, x), bound(w, x, ACT_KIND[t]))
