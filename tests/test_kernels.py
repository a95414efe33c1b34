"""Native sparse-FFN kernels and the matrices.py methods vs float64 torch references.

Kernel-only tests skip cleanly when no C++ compiler is available; the torch fallback is tested
either way. Besides the native (-march=native) build, the AVX2 and scalar code paths are
compiled as separate variants (x86-64 only) so that all three SIMD branches are exercised.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from quant_fixtures import random_blocks

from powerpy.config import FFNVariant
from powerpy.formats.constants import GGMLType
from powerpy.model import kernels, numerics
from powerpy.model import matrices as weights
from powerpy.model.ffn import glu, glu_rows
from powerpy.model.matrices import DenseWeight, QuantWeight
from powerpy.model.numerics import Numerics

FLOATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
QUANTS = {t.name.lower(): t for t in kernels.QUANT_TYPES}
K_QUANTS = ("q4_k", "q5_k", "q6_k")  # 256-element super-blocks
DTYPES = [*FLOATS, *QUANTS]
VARIANTS = ["reglu", "drelu", "swiglu"]
ROWS = 203  # odd, not a multiple of anything useful
EPS = 2e-5  # tolerance relative to sum |w_i x_i| for f32-accumulated results


# ---- data --------------------------------------------------------------------------------------


def quantize(w: np.ndarray, qt: GGMLType) -> np.ndarray:
    """Raw ggml blocks (rows, row_bytes) uint8, via powerpy.formats.quants when it is there."""
    try:
        from powerpy.formats import quants

        fn = {GGMLType.Q8_0: quants.quantize_q8_0, GGMLType.Q4_0: quants.quantize_q4_0}[qt]
        raw = np.asarray(fn(w))
        if raw.dtype == np.uint8 and raw.shape[0] == w.shape[0]:
            return raw.reshape(w.shape[0], -1)
    except (ImportError, AttributeError, KeyError):
        pass
    import gguf

    return gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(qt)))


def dequantize_oracle(raw: np.ndarray, qt: GGMLType) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qt)))


def make_weight(dtype: str, rows: int, cols: int, seed: int = 0):
    """(weight object, its exact values as float64 (rows, cols))."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    if dtype in FLOATS:
        t = torch.from_numpy(w).to(FLOATS[dtype])
        return DenseWeight(t), t.double()
    if dtype in K_QUANTS:  # no quantizer in gguf-py: random blocks
        raw = random_blocks(rng, QUANTS[dtype], rows, cols // 256)
    else:
        raw = quantize(w, QUANTS[dtype])
    exact = torch.from_numpy(dequantize_oracle(raw, QUANTS[dtype])).double()
    return QuantWeight(torch.from_numpy(raw), QUANTS[dtype], cols), exact


def cols_for(dtype: str) -> list[int]:
    # 72: a tail after whole 32-element blocks; 96: an odd block count; 2048: a real width
    if dtype in K_QUANTS:
        return [256, 768, 2048]
    return [72, 96, 2048] if dtype in FLOATS else [64, 96, 2048]


def small_cols(dtype: str) -> tuple[int, int]:
    return (256, 512) if dtype in K_QUANTS else (64, 96)


def index_sets(rows: int, seed: int = 0) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for k in (0, 1, 7, 100, rows):
        perm = torch.randperm(rows, generator=g)[:k]
        yield perm  # unsorted
        yield perm.sort().values
    yield torch.tensor([5, 5, 0, rows - 1, 5])  # duplicates


def close(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, eps: float = EPS) -> None:
    err = (got.double() - ref).abs()
    tol = eps * bound + 1e-30
    assert got.shape == ref.shape, (got.shape, ref.shape)
    bad = err > tol
    assert not bad.any(), f"max err {err.max():.3g}, worst ratio {(err / tol).max():.3g}"


@pytest.fixture(autouse=True)
def exact_activations() -> Iterator[None]:
    """These tests compare with f32 math; llama.cpp's rounding: test_quant_activations.py."""
    with numerics.using(Numerics(quantized_activations=False)):
        yield


@pytest.fixture
def threads() -> Iterator[None]:
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


# ---- libraries ---------------------------------------------------------------------------------

_VARIANT_FLAGS = {
    "avx2": ("-O2", "-march=x86-64-v3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"),
    "scalar": ("-O2", "-march=x86-64", "-fopenmp", "-shared", "-fPIC", "-std=c++17"),
}


@pytest.fixture(scope="session")
def variant_libs() -> dict[str, kernels.KernelLibrary | str]:
    """The AVX2 and scalar builds, compiled concurrently (a library, or why it is missing)."""
    if kernels.find_compiler() is None:
        return dict.fromkeys(_VARIANT_FLAGS, "no C++ compiler")
    if platform.machine() not in ("x86_64", "AMD64"):
        return dict.fromkeys(_VARIANT_FLAGS, "SIMD variants are x86-64 builds")
    with ThreadPoolExecutor(len(_VARIANT_FLAGS)) as ex:
        futures = {
            name: ex.submit(kernels.build, flags=flags)  # cached like the native build
            for name, flags in _VARIANT_FLAGS.items()
        }
    return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="session", params=["native", "avx2", "scalar"])
