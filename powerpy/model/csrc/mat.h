#pragma once
// The exports' helpers: one matrix as Python describes it (Mat), and its products whatever its
// layout (row types, the interleaved layouts of x8.h, MXFP4), each dispatching on the runtime
// dtype code. Every file that runs the kernels on a Mat includes this header, and through it
// every kernel header.

#include "ops.h"         // GEMV, GLU, axpy, GEMM, dequant over rows; the row engine
#include "x8.h"          // the interleaved layouts' GEMV, GEMM, experts, dequant
#include "numerics.h"    // attention, and llama.cpp's float steps
#include "mxfp4.h"       // MXFP4 (GPT-OSS's experts): its own GEMV, GEMM, row sums

// ---- the exports' helpers -------------------------------------------------------------------

// return FN<DT>(...) for the runtime dtype code (PP_ERR_ARG for an unknown one).
#define PP_DISPATCH(dtype, FN, ...)            \
  switch (dtype) {                             \
    case DT_F32:                               \
      return FN<DT_F32>(__VA_ARGS__);          \
    case DT_F16:                               \
      return FN<DT_F16>(__VA_ARGS__);          \
    case DT_BF16:                              \
      return FN<DT_BF16>(__VA_ARGS__);         \
    case DT_Q8_0:                              \
      return FN<DT_Q8_0>(__VA_ARGS__);         \
    case DT_Q4_0:                              \
      return FN<DT_Q4_0>(__VA_ARGS__);         \
    case DT_Q4_1:                              \
      return FN<DT_Q4_1>(__VA_ARGS__);         \
    case DT_Q5_0:                              \
      return FN<DT_Q5_0>(__VA_ARGS__);         \
    case DT_Q5_1:                              \
      return FN<DT_Q5_1>(__VA_ARGS__);         \
    case DT_Q4_K:                              \
      return FN<DT_Q4_K>(__VA_ARGS__);         \
    case DT_Q5_K:                              \
      return FN<DT_Q5_K>(__VA_ARGS__);         \
    case DT_Q6_K:                              \
      return FN<DT_Q6_K>(__VA_ARGS__);         \
    default:                                   \
      return PP_ERR_ARG;                       \
  }

struct Mat {  // one matrix as Python describes it: 5 int64s (dtype, data, ld, nrows, cols)
  int dtype;
  const uint8_t* w;
  int64_t ld, nrows, cols;
  explicit Mat(const int64_t* p)
      : dtype((int)p[0]), w((const uint8_t*)(intptr_t)p[1]), ld(p[2]), nrows(p[3]), cols(p[4]) {}
  Mat(int dt, const void* p, int64_t ld_, int64_t n, int64_t c)
      : dtype(dt), w((const uint8_t*)p), ld(ld_), nrows(n), cols(c) {}
};

// An interleaved matrix takes whole-matrix products only: every row, in order.
static int x8_gemv(const Mat& m, const float* x, const int64_t* idx, int64_t k, float* out,
                   int act, int nt) {
  if (idx || k != m.nrows) return PP_ERR_ARG;
  return x8_layout(m.dtype, [&](auto X) {
    return x8_gemm<decltype(X)>(m.w, m.nrows, m.cols, x, m.cols, 1, out, m.nrows, act, nt, true);
  });
}

// Gathered (or need-masked) Q4_0 rows under llama.cpp's rounding are multiplied in the
// interleaved layout's order (x8.h x8_rows_*), so a sparse step's gate and up products carry the
// bits of the dense step's interleaved ones, and a sparse prompt's those of its decode.
inline bool rows_as_x8(int dtype, int act) { return dtype == DT_Q4_0 && act && X8_KERNELS; }

static int mat_gemv(const Mat& m, const float* x, const int64_t* idx, int64_t k, float* out,
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
static int mat_gemv_multi(const Mat* m, int nm, const float* x, float* const* out, int act,
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

static int mat_glu(const Mat& g, const Mat& u, const float* x, const int64_t* idx, int64_t k,
                   int variant, float* out, int act, int nt) {
  if (is_x8(u.dtype) || u.dtype == DT_MXFP4) return x8_glu(g, u, x, idx, k, variant, out, act, nt);
  if (!valid_shape(u.dtype, u.cols) || g.dtype != u.dtype) return PP_ERR_ARG;
  if (idx && rows_as_x8(u.dtype, act))
    return x8_rows_glu<X8Q40>(g.w, g.ld, u.w, u.ld, u.nrows, u.cols, x, idx, k, variant, out, act,
                              nt);
  PP_DISPATCH(u.dtype, glu_impl, g.w, g.ld, u.w, u.ld, u.nrows, u.cols, x, idx, k, variant, out,
              act, nt)
}

static int mat_axpy(const Mat& m, const float* h, const int64_t* idx, int64_t k, float* out,
                    int nt, const float* tau = nullptr, int64_t* kept = nullptr) {
  if (m.dtype == DT_MXFP4)
    return mx_axpy(m.w, m.ld, m.nrows, m.cols, h, 0, 1, idx, k, out, 0, nt, tau, kept);
  if (!valid_shape(m.dtype, m.cols)) return PP_ERR_ARG;
  PP_DISPATCH(m.dtype, axpy_impl, m.w, m.ld, m.nrows, m.cols, h, idx, k, out, 0, nt, tau, kept)
}
