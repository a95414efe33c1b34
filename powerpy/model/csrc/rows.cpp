// One token's products over matrix rows: gathered GEMV, gate/up GLU, row sums (axpy), and
// dequantized and interleaved rows, for every weight type (the predictor-gated sparse FFN and the
// dense one); the products of a Mat that the decode blocks call (mat.h). A prompt's: gemm.cpp.
//
// Built by powerpy/model/kernel_build.py with `g++ -O3 -march=native -fopenmp -shared` and called
// through ctypes with tensor data pointers. Everything exported is extern "C" (this file); no torch
// headers. One translation unit: every header of csrc/ includes what it uses (#pragma once), and
// the build's cache key hashes every file of csrc/.
//
// Matrices are row-major (nrows, cols) with a row stride of `ld` bytes; FFN matrices are
// neuron-major (n_ff, n_embd), so a sparse FFN reads whole rows. A row is processed in
// 32-element chunks, decoded in registers: decoded values equal the dequantized weights exactly
// (q * d is exact in f32), and all accumulation is f32. Dot products with quantized weights
// round x as llama.cpp does (Q8_0 / Q8_1 / Q8_K blocks) and take integer block sums, unless the
// caller asks for f32 activations. Row sums (axpy) decode the weights to f32 and add four rows
// per pass.
//
// The main speed lever is a software prefetch of the row `dist` indices ahead into L2, spread
// over the current row's loop (docs/kernels.md#prefetch); `dist` covers at least
// PREFETCH_BYTES (a build constant, common.h) and is at least 2 rows.
//
// SIMD is chosen at compile time (simd.h): AVX-512F (16 lanes), AVX2+FMA+F16C (8 lanes), or
// scalar. Return codes: 0 ok, 1 an index was out of range (that output is NaN / that row skipped),
// 2 bad argument (unknown dtype or variant, cols not a multiple of the block size).

#include "mat.h"  // every kernel, and Mat: a matrix as Python describes it

// ---- the products of a Mat (mat.h) ---------------------------------------------------------

// An interleaved matrix takes whole-matrix products only: every row, in order.
static int x8_gemv(const Mat& m, const float* x, const int64_t* idx, int64_t k, float* out,
                   int act, int nt) {
  if (idx || k != m.nrows) return PP_ERR_ARG;
  return x8_layout(m.dtype, [&](auto X) {
    return x8_gemm<decltype(X)>(m.w, m.nrows, m.cols, x, m.cols, 1, out, m.nrows, act, nt, true);
  });
}

int mat_gemv(const Mat& m, const float* x, const int64_t* idx, int64_t k, float* out,
                    int act, int nt) {
  if (m.dtype == DT_MXFP4)
    return mx_gemm(m.w, m.ld, m.nrows, m.cols, x, 0, 1, idx, k, out, 0, act, nt);
  if (is_x8(m.dtype)) return x8_gemv(m, x, idx, k, out, act, nt);
  if (!valid_shape(m.dtype, m.cols)) return PP_ERR_ARG;
  if (idx && rows_as_x8(m.dtype, act))
    return x8_rows_gemv<X8Q40>(m.w, m.ld, m.nrows, m.cols, x, idx, k, out, act, nt);
  PP_DISPATCH(m.dtype, gemv_impl, m.w, m.ld, m.nrows, m.cols, x, idx, k, out, act, nt)
}