def lib(request: pytest.FixtureRequest) -> kernels.KernelLibrary:
    """Each SIMD variant of the kernel library (skipped without a compiler)."""
    if request.param == "native":
        native = kernels.library()
        if native is None:
            pytest.skip("native kernels unavailable")
        return native
    built = request.getfixturevalue("variant_libs")[request.param]
    if isinstance(built, str):
        pytest.skip(built)
    return built


@pytest.fixture
def kernels_on() -> Iterator[None]:
    if not kernels.available():
        pytest.skip("native kernels unavailable")
    yield


@pytest.fixture(scope="session")
def teams_lib() -> kernels.KernelLibrary:
    """The native build with no minimum of work per thread (``PP_MIN_BYTES_PER_THREAD=1``):
    tiny test matrices then take as many threads as asked. The bits must not change: no
    kernel's result depends on its team size."""
    if kernels.library() is None:
        pytest.skip("native kernels unavailable")
    return kernels.build(flags=(*kernels.DEFAULT_FLAGS, "-DPP_MIN_BYTES_PER_THREAD=1"))


@pytest.fixture
def tiny_threads(request) -> Iterator[kernels.KernelLibrary]:
    """The library whose kernels split tiny matrices over 2 threads (restored afterwards)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield request.getfixturevalue("teams_lib")
    torch.set_num_threads(saved)


def thread_configs(lib: kernels.KernelLibrary, request) -> Iterator[kernels.KernelLibrary]:
    """``lib`` on 1 thread, then (native build only) the teams build on 2 threads, which splits
    even tiny matrices: the library to call.

    The threading code is the same for every SIMD level, so only the native build runs the
    2-thread pass (2-thread calls are slow on a busy shared machine).
    """
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        yield lib
        if lib is not kernels.library():
            return
        torch.set_num_threads(2)
        yield request.getfixturevalue("teams_lib")
    finally:
        torch.set_num_threads(saved)


def matrix(wobj) -> kernels.Matrix:
    if isinstance(wobj, DenseWeight):
        return kernels.Matrix.of_dense(wobj.w)
    return kernels.Matrix.of_quant(wobj.raw, wobj.ggml_type, wobj.cols)


# ---- raw kernels vs float64 ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_gemv(lib, dtype, request) -> None:
    for cols in cols_for(dtype):
        wobj, w = make_weight(dtype, ROWS, cols, seed=cols)
        m = matrix(wobj)
        x = torch.randn(cols)
        for run in thread_configs(lib, request):
            for idx in index_sets(ROWS):
                got = run.gather_gemv(m, x, idx)
                close(got, w[idx] @ x.double(), w[idx].abs() @ x.double().abs())
            full = run.gather_gemv(m, x, None)  # dense GEMV over all rows
            close(full, w @ x.double(), w.abs() @ x.double().abs())


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_axpy(lib, dtype, request) -> None:
    for cols in cols_for(dtype):
        wobj, w = make_weight(dtype, ROWS, cols, seed=cols + 1)
        m = matrix(wobj)
        for run in thread_configs(lib, request):
            for idx in index_sets(ROWS):
                h = torch.randn(idx.numel())
                h[::3] = 0.0  # skipped rows
                ref = h.double() @ w[idx]
                bound = h.double().abs() @ w[idx].abs()
                close(run.gather_axpy(m, h, idx), ref, bound)
                acc = torch.randn(cols)
                got = run.gather_axpy(m, h, idx, out=acc.clone())
                close(got, ref + acc.double(), bound + acc.double().abs())


@pytest.mark.parametrize("dtype", DTYPES)
def test_glu(lib, dtype, request) -> None:
    for cols in cols_for(dtype)[1:]:
        gobj, g = make_weight(dtype, ROWS, cols, seed=2 * cols)
        uobj, u = make_weight(dtype, ROWS, cols, seed=2 * cols + 1)
        x = torch.randn(cols).double()
        for run in thread_configs(lib, request):
            for idx in index_sets(ROWS):
                gv, uv = g[idx] @ x, u[idx] @ x
                gb, ub = g[idx].abs() @ x.abs(), u[idx].abs() @ x.abs()
                for variant in VARIANTS:
                    ref = glu(gv, uv, variant)
                    got = run.glu(matrix(gobj), matrix(uobj), x.float(), idx, variant)
                    bound = gb * uv.abs() + (gv.abs() + gb) * ub
                    close(got, ref, bound, eps=4 * EPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm(lib, dtype, request) -> None:
    for cols in cols_for(dtype)[:2]:
        wobj, w = make_weight(dtype, ROWS, cols, seed=3 * cols)
        m = matrix(wobj)
        for run in thread_configs(lib, request):
            for T in (1, 2, 3, 4, 5, 9):
                x = torch.randn(T, cols)
                close(run.gemm(m, x), x.double() @ w.T, x.double().abs() @ w.abs().T)
            # strided x and out (column block of a wider buffer)
            xs = torch.randn(3, cols + 8)[:, 4 : 4 + cols]
            out = torch.full((3, ROWS + 5), 7.0)
            run.gemm(m, xs, out=out[:, 2 : 2 + ROWS])
            close(out[:, 2 : 2 + ROWS], xs.double() @ w.T, xs.double().abs() @ w.abs().T)
            assert (out[:, :2] == 7).all() and (out[:, 2 + ROWS :] == 7).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequant_rows_exact(lib, dtype, request) -> None:
    for run, cols in ((r, c) for r in thread_configs(lib, request) for c in cols_for(dtype)):
        wobj, w = make_weight(dtype, ROWS, cols, seed=4 * cols)
        m = matrix(wobj)
        assert torch.equal(run.dequant_rows(m, None).double(), w)
        idx = torch.tensor([3, 0, ROWS - 1, 3])
        assert torch.equal(run.dequant_rows(m, idx).double(), w[idx])
        assert torch.equal(run.dequant_rows(m, None, 10, 20).double(), w[10:30])


def test_half_conversion_all_values(lib) -> None:
    """Every f16 bit pattern (the scalar build converts in software)."""
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    m = kernels.Matrix.of_dense(bits.reshape(1, -1))
    got = lib.dequant_rows(m, None)[0]
    ref = bits.float()
    assert torch.equal(got.isnan(), ref.isnan())
    ok = ~ref.isnan()
    assert torch.equal(got[ok].view(torch.int32), ref[ok].view(torch.int32))  # -0.0 kept


def test_strided_rows(lib) -> None:
    """Rows of a wider buffer (row stride > cols) are read in place."""
    base = torch.randn(ROWS, 160).to(torch.float16)
    view = base[:, 32:128]  # (ROWS, 96), stride(0) = 160
    m = kernels.Matrix.of_dense(view)
    w, x, idx = view.double(), torch.randn(96), torch.tensor([1, 50, 7])
    close(lib.gather_gemv(m, x, idx), w[idx] @ x.double(), w[idx].abs() @ x.double().abs())
    h = torch.randn(3)
    close(lib.gather_axpy(m, h, idx), h.double() @ w[idx], h.double().abs() @ w[idx].abs())


def test_index_errors(lib) -> None:
    wobj, _ = make_weight("q4_0", ROWS, 64)
    m = matrix(wobj)
    x = torch.randn(64)
    for bad in (torch.tensor([0, ROWS]), torch.tensor([-1, 2])):
        with pytest.raises(IndexError):
            lib.gather_gemv(m, x, bad)
        with pytest.raises(IndexError):
            lib.gather_axpy(m, torch.ones(2), bad)
        with pytest.raises(IndexError):
            lib.glu(m, m, x, bad, "reglu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_sums_are_the_same_bits_at_any_team_size(teams_lib, dtype, threads) -> None:
    """Every row-sum export (``gather_axpy`` over an index list, adding into ``out`` or not;
    ``rows_sum`` over a batch) gives the same bits on teams of 1 to 4 threads, and each token of
    a batch the bits of its own one-token sum (so a prompt's rows do not depend on how it is cut
    into batches). The teams build splits even these small matrices."""
    lib = teams_lib
    for cols in cols_for(dtype):
        wobj, _ = make_weight(dtype, ROWS, cols, seed=5 * cols)
        m = matrix(wobj)
        g = torch.Generator().manual_seed(cols)
        idx = torch.randperm(ROWS, generator=g)[: ROWS // 2]
        h = torch.randn(idx.numel(), generator=g)
        h[::4] = 0.0
        acc = torch.randn(cols, generator=g)
        hb = torch.randn(13, ROWS, generator=g).clamp_(min=0.5) - 0.5  # mostly zeros
        hb[3] = torch.randn(ROWS, generator=g)  # one dense token
        got = {}
        for nt in (1, 2, 3, 4):
            torch.set_num_threads(nt)
            got[nt] = (
                lib.gather_axpy(m, h, idx),
                lib.gather_axpy(m, h, idx, out=acc.clone()),
                lib.rows_sum(m, hb),
            )
        for nt in (2, 3, 4):
            assert all(torch.equal(a, b) for a, b in zip(got[1], got[nt], strict=True)), (cols, nt)
        torch.set_num_threads(1)
        every = torch.arange(ROWS)
        one = torch.stack([lib.gather_axpy(m, hb[t], every) for t in range(hb.shape[0])])
        assert torch.equal(got[4][2], one), cols


# ---- matrices.py: kernel path vs torch fallback vs float64 ---------------------------------------


def fallback_eps(dtype: str) -> float:
    # the torch fallback computes f16/bf16 rows in their own precision
    return {"f16": 2e-3, "bf16": 2e-2}.get(dtype, EPS)


@pytest.fixture(params=["kernel", "torch"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "kernel" and not kernels.available():
        pytest.skip("native kernels unavailable")
    with numerics.using(Numerics(request.param == "kernel", quantized_activations=False)):
        yield request.param


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_methods(dtype, path, threads) -> None:
    eps = EPS if path == "kernel" else fallback_eps(dtype)
    for cols in small_cols(dtype):
        wobj, w = make_weight(dtype, ROWS, cols, seed=5 * cols)
        x = torch.randn(cols)
        xd = x.double()
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for idx in index_sets(ROWS):
                wi = w[idx]
                close(wobj.gather_linear(x, idx), wi @ xd, wi.abs() @ xd.abs(), eps)
                h = torch.randn(idx.numel())
                ref, bound = h.double() @ wi, h.double().abs() @ wi.abs()
                close(wobj.gather_axpy(h, idx), ref, bound, eps)
                acc = torch.randn(cols)
                got = wobj.gather_axpy(h, idx, out=acc.clone())
                close(got, ref + acc.double(), bound + acc.double().abs(), eps)
            for T in (1, 3, 12):
                xt = torch.randn(T, cols)
                close(wobj.linear(xt), xt.double() @ w.T, xt.double().abs() @ w.abs().T, eps)
            close(wobj.linear(x), w @ xd, w.abs() @ xd.abs(), eps)
        assert torch.equal(wobj.dequantize().double(), w)
        idx = torch.tensor([4, 1, 4])
        assert torch.equal(wobj.take_rows(idx).dequantize().double(), w[idx])


@pytest.mark.parametrize("dtype", ["f16", "q4_0", "q8_0"])
def test_a_batch_row_sum_is_each_token_own_row_sum(dtype, path, threads, monkeypatch) -> None:
    """A prompt's down pass (``Weight.rows_sum``) over a ReLU FFN's h (most entries exactly 0)
    and over a dense h: with the kernels each token's row is its one-token sum's bits at 1 and 2
    threads (one token streams whole rows, a batch takes ``KernelLibrary.rows_sum``); without
    them torch decodes tiles of rows once for the batch. All are h @ W."""
    wobj, w = make_weight(dtype, 96, 64, seed=3)
    tiled, tiles = [], kernels.KernelLibrary.rows_sum
    monkeypatch.setattr(kernels.KernelLibrary, "rows_sum", lambda *a: tiled.append(1) or tiles(*a))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(16, 96, generator=g).clamp_(min=1.0) - 1.0  # about 84% exact zeros
    dense = torch.randn(16, 96, generator=g)
    eps = 4 * (EPS if path == "kernel" else fallback_eps(dtype))
    for hb in (h, dense):
        torch.set_num_threads(1)
        one = [wobj.rows_sum(hb[t : t + 1])[0] for t in range(16)]
        for nt in (1, 2):
            torch.set_num_threads(nt)
            got = wobj.rows_sum(hb)
            close(got, hb.double() @ w, hb.double().abs() @ w.abs(), eps)
            if path == "kernel":
                assert all(torch.equal(got[t], one[t]) for t in range(16))
        assert tiled == ([1, 1] if path == "kernel" else [])  # the batches; torch: no library
        tiled.clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_glu_rows(dtype, variant, path, threads) -> None:
    eps = 4 * (EPS if path == "kernel" else fallback_eps(dtype))
    cols = small_cols(dtype)[0]
    gobj, g = make_weight(dtype, ROWS, cols, seed=11)
    uobj, u = make_weight(dtype, ROWS, cols, seed=12)
    x = torch.randn(cols)
    xd = x.double()
    for nt in (1, 2):
        torch.set_num_threads(nt)
        for idx in index_sets(ROWS):
            gv, uv = g[idx] @ xd, u[idx] @ xd
            gb, ub = g[idx].abs() @ xd.abs(), u[idx].abs() @ xd.abs()
            bound = gb * uv.abs() + (gv.abs() + gb) * ub
            got = glu_rows(x, gobj, uobj, idx, variant)
            close(got, glu(gv, uv, variant), bound, eps)


def test_glu_rows_errors() -> None:
    wobj, _ = make_weight("f32", 8, 64)
    with pytest.raises(ValueError, match="gelu"):
        glu_rows(torch.randn(64), wobj, wobj, torch.tensor([1]), "gelu")


def test_glu_rows_mixed_dtypes(kernels_on) -> None:
    """Gate and up of different dtypes fall back to two gathers."""
    gobj, g = make_weight("q8_0", ROWS, 64, seed=1)
    uobj, u = make_weight("f16", ROWS, 64, seed=2)
    x, idx = torch.randn(64), torch.tensor([3, 9, 100])
    ref = torch.relu(g[idx] @ x.double()) * (u[idx] @ x.double())
    torch.testing.assert_close(
        glu_rows(x, gobj, uobj, idx, "reglu").double(), ref, rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_and_fallback_agree(dtype, kernels_on) -> None:
    wobj, w = make_weight(dtype, 300, 2048, seed=21)
    x, idx = torch.randn(2048), torch.randperm(300)[:150]
    h = torch.randn(150)
    kern = (wobj.gather_linear(x, idx), wobj.gather_axpy(h, idx), wobj.linear(x[None]))
    with numerics.using(Numerics(native=False)):
        fb = (wobj.gather_linear(x, idx), wobj.gather_axpy(h, idx), wobj.linear(x[None]))
    eps = fallback_eps(dtype) + EPS
    wi = w[idx]
    close(kern[0], fb[0].double(), wi.abs() @ x.double().abs(), eps)
    close(kern[1], fb[1].double(), h.double().abs() @ wi.abs(), eps)
    close(kern[2], fb[2].double(), x.double().abs() @ w.abs().T, eps)


def test_quant_kernel_equals_dequantize_then_f32(kernels_on) -> None:
    """Quantized kernels match f32 math on the dequantized matrix within fp32 rounding."""
    for dtype in QUANTS:
        wobj, _ = make_weight(dtype, ROWS, 2048, seed=31)
        deq = wobj.dequantize()  # (rows, cols) f32, exact
        x, idx = torch.randn(2048), torch.randperm(ROWS)[:64]
        h = torch.randn(64)
        f32_gemv = torch.nn.functional.linear(x[None], deq[idx])[0]
        close(wobj.gather_linear(x, idx), f32_gemv.double(), deq[idx].abs() @ x.abs(), 1e-5)
        f32_axpy = h @ deq[idx]
        close(wobj.gather_axpy(h, idx), f32_axpy.double(), h.abs() @ deq[idx].abs(), 1e-5)


@pytest.mark.parametrize("dtype", QUANTS)
def test_torch_dequantize_matches_oracle(dtype) -> None:
    cols = small_cols(dtype)[1]
    wobj, w = make_weight(dtype, 17, cols)
    got = weights.dequantize_rows_torch(wobj.raw, wobj.ggml_type, cols)
    assert torch.equal(got.double(), w)


# ---- build, cache and fallback -----------------------------------------------------------------


def test_build_failure_raises(tmp_path: Path) -> None:
    if kernels.find_compiler() is None:
        pytest.skip("no C++ compiler")
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    with pytest.raises(kernels.KernelBuildError, match="failed"):
        kernels.build(source=bad, cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.suffix in (".so", ".tmp")]


def test_a_compiler_without_lto_builds_without_it(tmp_path: Path, caplog) -> None:
    """-flto is the default; a compiler or linker that refuses it (clang without its LTO
    plugin) gets the same library built without it, with one warning, not the torch fallback."""
    real = kernels.find_compiler()
    if real is None:
        pytest.skip("no C++ compiler")
    cxx = tmp_path / "no-lto-c++"
    cxx.write_text(
        '#!/bin/sh\nfor a in "$@"; do case "$a" in -flto*) echo "no LTO plugin" >&2; exit 1;; '
        f'esac; done\nexec {real} "$@"\n'
    )
    cxx.chmod(0o755)
    src = tmp_path / "k.cpp"
    src.write_text('extern "C" int g() { return 7; }\n')
    with caplog.at_level(logging.WARNING, logger="powerpy.model.kernels"):
        lib = kernels.compile_library(src, ("-O0", "-shared", "-fPIC", "-flto"), tmp_path, str(cxx))
    assert ctypes.CDLL(str(lib)).g() == 7
    assert [r for r in caplog.records if "without it" in r.getMessage()]
    with pytest.raises(kernels.KernelBuildError):  # other failures still fail
        kernels.compile_library(
            src, ("-O0", "-shared", "-fPIC", "-no-such-flag"), tmp_path, str(cxx)
        )


def test_no_compiler(tmp_path: Path) -> None:
    with pytest.raises(kernels.KernelBuildError):
        kernels.build(cache_dir=tmp_path, compiler=str(tmp_path / "no-such-g++"))


def test_fallback_logged_once(monkeypatch, caplog) -> None:
    def fail(*a, **k):
        raise kernels.KernelBuildError("simulated")

    monkeypatch.setattr(kernels, "build", fail)
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setattr(kernels, "_failure", None)
    with caplog.at_level(logging.WARNING, logger="powerpy.model.kernels"):
        assert not kernels.available()
        assert not kernels.available()
        wobj, w = make_weight("f16", 20, 64)
        x = torch.randn(64)
        close(
            wobj.gather_linear(x, torch.tensor([1, 2])),
            w[[1, 2]] @ x.double(),
            w[[1, 2]].abs() @ x.double().abs(),
            2e-3,
        )
    assert sum("simulated" in r.getMessage() for r in caplog.records) == 1


def test_numerics_turn_the_kernels_off_for_their_call_only() -> None:
    if not kernels.available():
        pytest.skip("native kernels unavailable")
    with numerics.using(Numerics(native=False)):
        assert kernels.library() is None and kernels.available()
    assert kernels.library() is not None


def test_library_codes_are_checked(monkeypatch) -> None:
    """A library whose dtype codes or decode layer record differ from Python's is refused."""
    lib = kernels.library()
    if lib is None:
        pytest.skip("native kernels unavailable")
    kernels.KernelLibrary(lib.path)  # the codes agree
    monkeypatch.setitem(kernels.DTYPE_CODES, GGMLType.Q4_0, 99)
    with pytest.raises(kernels.KernelBuildError, match="Q4_0"):
        kernels.KernelLibrary(lib.path)
    monkeypatch.undo()
    monkeypatch.setitem(kernels.RECORD_FLAGS, "new", 256)
    with pytest.raises(kernels.KernelBuildError, match="field flag.new: not there in the library"):
        kernels.KernelLibrary(lib.path)
    monkeypatch.undo()
    monkeypatch.setitem(kernels.VARIANTS, FFNVariant.GELU, 6)
    with pytest.raises(kernels.KernelBuildError, match="field variant.gelu: code 5 in the library"):
        kernels.KernelLibrary(lib.path)
    monkeypatch.undo()

    class Longer(ctypes.Structure):  # one more field at the end
        _fields_ = [*kernels.LayerRecord._fields_, ("more", ctypes.c_int64)]

    monkeypatch.setattr(kernels, "LayerRecord", Longer)
    with pytest.raises(kernels.KernelBuildError, match="field more: not there in the library"):
        kernels.KernelLibrary(lib.path)


