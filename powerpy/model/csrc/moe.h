// Mixtures of experts (powerpy/model/moe.py, docs/moe.md): the router as llama.cpp computes it
// (f32 logits in tinyBLAS's order, ggml's soft_max), and one token's whole MoE FFN block in one
// call. Included by sparse_ffn.cpp after the Mat helpers.

namespace {

// out[r] = dot(W[r], x) for f32 rows W (nrows, cols; rows ld floats apart) in the order of
// llama.cpp's f32 matmuls (tinyBLAS: one GW-lane FMA accumulator over cols / GW steps, reduced by
// hsum_gw); cols % GW == 0.
inline void gemv_f32_gw(const float* W, int64_t ld, int64_t r0, int64_t r1, int64_t cols,
                        const float* x, float* out, int64_t ldo) {
  constexpr int LG = GW / VL;
  for (int64_t r = r0; r < r1; ++r) {
    const float* w = W + r * ld;
    vf acc[LG];
    for (int u = 0; u < LG; ++u) acc[u] = v_zero();
    for (int64_t i = 0; i < cols; i += GW)
      for (int u = 0; u < LG; ++u) acc[u] = v_fma(v_load(w + i + u * VL), v_load(x + i + u * VL), acc[u]);
    out[r * ldo] = lanes_hsum(acc);
  }
}

// ggml's soft_max of one row of n (ggml_vec_soft_max_f32): y = exp(x - max) by ggml's vector
// exp in GW-lane chunks (each chunk's lanes summed by hsum_gw) and libm's expf for the last
// n % GW, the chunk sums and the tail summed in double; then y *= (float)(1 / sum).
inline void soft_max_row(const float* x, int64_t n, float* y) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  double sum = 0.0;
  int64_t i = 0;
  for (; i + GW <= n; i += GW) {
    float e[16] = {};
    if (!exp16(x + i, GW, mx, e))
      for (int64_t l = 0; l < GW; ++l) e[l] = ggml_expf(x[i + l] - mx);
    for (int64_t l = 0; l < GW; ++l) y[i + l] = e[l];
    sum += (double)hsum_gw(e);
  }
  for (; i < n; ++i) {
    const float v = expf(x[i] - mx);
    sum += (double)v;
    y[i] = v;
  }
  const float inv = (float)(1.0 / sum);
  for (int64_t j = 0; j < n; ++j) y[j] *= inv;
}

// A matrix of rows [r0, r0 + n) of m, as a Mat.
inline Mat sub_rows(const Mat& m, int64_t r0, int64_t n) {
  const int64_t p[5] = {m.dtype, (int64_t)(intptr_t)(m.w + r0 * m.ld), m.ld, n, m.cols};
  return Mat(p);
}

}  // namespace

