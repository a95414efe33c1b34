// The exports of the mixtures of experts (moe.h): the MoE cut, the down pass over kept runs, the
// router's f32 product and llama.cpp's float steps of the experts' gates, and one token's whole MoE
// FFN block (moe_decode, which the decode blocks also call; decode.cpp).

#include "moe.h"

extern "C" {


// The MoE cut of T tokens' h (T, n) of one expert (tau: its n neurons', or with idx (n) the
// layer's): cut_groups with each token's weight w[t], groups of g.
void pp_moe_cut(float* h, int64_t T, int64_t n, int64_t g, const float* w, const float* tau,
                const int64_t* idx) {
  for (int64_t t = 0; t < T; ++t) cut_groups(h + t * n, n, g, w[t], tau, idx);
}

// out[t] = W · h[t] for T tokens of a stored down matrix (nrows, cols), by down_runs.
int pp_down_runs(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols,
                 const float* h, int64_t T, float* out, int act, int nthreads) {
  if (dtype < 0 || dtype >= DT_COUNT || T < 0) return PP_ERR_ARG;
  const Mat m(dtype, W, ld, nrows, cols);
  for (int64_t t = 0; t < T; ++t) {
    const int st = down_runs(m, h + t * cols, out + t * nrows, act, nthreads);
    if (st) return st;
  }
  return 0;
}

// out[t * nrows + r] = dot(W[r], x[t]) for f32 W (nrows, cols; rows ld floats apart) and T
// tokens x (T, cols), in the order of llama.cpp's f32 matmuls (gemv_f32_gw): tinyBLAS's where
// llama.cpp takes it (T >= 2, nrows % 4 == 0, cols % GW == 0), else ggml_vec_dot_f32's. The MoE
// router and a shared expert's gate: their values decide the routing and the gate, so they
// follow llama.cpp's bits.
int pp_gemm_f32_gw(const float* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
                   int64_t T, float* out, int nthreads) {
  if (nrows < 1 || T < 1 || cols < 1) return PP_ERR_ARG;
  const bool one = T < 2 || nrows % 4 || cols % GW;
  const int nt = team_size(nthreads, nrows * cols * 4);
  return run_partitioned(nt, nrows, [&](int64_t a, int64_t b) -> int {
    for (int64_t t = 0; t < T; ++t)
      gemv_f32_gw(W, ld, a, b, cols, x + t * cols, out + t * nrows, 1, one);
    return 0;
  });
}

// y[i] = silu_div(x[i]): the shared expert's gate of n tokens.
void pp_silu_div(const float* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = silu_div(x[i]);
}

// out[i] = swiglu_oai(g[i], u[i]): GPT-OSS's experts' activation (ggml's swiglu_oai).
void pp_swiglu_oai(const float* g, const float* u, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = swiglu_oai(g[i], u[i]);
}

// y[i] = 1 / (1 + expf(-x[i])): ggml's sigmoid (the routing of glm4moe and DeepSeek-V3).
void pp_sigmoid(const float* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = 1.f / (1.f + expf(-x[i]));
}

// ggml's soft_max of `rows` rows of n (soft_max_row).
void pp_soft_max(const float* x, int64_t rows, int64_t n, float* y) {
  for (int64_t r = 0; r < rows; ++r) soft_max_row(x + r * n, n, y + r * n);
}

// One token's MoE FFN block in one call (moe.h moe_decode: its arguments and result).
int64_t pp_moe_decode(const RecMatrix* mats, int64_t k, int norm, float scale,
                      const RecRoute* route, const float* tau, const float* r,
                      const float* norm_w, float eps, float* out, int64_t* ids, float* wts,
                      int act, int nthreads) {
  return moe_decode(mats, k, norm, scale, route, tau, r, norm_w, eps, out, ids, wts, act,
                    nthreads);
}

}  // extern "C"