def test_a_record_field_at_another_offset_is_refused(monkeypatch) -> None:
    """The load-time check compares every field of kernel_abi.LayerRecord by name with the
    library's table (csrc/layer_record.h): a ctypes mirror whose field sits elsewhere, or whose
    sub-record's member does, or which is longer, is refused, naming that field."""
    lib = kernels.library()
    if lib is None:
        pytest.skip("native kernels unavailable")
    from powerpy.model import kernel_abi

    def mirror(swap: tuple[str, str], of=kernel_abi.LayerRecord) -> type[ctypes.Structure]:
        f = list(of._fields_)
        names = [n for n, _ in f]
        i, j = names.index(swap[0]), names.index(swap[1])
        f[i], f[j] = f[j], f[i]
        return type("Mirror", (ctypes.Structure,), {"_fields_": f})

    swapped = mirror(("scale", "softcap"))  # the same size, the two f32 swapped
    assert ctypes.sizeof(swapped) == ctypes.sizeof(kernel_abi.LayerRecord)
    monkeypatch.setattr(kernels, "LayerRecord", swapped)
    with pytest.raises(
        kernels.KernelBuildError,
        match=r"field softcap: offset 512, size 4 in the library, offset 504, size 4 in kernel_abi",
    ):
        kernels.KernelLibrary(lib.path)
    route = mirror(("groups", "used"), kernel_abi.RecRoute)  # a sub-record's members swapped
    fields = [(n, route if n == "route" else t) for n, t in kernel_abi.LayerRecord._fields_]
    rec = type("Mirror", (ctypes.Structure,), {"_fields_": fields})
    monkeypatch.setattr(kernels, "LayerRecord", rec)
    with pytest.raises(kernels.KernelBuildError, match=r"field route\.used: offset 728, size 8 in"):
        kernels.KernelLibrary(lib.path)
    assert lib.cdll.pp_layer_record_len() == ctypes.sizeof(kernel_abi.LayerRecord) == 111 * 8