extern "C" {

// out[t * nrows + r] = dot(W[r], x[t]) for f32 W (nrows, cols; rows ld floats apart) and T
// tokens x (T, cols), in the order of llama.cpp's f32 matmuls (gemv_f32_gw); cols % GW == 0. The
// MoE router: its logits decide the routing, so they follow llama.cpp's bits.
int pp_gemm_f32_gw(const float* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
                   int64_t T, float* out, int nthreads) {
  if (cols % GW || nrows < 1 || T < 1) return PP_ERR_ARG;
  const int nt = team_size(nthreads, nrows * cols * 4);
  return run_partitioned(nt, nrows, [&](int64_t a, int64_t b) -> int {
    for (int64_t t = 0; t < T; ++t) gemv_f32_gw(W, ld, a, b, cols, x + t * cols, out + t * nrows, 1);
    return 0;
  });
}

// ggml's soft_max of `rows` rows of n (soft_max_row).
void pp_soft_max(const float* x, int64_t rows, int64_t n, float* y) {
  for (int64_t r = 0; r < rows; ++r) soft_max_row(x + r * n, n, y + r * n);
}

// One token's mixture-of-experts FFN block in one call (CPU decode, llama.cpp's build_moe_ffn):
// xn = rms_norm(r) * norm_w; logits = router · xn (an f32 router in gemv_f32_gw's order when
// cols % GW == 0, else mat_gemv); p = soft_max(logits); the k experts of largest p, largest
// first (ties: lower id); w_i = p[e_i] / max(sum_i p[e_i] (in double), 2^-14) when `norm`, then
// w_i *= scale unless scale is 0 or 1; h = silu(gate · xn) * (up · xn) over the routed experts'
// rows in one pass; with tau (n_expert * n_ff, or null) h_j = 0 where |h_j| * w_i < tau;
// y_i = down_i · h_i; out = r + ((y_0 w_0 + y_1 w_1) + ...), llama.cpp's order. mats: router,
// gate and up stacks (n_expert * n_ff, n_embd), down stack (n_expert * n_embd, n_ff), 4 x 5
// int64. ids and wts (k, or null) receive the routing. Returns the neurons whose down column was
// added (their h nonzero), or -status.
int64_t pp_moe_decode(const int64_t* mats, int64_t k, int norm, float scale, const float* tau,
                      const float* r, const float* norm_w, float eps, float* out, int64_t* ids,
                      float* wts, int act, int nthreads) {
  const Mat router(mats), gate(mats + 5), up(mats + 10), down(mats + 15);
  const int64_t E = router.nrows, d = router.cols;
  if (E < 1 || k < 1 || k > E || gate.nrows % E || up.nrows != gate.nrows ||
      down.nrows != E * d || gate.cols != d || down.cols != gate.nrows / E)
    return -PP_ERR_ARG;
  const int64_t ff = gate.nrows / E;
  float* buf = (float*)std::malloc(sizeof(float) * (d + 2 * E + k * ff + 2 * d + k) +
                                   sizeof(int64_t) * (k * ff + k));
  if (!buf) return -PP_ERR_ARG;
  float *x = buf, *logit = x + d, *p = logit + E, *h = p + E, *y = h + k * ff, *acc = y + d;
  int64_t* idx = (int64_t*)(acc + d + k);
  if (!ids) ids = idx + k * ff;  // the caller does not want the routing: kept here
  if (!wts) wts = acc + d;
  rms_norm(r, norm_w, d, eps, x);
  int st = 0;
  if (router.dtype == 0 && act && d % GW == 0)
    gemv_f32_gw((const float*)router.w, router.ld / 4, 0, E, d, x, logit, 1);
  else
    st = mat_gemv(router, x, nullptr, E, logit, act, nthreads);
  if (!st) soft_max_row(logit, E, p);
  double sum = 0.0;
  for (int64_t i = 0; i < k && !st; ++i) {  // selection: largest first, ties to the lower id
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t j = 0; j < i; ++j) taken |= ids[j] == e;
      if (!taken && (best < 0 || p[e] > p[best])) best = e;
    }
    ids[i] = best;
    wts[i] = p[best];
    sum += (double)p[best];
  }
  if (norm) {
    float s = (float)sum;
    s = s < 6.103515625e-5f ? 6.103515625e-5f : s;
    for (int64_t i = 0; i < k; ++i) wts[i] = wts[i] / s;
  }
  if (scale != 0.0f && scale != 1.0f)
    for (int64_t i = 0; i < k; ++i) wts[i] = wts[i] * scale;
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = 0; j < ff; ++j) idx[i * ff + j] = ids[i] * ff + j;
  if (!st) st = mat_glu(gate, up, x, idx, k * ff, V_SWIGLU, h, act, nthreads);
  int64_t kept = 0;
  for (int64_t i = 0; i < k * ff && !st; ++i) {
    if (tau && std::fabs(h[i]) * wts[i / ff] < tau[idx[i]]) h[i] = 0.0f;
    kept += h[i] != 0.0f;
  }
  for (int64_t i = 0; i < k && !st; ++i) {
    st = mat_gemv(sub_rows(down, ids[i] * d, d), h + i * ff, nullptr, d, i ? y : acc, act,
                  nthreads);
    float* yi = i ? y : acc;  // y_i w_i rounded in a loop of its own, then added: llama.cpp's
    for (int64_t j = 0; j < d; ++j) yi[j] *= wts[i];  // ggml_mul, then ggml_add (no FMA)
    if (i)
      for (int64_t j = 0; j < d; ++j) acc[j] += y[j];
  }
  for (int64_t j = 0; j < d && !st; ++j) out[j] = r[j] + acc[j];
  std::free(buf);
  return st ? -st : kept;
}

}  // extern "C"