// out[i] = m[i] x for matrices of one type and width (see gemv_multi_impl).
int mat_gemv_multi(const Mat* m, int nm, const float* x, float* const* out, int act,
                          int nt) {
  const uint8_t* w[4];
  int64_t ld[4], nrows[4];
  if (nm < 1 || nm > 4) return PP_ERR_ARG;
  if (m[0].dtype == DT_MXFP4) {  // one matrix at a time
    int st = 0;
    for (int i = 0; i < nm && !st; ++i) st = mat_gemv(m[i], x, nullptr, m[i].nrows, out[i], act, nt);
    return st;
  }
  for (int i = 0; i < nm; ++i) {
    if (m[i].dtype != m[0].dtype || m[i].cols != m[0].cols) return PP_ERR_ARG;
    w[i] = m[i].w;
    ld[i] = m[i].ld;
    nrows[i] = m[i].nrows;
  }
  if (is_x8(m[0].dtype))
    return x8_layout(m[0].dtype, [&](auto X) {
      return x8_gemv_multi<decltype(X)>(w, nrows, nm, m[0].cols, x, out, act, nt);
    });
  if (!valid_shape(m[0].dtype, m[0].cols)) return PP_ERR_ARG;
  PP_DISPATCH(m[0].dtype, gemv_multi_impl, w, ld, nrows, nm, m[0].cols, x, out, act, nt)
}

// Every row's act(gate . x, up . x) for interleaved gate and up matrices.
static int x8_glu(const Mat& g, const Mat& u, const float* x, const int64_t* idx, int64_t k,
                  int variant, float* out, int act, int nt) {
  if (g.dtype != u.dtype || g.nrows != u.nrows || g.cols != u.cols) return PP_ERR_ARG;
  float* gv = (float*)std::malloc(sizeof(float) * (size_t)(k > 0 ? k : 1));
  if (!gv) return PP_ERR_ARG;
  int st = mat_gemv(g, x, idx, k, gv, act, nt);  // (an MXFP4 GLU's too)
  if (!st) st = mat_gemv(u, x, idx, k, out, act, nt);
  const uint16_t* gt = variant == V_GEGLU ? gelu_lut(act) : nullptr;
  for (int64_t j = 0; j < k && !st; ++j) out[j] = activate(variant, gv[j], out[j], gt);
  std::free(gv);
  return st;
}

int mat_glu(const Mat& g, const Mat& u, const float* x, const int64_t* idx, int64_t k,
                   int variant, float* out, int act, int nt) {
  if (is_x8(u.dtype) || u.dtype == DT_MXFP4) return x8_glu(g, u, x, idx, k, variant, out, act, nt);
  if (!valid_shape(u.dtype, u.cols) || g.dtype != u.dtype) return PP_ERR_ARG;
  if (idx && rows_as_x8(u.dtype, act))
    return x8_rows_glu<X8Q40>(g.w, g.ld, u.w, u.ld, u.nrows, u.cols, x, idx, k, variant, out, act,
                              nt);
  PP_DISPATCH(u.dtype, glu_impl, g.w, g.ld, u.w, u.ld, u.nrows, u.cols, x, idx, k, variant, out,
              act, nt)
}

int mat_axpy(const Mat& m, const float* h, const int64_t* idx, int64_t k, float* out,
                    int nt, const float* tau, int64_t* kept) {
  if (m.dtype == DT_MXFP4)
    return mx_axpy(m.w, m.ld, m.nrows, m.cols, h, 0, 1, idx, k, out, 0, nt, tau, kept);
  if (!valid_shape(m.dtype, m.cols)) return PP_ERR_ARG;
  PP_DISPATCH(m.dtype, axpy_impl, m.w, m.ld, m.nrows, m.cols, h, idx, k, out, 0, nt, tau, kept)
}