def test_editing_a_header_rebuilds(tmp_path: Path) -> None:
    """The cache key hashes every file next to the source (the unity build's headers)."""
    if kernels.find_compiler() is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "src"
    src.mkdir()
    main = src / "k.cpp"
    main.write_text('#include "k.h"\nextern "C" int g() { return f(); }\n')
    (src / "k.h").write_text("inline int f() { return 1; }\n")
    flags = ("-O0", "-shared", "-fPIC")
    first = kernels.compile_library(main, flags, tmp_path / "cache")
    assert kernels.compile_library(main, flags, tmp_path / "cache") == first  # cached
    (src / "k.h").write_text("inline int f() { return 2; }\n")
    second = kernels.compile_library(main, flags, tmp_path / "cache")
    assert second != first and second.exists()


def test_concurrent_builds_share_one_file(tmp_path: Path) -> None:
    """Two builders of the same library: one compiles, the other waits and loads the result."""
    if kernels.find_compiler() is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a compiler on x86-64")
    flags = _VARIANT_FLAGS["scalar"][1:]  # -O0 default: fast to compile
    libs: list[kernels.KernelLibrary] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            libs.append(kernels.build(flags=flags, cache_dir=tmp_path))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert len({lib.path for lib in libs}) == 1
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".so"] == [libs[0].path.name]


