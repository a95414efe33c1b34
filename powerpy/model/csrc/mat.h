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

struct Mat {  // one matrix as Python describes it (layer_record.h RecMatrix)
  int dtype;
  const uint8_t* w;
  int64_t ld, nrows, cols;
  explicit Mat(const RecMatrix& m)
      : dtype((int)m.dtype), w((const uint8_t*)m.data), ld(m.ld), nrows(m.nrows), cols(m.cols) {}
  Mat(int dt, const void* p, int64_t ld_, int64_t n, int64_t c)
      : dtype(dt), w((const uint8_t*)p), ld(ld_), nrows(n), cols(c) {}
};

// Gathered (or need-masked) Q4_0 rows under llama.cpp's rounding are multiplied in the
// interleaved layout's order (x8.h x8_rows_*), so a sparse step's gate and up products carry the
// bits of the dense step's interleaved ones, and a sparse prompt's those of its decode.
inline bool rows_as_x8(int dtype, int act) { return dtype == DT_Q4_0 && act && X8_KERNELS; }

// The products of a Mat whatever its layout. rows.cpp defines them, once for the library: the
// decode blocks, the experts and the host tasks call them there (one call per matrix, never in an
// inner loop), so that the row kernels of every dtype are compiled once. Each returns 0 or a
// status.
// out[j] = m[idx[j]] . x for j < k (idx null: rows 0..k-1).
int mat_gemv(const Mat& m, const float* x, const int64_t* idx, int64_t k, float* out, int act,
             int nt);
// out[i] = m[i] x for nm (1 to 4) matrices of one type and width.
int mat_gemv_multi(const Mat* m, int nm, const float* x, float* const* out, int act, int nt);
// out[j] = act(g[idx[j]] . x, u[idx[j]] . x) for the FFN variant.
int mat_glu(const Mat& g, const Mat& u, const float* x, const int64_t* idx, int64_t k,
            int variant, float* out, int act, int nt);
// out = sum_j h[j] * m[idx[j]] (the row sums; tau and kept: the cut, as axpy_impl takes them).
int mat_axpy(const Mat& m, const float* h, const int64_t* idx, int64_t k, float* out, int nt,
             const float* tau = nullptr, int64_t* kept = nullptr);
