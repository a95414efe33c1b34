// A prompt's products: T tokens through a matrix at once, GEMM (the tiles of vec.h, the AVX-512
// VNNI ones of wide_avx512.h, the interleaved layouts' and MXFP4's) and the row sums of a
// neuron-major matrix. Its own translation unit, beside rows.cpp's one-token products, so that
// the two compile side by side.

#include "mat.h"  // every kernel, and Mat

extern "C" {

// out[t] = sum_{j: h[t][j] != 0} h[t][j] * W[j] for T tokens: h (T, nrows), out (T, cols).
int pp_rows_sum(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols, const float* h,
                int64_t T, float* out, int nthreads) {
  if (dtype == DT_MXFP4)
    return mx_axpy((const uint8_t*)W, ld, nrows, cols, h, nrows, T, nullptr, nrows, out, 0,
                   nthreads);
  if (!valid_shape(dtype, cols) || T < 0) return PP_ERR_ARG;
  PP_DISPATCH(dtype, rows_gemm_impl, (const uint8_t*)W, ld, nrows, cols, h, T, out, nthreads)
}

// out[t * ldo + r] = dot(W[r], x[t * ldx : t * ldx + cols]) for r < nrows, t < T. need (may be
// null) is (T, nrows) bytes: where need[t * nrows + r] is 0 the caller ignores out[t * ldo + r],
// and the Q4_0 integer GEMM skips (writes 0 to) the row pairs and 8-token tiles no token needs.
int pp_gemm(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
            int64_t ldx, int64_t T, float* out, int64_t ldo, const uint8_t* need, int act,
            int nthreads) {
  if (dtype == DT_MXFP4)
    return mx_gemm((const uint8_t*)W, ld, nrows, cols, x, ldx, T, nullptr, nrows, out, ldo, act,
                   nthreads);
  if (is_x8(dtype))
    return x8_layout(dtype, [&](auto X) {
      return x8_gemm<decltype(X)>((const uint8_t*)W, nrows, cols, x, ldx, T, out, ldo, act,
                                  nthreads, dtype == DT_Q4_KX8V);
    });
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  if (need && rows_as_x8(dtype, act))
    return x8_rows_gemm<X8Q40>((const uint8_t*)W, ld, nrows, cols, x, ldx, T, out, ldo, need, act,
                               nthreads);
  PP_DISPATCH(dtype, gemm_impl, (const uint8_t*)W, ld, nrows, cols, x, ldx, T, out, ldo, need,
              act, nthreads)
}

}  // extern "C"