extern "C" {

// out[j] = dot(W[idx[j]], x) for j < k; idx == NULL means rows 0..k-1 (dense GEMV).
int pp_gather_gemv(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols,
                   const float* x, const int64_t* idx, int64_t k, float* out, int act,
                   int nthreads) {
  return mat_gemv(Mat(dtype, W, ld, nrows, cols), x, idx, k, out, act, nthreads);
}

// out (+)= sum_{j: h[j] != 0} h[j] * W[idx[j]]; out is zeroed first unless accumulate.
int pp_gather_axpy(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols,
                   const float* h, const int64_t* idx, int64_t k, float* out, int accumulate,
                   int nthreads) {
  if (dtype == DT_MXFP4)
    return mx_axpy((const uint8_t*)W, ld, nrows, cols, h, 0, 1, idx, k, out, accumulate, nthreads);
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  PP_DISPATCH(dtype, axpy_impl, (const uint8_t*)W, ld, nrows, cols, h, idx, k, out, accumulate,
              nthreads)
}

// out[j] = act(G[idx[j]]·x, U[idx[j]]·x) (variant 0 reglu, 1 drelu, 2 swiglu, 3 geglu).
int pp_glu_gemv(int dtype, const void* G, int64_t ldg, const void* U, int64_t ldu, int64_t nrows,
                int64_t cols, const float* x, const int64_t* idx, int64_t k, int variant,
                float* out, int act, int nthreads) {
  if (variant < V_REGLU || variant > V_GEGLU || !G) return PP_ERR_ARG;
  return mat_glu(Mat(dtype, G, ldg, nrows, cols), Mat(dtype, U, ldu, nrows, cols), x, idx, k,
                 variant, out, act, nthreads);
}

// Reads `bytes` of p (64-byte aligned) with `nthreads` threads, as the GEMV kernels read weights;
// returns a checksum so the loads cannot be optimized away. For measuring read bandwidth.
double pp_stream_read(const void* p, int64_t bytes, int nthreads) {
  const int64_t n = bytes / 64;
  double total = 0.0;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static) reduction(+ : total)
#endif
  for (int64_t t = 0; t < 64; ++t) {  // 64 contiguous slices, spread over the threads
    const float* q = (const float*)p + n * 16 * t / 64;
    const int64_t m = n * (t + 1) / 64 - n * t / 64;
    vf a0 = v_zero(), a1 = v_zero();
    for (int64_t i = 0; i < m; ++i) {
      prefetch_l2(q + 16 * (i + 32));
      for (int u = 0; u < 16 / VL; u += 2) {
        a0 = v_add(a0, v_load(q + 16 * i + u * VL));
        if (u + 1 < 16 / VL) a1 = v_add(a1, v_load(q + 16 * i + (u + 1) * VL));
      }
    }
    total += v_sum(v_add(a0, a1));
  }
  return total;
}

// out[j, :] = W[idx[j], :] as f32 (idx == NULL: rows 0..k-1); out is (k, cols) contiguous.
int pp_dequant_rows(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols,
                    const int64_t* idx, int64_t k, float* out, int nthreads) {
  if (dtype == DT_MXFP4) return mx_dequant((const uint8_t*)W, ld, nrows, cols, idx, k, out);
  if (is_x8(dtype))
    return x8_layout(dtype, [&](auto X) {
      return x8_dequant<decltype(X)>((const uint8_t*)W, nrows, cols, idx, k, out, nthreads);
    });
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  PP_DISPATCH(dtype, dequant_impl, (const uint8_t*)W, ld, nrows, cols, idx, k, out, nthreads)
}

// Rows of dtype Q4_K, Q4_0 or MXFP4 (raw, ld bytes apart; nrows a multiple of 8) interleaved 8
// at a time into out (q4_k_x8.h, q4_0_x8.h, mxfp4_x8.h); back with unpack != 0 (dtype then the
// interleaved code, W the interleaved matrix and out the rows). Returns the layout's dtype code,
// or -1 where the kernels have no interleaved products (no AVX2), the dtype has no layout or the
// shape does not fit.
int pp_repack_x8(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols, void* out,
                 int unpack, int nthreads) {
  const int of_rows = dtype == DT_Q4_K   ? DT_Q4_KX8
                      : dtype == DT_Q4_0 ? DT_Q4_0X8
                      : dtype == DT_MXFP4 ? DT_MXFP4X8
                                          : -1;
  const int code = unpack ? dtype : of_rows;  // the layout's
  if (!is_x8(code)) return -1;
  return x8_layout(code, [&](auto X) {
    return x8_repack<decltype(X)>((const uint8_t*)W, ld, nrows, cols, (uint8_t*)out, unpack,
                                  nthreads);
  });
}

}  // extern "C"