# ---- powerpy.testing.synthetic ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "q4_0"])
def test_synthetic_model(tmp_path: Path, dtype: str) -> None:
    from powerpy.formats.gguf_reader import read_gguf
    from powerpy.testing import synthetic as tool

    out = tmp_path / "m" / "model.powerinfer.gguf"
    tool.write_synthetic_model(out, "tiny", dtype, powerlaw=True, layers=2, predictor_noise=0)
    s = tool.SHAPES["tiny"]
    with read_gguf(out) as gf:
        assert gf.sparse
        assert gf.kv["llama.block_count"] == 2 and gf.kv["llama.feed_forward_length"] == s.n_ff
        assert len(gf.kv["tokenizer.ggml.tokens"]) == s.n_vocab
        expect = GGMLType.Q4_0 if dtype == "q4_0" else GGMLType.F32
        for name in ("blk.1.ffn_gate.weight", "blk.1.ffn_down_t.weight", "blk.1.fc2.weight"):
            assert gf.tensors[name].ggml_type == expect
        assert tuple(gf.tensors["blk.0.ffn_down_t.weight"].shape) == (s.n_ff, s.n_embd)
        assert tuple(gf.tensors["blk.0.fc1.weight"].shape) == (s.hidden, s.n_embd)
        gate = torch.from_numpy(np.array(gf.dequantize("blk.1.ffn_gate.weight")))
        fc1 = torch.from_numpy(np.array(gf.dequantize("blk.1.fc1.weight")))
        fc2 = torch.from_numpy(np.array(gf.dequantize("blk.1.fc2.weight")))
    stats = [torch.load(out.parent / "activation" / f"activation_{i}.pt") for i in range(2)]
    assert all(st.shape == (s.n_ff,) and abs(float(st.mean()) - 0.1) < 1e-3 for st in stats)
    # With --predictor-noise 0 the predictor is the gate's sign: logit_j >= 0 iff gate_j·x >= 0
    # for any state whose constant dimension 0 is C.
    x = torch.randn(64, s.n_embd)
    x[:, 0] = tool.C
    logits = torch.relu(x @ fc1.T) @ fc2.T
    g = x @ gate.T
    agree = ((logits >= 0) == (g >= 0)).float().mean()
    assert agree > (0.999 if dtype == "f32" else 0.95), agree


