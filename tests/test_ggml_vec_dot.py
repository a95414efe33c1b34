"""powerpy's dot products against ggml's own, called through the ggml library llama-cpp-python
ships:

- K-quants (llama.cpp's ``vec_dot`` of the weight type): Q4_K, Q5_K and Q6_K rows that ggml's
  quantizer made from random floats, times activations ggml rounded to Q8_K, give the same float
  bits in powerpy's GEMV, GLU and prompt GEMM as in ggml (super-block kernels in ggml's order,
  ``csrc/k_quants_avx2.h``, on AVX2 builds). From 8 tokens on, ggml's ``ggml_mul_mat`` takes
  its tiled K-quant GEMM, whose float steps powerpy's prompt GEMM takes from 8 tokens on too.
- MXFP4 (GPT-OSS's experts) times Q8_0 activations, in ggml's AVX2 order.
- LayerNorm's normalisation (``ggml_norm``), row by row.
- f32 matrices (a MoE router, a shared expert's gate): ``ggml_mul_mat`` in a one-op graph, which
  takes tinyBLAS for some shapes and ``ggml_vec_dot_f32`` for others (one token, fewer than 4
  rows or a multiple of 4, widths off ggml's vector), equals ``ggml_numerics.gemm_f32``."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch
from quant_fixtures import random_blocks

from powerpy.families.base import FFNVariant
from powerpy.formats.constants import TYPE_TRAITS, GGMLType
from powerpy.model import ggml_numerics, interleave, kernels
from powerpy.model.kernels import Matrix

pytestmark = pytest.mark.llama_cpp

FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(
    None,
    ctypes.c_int,
    ctypes.POINTER(ctypes.c_float),
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
)


class _Traits(ctypes.Structure):  # ggml-cpu.h: struct ggml_type_traits_cpu
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


@pytest.fixture(scope="module")
def ggml(llama_cpp):
    lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    ctypes.CDLL(os.path.join(lib, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(os.path.join(lib, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
    cpu.ggml_cpu_init()
    return cpu


def _quantize(traits: _Traits, x: np.ndarray, row_bytes: int) -> np.ndarray:
    out = np.zeros(row_bytes, np.uint8)
    FROM_FLOAT(traits.from_float)(x.ctypes.data, out.ctypes.data, x.size)
    return out


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K])
def test_k_quant_dots_equal_ggmls(ggml, qtype):
    lib = kernels.library()
    if lib is None or lib.simd not in ("AVX2", "AVX-512"):
        pytest.skip("needs the native kernels on an AVX2 (or wider) build")
    rng = np.random.default_rng(int(qtype))
    cols, rows = 1024, 24
    tr = TYPE_TRAITS[qtype]
    rb = cols // tr.block_size * tr.type_size
    traits = ggml.ggml_get_type_traits_cpu(int(qtype)).contents
    act = ggml.ggml_get_type_traits_cpu(traits.vec_dot_type).contents
    w = np.stack(
        [
            _quantize(traits, (rng.standard_normal(cols) * 0.05).astype(np.float32), rb)
            for _ in range(rows)
        ]
    )
    raw = torch.from_numpy(w)
    m = Matrix.of_quant(raw, qtype, cols)
    for scale in (0.01, 1.0, 30.0):
        x = (rng.standard_normal(cols) * scale).astype(np.float32)
        xq = _quantize(act, x, 2 * cols)  # Q8_K: 292 bytes per 256 values
        want = np.zeros(rows, np.float32)
        for r in range(rows):
            s = ctypes.c_float()
            VEC_DOT(traits.vec_dot)(
                cols, ctypes.byref(s), 0, w[r].ctypes.data, 0, xq.ctypes.data, 0, 1
            )
            want[r] = s.value
        got = lib.gather_gemv(m, torch.from_numpy(x), torch.arange(rows)).numpy()
        assert got.tobytes() == want.tobytes(), (qtype.name, scale, got[:4], want[:4])
        # a prompt's GEMM: every token's row sums in the same order (tiles of 4, 3, 2, 1)
        xs = np.stack([x * (1 + 0.1 * t) for t in range(7)])
        want_t = np.zeros((7, rows), np.float32)
        for t in range(7):
            xq_t = _quantize(act, xs[t], 2 * cols)
            for r in range(rows):
                s = ctypes.c_float()
                VEC_DOT(traits.vec_dot)(
                    cols, ctypes.byref(s), 0, w[r].ctypes.data, 0, xq_t.ctypes.data, 0, 1
                )
                want_t[t, r] = s.value
        assert lib.gemm(m, torch.from_numpy(xs)).numpy().tobytes() == want_t.tobytes()
        # GLU: gate and up rows through the same dot (ReGLU: relu(g) * u, exact in f32)
        half = rows // 2
        gate = Matrix.of_quant(raw[:half], qtype, cols)
        up = Matrix.of_quant(raw[half:], qtype, cols)
        h = lib.glu(gate, up, torch.from_numpy(x), torch.arange(half), FFNVariant.REGLU).numpy()
        expect = np.maximum(want[:half], 0) * want[half:]
        assert h.tobytes() == expect.astype(np.float32).tobytes()


@pytest.mark.parametrize("cols", [1024, 1440])  # an even and an odd number of blocks
def test_mxfp4_dots_equal_ggmls(ggml, cols):
    """MXFP4 rows (GPT-OSS's experts) that ggml's quantizer made, times activations ggml rounded
    to Q8_0: the same bits in powerpy's GEMV, row gather, GLU and prompt GEMM as ggml's
    ``ggml_vec_dot_mxfp4_q8_0`` (csrc/mxfp4.h sums in its order)."""
    lib = kernels.library()
    if lib is None:
        pytest.skip("needs the native kernels")
    rng = np.random.default_rng(cols)
    rows, t = 24, GGMLType.MXFP4
    rb = cols // 32 * TYPE_TRAITS[t].type_size
    traits = ggml.ggml_get_type_traits_cpu(int(t)).contents
    act = ggml.ggml_get_type_traits_cpu(traits.vec_dot_type).contents
    assert traits.vec_dot_type == int(GGMLType.Q8_0)
    w = np.stack(
        [
            _quantize(traits, (rng.standard_normal(cols) * 0.05).astype(np.float32), rb)
            for _ in range(rows)
        ]
    )
    raw = torch.from_numpy(w)
    m = Matrix.of_quant(raw, t, cols)

    def ggml_dots(x: np.ndarray) -> np.ndarray:
        xq = _quantize(act, x, cols // 32 * 34)
        out = np.zeros(rows, np.float32)
        for r in range(rows):
            s = ctypes.c_float()
            VEC_DOT(traits.vec_dot)(
                cols, ctypes.byref(s), 0, w[r].ctypes.data, 0, xq.ctypes.data, 0, 1
            )
            out[r] = s.value
        return out

    for scale in (0.01, 1.0, 30.0):
        x = (rng.standard_normal(cols) * scale).astype(np.float32)
        want = ggml_dots(x)
        assert lib.gather_gemv(m, torch.from_numpy(x), None).numpy().tobytes() == want.tobytes()
        idx = torch.tensor([5, 0, 23, 5])
        got = lib.gather_gemv(m, torch.from_numpy(x), idx).numpy()
        assert got.tobytes() == want[idx.numpy()].tobytes()
        xs = np.stack([x * (1 + 0.1 * k) for k in range(7)])
        want_t = np.stack([ggml_dots(xk) for xk in xs])
        assert lib.gemm(m, torch.from_numpy(xs)).numpy().tobytes() == want_t.tobytes()
        half = rows // 2
        gate, up = Matrix.of_quant(raw[:half], t, cols), Matrix.of_quant(raw[half:], t, cols)
        h = lib.glu(gate, up, torch.from_numpy(x), torch.arange(half), FFNVariant.REGLU).numpy()
        assert h.tobytes() == (np.maximum(want[:half], 0) * want[half:]).tobytes()


class _InitParams(ctypes.Structure):  # ggml.h: struct ggml_init_params
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


def _ggml_op(ggml, inputs: list[np.ndarray], op) -> np.ndarray:
    """One ggml op in a graph on 2 threads: f32 ``inputs`` (a 1-D array as a 1-D tensor, as a
    GGUF vector; 2-D (rows, n) as ggml's (n, rows)), ``op(base, ctx, *tensors)`` -> the op's
    tensor, read back as f32 (its element count)."""
    base = ctypes.CDLL(os.path.join(os.path.dirname(ggml._name), "libggml-base.so"))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for name, args, res in (
        ("ggml_init", [_InitParams], vp),
        ("ggml_new_tensor_1d", [vp, ctypes.c_int, i64], vp),
        ("ggml_new_tensor_2d", [vp, ctypes.c_int, i64, i64], vp),
        ("ggml_mul_mat", [vp] * 3, vp),
        ("ggml_norm", [vp, vp, ctypes.c_float], vp),
        ("ggml_new_graph", [vp], vp),
        ("ggml_build_forward_expand", [vp, vp], None),
        ("ggml_get_data", [vp], vp),
        ("ggml_nelements", [vp], i64),
        ("ggml_free", [vp], None),
    ):
        getattr(base, name).argtypes, getattr(base, name).restype = args, res
    ggml.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    ctx = base.ggml_init(_InitParams(16 << 20, None, False))
    ts = []
    for a in inputs:
        a = np.ascontiguousarray(a, np.float32)
        if a.ndim == 1:
            t = base.ggml_new_tensor_1d(ctx, 0, a.shape[0])
        else:
            t = base.ggml_new_tensor_2d(ctx, 0, a.shape[1], a.shape[0])
        ctypes.memmove(base.ggml_get_data(t), a.ctypes.data, a.nbytes)
        ts.append(t)
    c = op(base, ctx, *ts)
    gf = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(gf, c)
    ggml.ggml_graph_compute_with_ctx(ctx, gf, 2)
    out = (ctypes.c_float * base.ggml_nelements(c)).from_address(base.ggml_get_data(c))
    y = np.ctypeslib.as_array(out).copy()
    base.ggml_free(ctx)
    return y


def _ggml_mul_mat(ggml, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """ggml_mul_mat(w, x): w (rows, cols) f32 (one row: a 1-D tensor), x (T, cols) -> (T,
    rows)."""
    wa = w.numpy()[0] if w.shape[0] == 1 else w.numpy()
    y = _ggml_op(ggml, [wa, x.numpy()], lambda base, ctx, a, b: base.ggml_mul_mat(ctx, a, b))
    return torch.from_numpy(y).view(x.shape[0], w.shape[0])


def test_f32_matmul_orders_equal_ggmls(ggml):
    lib = kernels.library()
    if lib is None or lib.simd not in ("AVX2", "AVX-512"):
        pytest.skip("needs the native kernels on an AVX2 (or wider) build")
    g = torch.Generator().manual_seed(3)
    differ = 0
    for rows in (1, 3, 4, 8, 60):  # a shared expert's gate row; routers of 3 to 60 experts
        for cols in (64, 72, 100, 256):
            for T in (1, 2, 5):
                w, x = torch.randn(rows, cols, generator=g), torch.randn(T, cols, generator=g)
                got = ggml_numerics.gemm_f32(lib.cdll, w, x)
                want = _ggml_mul_mat(ggml, w, x)
                assert torch.equal(got, want), (rows, cols, T)
                differ += not torch.equal(got, x @ w.T)
    assert differ > 10  # the order matters: torch's sums differ in most cases


def _ggml_quant_mul_mat(ggml, raw: np.ndarray, qtype: GGMLType, x: np.ndarray) -> np.ndarray:
    """ggml_mul_mat(W, x) in a one-op graph: W the raw blocks (rows, row_bytes) of a quantized
    matrix, x (T, cols) f32 -> (T, rows)."""
    cols = x.shape[1]

    def op(base, ctx, xt):
        w = base.ggml_new_tensor_2d(ctx, int(qtype), cols, raw.shape[0])
        ctypes.memmove(base.ggml_get_data(w), raw.ctypes.data, raw.nbytes)
        return base.ggml_mul_mat(ctx, w, xt)

    return _ggml_op(ggml, [x], op).reshape(x.shape[0], raw.shape[0])


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K])
def test_k_quant_matmuls_equal_ggmls(ggml, qtype):
    """Every token count of a K-quant matrix's product: vec_dot's order under 8 tokens, the
    tiled GEMM's from 8 (one integer sum per super-block, scaled by d, less dmin times the
    mins' sum, times d_x into the accumulator)."""
    lib = kernels.library()
    if lib is None or lib.simd not in ("AVX2", "AVX-512"):
        pytest.skip("needs the native kernels on an AVX2 (or wider) build")
    rng = np.random.default_rng(int(qtype) + 40)
    cols, rows = 768, 40
    raw = np.ascontiguousarray(random_blocks(rng, qtype, rows, cols // 256))
    m = Matrix.of_quant(torch.from_numpy(raw), qtype, cols)
    for T in (1, 3, 7, 8, 21):
        x = (rng.standard_normal((T, cols)) * 2).astype(np.float32)
        want = _ggml_quant_mul_mat(ggml, raw, qtype, x)
        got = lib.gemm(m, torch.from_numpy(x)).numpy()
        assert got.tobytes() == want.tobytes(), (qtype.name, T, np.abs(got - want).max())


def test_row_layout_q4_0_matmuls_equal_ggmls(ggml):
    """A Q4_0 matrix that keeps its rows (not 8k rows, as a tiny vocabulary's output head) at
    every token count: ggml's vec_dot order, block after block into 8 lanes, which llama.cpp's
    AVX-512 build keeps too (a four-block AVX-512 kernel summing 16 lanes failed this)."""
    lib = kernels.library()
    if lib is None or lib.simd not in ("AVX2", "AVX-512"):
        pytest.skip("needs the native kernels on an AVX2 (or wider) build")
    rng = np.random.default_rng(61)
    for cols, rows in ((256, 259), (96, 13), (1056, 21)):  # 8, 3 and 33 blocks a row
        raw = np.ascontiguousarray(random_blocks(rng, GGMLType.Q4_0, rows, cols // 32))
        m = Matrix.of_quant(torch.from_numpy(raw), GGMLType.Q4_0, cols)
        for T in (1, 3, 4, 8, 21):
            x = (rng.standard_normal((T, cols)) * 2).astype(np.float32)
            want = _ggml_quant_mul_mat(ggml, raw, GGMLType.Q4_0, x)
            got = lib.gemm(m, torch.from_numpy(x)).numpy()
            assert got.tobytes() == want.tobytes(), (cols, T, np.abs(got - want).max())


def _ggml_repacked_mul_mat(ggml, raw: np.ndarray, qtype: GGMLType, x: np.ndarray) -> np.ndarray:
    """ggml_mul_mat(W, x) with W in llama.cpp's CPU repack buffer (what a model's Q4_0 and Q4_K
    matrices of 8k rows get at load): x (T, cols) f32 -> (T, rows)."""
    base = ctypes.CDLL(os.path.join(os.path.dirname(ggml._name), "libggml-base.so"))
    vp, i64, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
    for name, args, res in (
        ("ggml_init", [_InitParams], vp),
        ("ggml_new_tensor_2d", [vp, ctypes.c_int, i64, i64], vp),
        ("ggml_backend_alloc_ctx_tensors_from_buft", [vp, vp], vp),
        ("ggml_backend_tensor_set", [vp, vp, sz, sz], None),
        ("ggml_backend_buffer_free", [vp], None),
        ("ggml_free", [vp], None),
    ):
        getattr(base, name).argtypes, getattr(base, name).restype = args, res
    repack = ggml._Z35ggml_backend_cpu_repack_buffer_typev  # ggml_backend_cpu_repack_buffer_type
    repack.restype = vp
    wctx = base.ggml_init(_InitParams(1 << 20, None, True))
    w = base.ggml_new_tensor_2d(wctx, int(qtype), x.shape[1], raw.shape[0])
    buf = base.ggml_backend_alloc_ctx_tensors_from_buft(wctx, repack())
    base.ggml_backend_tensor_set(w, raw.ctypes.data, 0, raw.nbytes)  # repacks
    try:
        y = _ggml_op(ggml, [x], lambda base, ctx, xt: base.ggml_mul_mat(ctx, w, xt))
    finally:
        base.ggml_backend_buffer_free(buf)
        base.ggml_free(wctx)
    return y.reshape(x.shape[0], raw.shape[0])


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.MXFP4])
def test_interleaved_matmuls_equal_ggmls_repacked(ggml, qtype):
    """A Q4_0, Q4_K or MXFP4 matrix of 8k rows, interleaved (``interleave``), against
    llama.cpp's repacked kernels at every token count: the same bits (Q4_0 and MXFP4: one FMA
    per block of each row and token; Q4_K: the GEMM's order 4 tokens at a time, the GEMV's for
    the rest). The row layout's products differ from them."""
    lib = kernels.library()
    if lib is None or lib.simd not in ("AVX2", "AVX-512"):
        pytest.skip("needs the native kernels on an AVX2 (or wider) build")
    rng = np.random.default_rng(int(qtype) + 50)
    cols, rows = (768, 40) if qtype == GGMLType.Q4_K else (512, 40)
    qk = 256 if qtype == GGMLType.Q4_K else 32
    raw = np.ascontiguousarray(random_blocks(rng, qtype, rows, cols // qk))
    m = interleave.interleaved(lib, Matrix.of_quant(torch.from_numpy(raw.copy()), qtype, cols))
    assert m is not None and m.code in interleave.STACKS
    rows_layout = Matrix.of_quant(torch.from_numpy(raw), qtype, cols)
    for T in (1, 3, 4, 7, 8, 21):
        x = (rng.standard_normal((T, cols)) * 2).astype(np.float32)
        want = _ggml_repacked_mul_mat(ggml, raw, qtype, x)
        got = lib.gemm(m, torch.from_numpy(x)).numpy()
        assert got.tobytes() == want.tobytes(), (qtype.name, T, np.abs(got - want).max())
        assert lib.gemm(rows_layout, torch.from_numpy(x)).numpy().tobytes() != want.tobytes()


def test_gathered_q4_0_rows_equal_ggmls_repacked(ggml):
    """Q4_0 rows in the file's layout, gathered (a sparse step's gate and up) or masked by need
    (a sparse prompt), in any order and at any token count: the bits of llama.cpp's repacked
    product, row by row, as the interleaved matrix gives them (a group of 8 rows is built in
    registers). A whole-matrix product of the row layout keeps ggml's row order."""
    lib = kernels.library()
    if lib is None or lib.simd not in ("AVX2", "AVX-512"):
        pytest.skip("needs the native kernels on an AVX2 (or wider) build")
    rng = np.random.default_rng(77)
    cols, rows = 512, 40
    raw = np.ascontiguousarray(random_blocks(rng, GGMLType.Q4_0, rows, cols // 32))
    m = Matrix.of_quant(torch.from_numpy(raw), GGMLType.Q4_0, cols)
    half = rows // 2
    gate = Matrix.of_quant(torch.from_numpy(raw[:half].copy()), GGMLType.Q4_0, cols)
    up = Matrix.of_quant(torch.from_numpy(raw[half:].copy()), GGMLType.Q4_0, cols)
    for T in (1, 3, 4, 7):
        x = (rng.standard_normal((T, cols)) * 2).astype(np.float32)
        want = _ggml_repacked_mul_mat(ggml, raw, GGMLType.Q4_0, x)  # (T, rows)
        for n in (1, 5, 8, 9, 17, rows):  # a partial last group, one group, several
            idx = torch.from_numpy(rng.permutation(rows)[:n].astype(np.int64))
            got = lib.gather_gemv(m, torch.from_numpy(x[0]), idx).numpy()
            assert got.tobytes() == want[0, idx.numpy()].tobytes(), n
            need = torch.zeros(T, rows, dtype=torch.uint8)
            for t in range(0, T, 2):  # some tokens need a few of the rows, the last all
                need[t, idx[: max(1, n // 2)]] = 1
            need[T - 1, idx] = 1
            out = torch.full((T, rows), float("nan"))  # what the product does not need: 0
            prompt = lib.gemm(m, torch.from_numpy(x), out=out, need=need).numpy()
            mask = need.numpy().astype(bool)
            assert prompt[mask].tobytes() == want[mask].tobytes(), (T, n)
            assert np.isfinite(prompt).all()
        j = torch.from_numpy(rng.permutation(half)[:11].astype(np.int64))
        h = lib.glu(gate, up, torch.from_numpy(x[0]), j, FFNVariant.REGLU).numpy()
        expect = np.maximum(want[0, j.numpy()], 0) * want[0, half + j.numpy()]
        assert h.tobytes() == expect.astype(np.float32).tobytes()
    whole = lib.gather_gemv(m, torch.from_numpy(x[0]), None).numpy()
    assert whole.tobytes() != want[0].tobytes()  # ggml's vec_dot order, as llama.cpp's rows


def test_layer_norm_equals_ggmls(ggml):
    """LayerNorm (``ggml_norm``, before its weight and bias): each square of the variance's sum
    rounded before the lane sums. With GCC's fused multiply-add in that sum, rows of a
    StableLM prompt differed from llama.cpp's by an ulp of the scale."""
    lib = kernels.library()
    if lib is None or lib.simd not in ("AVX2", "AVX-512"):
        pytest.skip("needs the native kernels on an AVX2 (or wider) build")
    g = np.random.default_rng(5)
    for n in (64, 72, 2048):
        x = (g.standard_normal((200, n)) * g.uniform(0.1, 10.0, (200, 1))).astype(np.float32)
        want = _ggml_op(ggml, [x], lambda base, ctx, t: base.ggml_norm(ctx, t, 1e-5))
        got = ggml_numerics.layer_norm(lib.cdll, torch.from_numpy(x), torch.ones(n), None, 1e-5)
        assert np.array_equal(got.numpy().reshape(-1), want), n