def test_scratch_rows_work_in_and_out_of_inference_mode() -> None:
    from powerpy.model.matrices import _scratch, _scratch_rows

    _scratch.__dict__.clear()
    src, idx = torch.randn(64, 16), torch.tensor([3, 9, 40])
    with torch.inference_mode():  # generation allocates the reused buffer first
        torch.index_select(src, 0, idx, out=_scratch_rows(3, 16, torch.float32))
    out = _scratch_rows(3, 16, torch.float32)  # then a notebook, outside inference mode
    rows = torch.index_select(src, 0, idx, out=out)
    torch.testing.assert_close(rows, src[idx])


def test_a_layer_record_puts_each_name_in_its_field() -> None:
    """``layer_record.Part`` names what it puts by the file's tensor names or the record's own
    paths; ``record`` writes each at its place (the old int64 slots: byte offset / 8), and a name
    the record lacks is refused."""
    from powerpy.model import layer_record

    p = layer_record.Part(lib=None, flags=kernels.RECORD_FLAGS["rope"])
    w = kernels.Matrix.of_dense(torch.zeros(3, 4))
    p.matrix("ffn_gate", w)
    p.matrix("attn_v_b", w)
    p.set("attn_q.bias", 1234)
    p.set("moe.scale", 0.5)
    p.set("softcap", 30.0)
    p.set("mla.d_v", 7)
    with pytest.raises(KeyError, match="nope"):
        p.set("nope", 1)
    with pytest.raises(KeyError, match="moe.nope"):
        p.set("moe.nope", 1)
    q = layer_record.Part(lib=None, flags=kernels.RECORD_FLAGS["moe"])
    q.set("route", kernels.RecRoute(gating=2, groups=8))
    rec = layer_record.record(p, q)
    slots = np.frombuffer(bytes(rec), dtype=np.int64)
    assert slots.size == 111
    assert list(slots[30:35]) == list(w.args)  # ffn_gate: the FFN's third matrix, slot 20 + 10
    assert list(slots[102:107]) == list(w.args) and slots[109] == 7  # the latent's v_b and d_v
    assert slots[53] == 1234 and slots[60] == 2 | 64  # attn_q's bias; the flags OR-ed
    assert slots[67] == np.array([0.5], np.float32).view(np.uint32)[0]  # f32 bits, pad zero
    assert slots[64] == np.array([30.0], np.float32).view(np.uint32)[0]
    assert slots[88] == 2 and slots[90] == 8
