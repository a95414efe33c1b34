// Mixtures of experts (powerpy/model/moe.py, docs/moe.md): the router as llama.cpp computes it
// (f32 logits in tinyBLAS's order, ggml's soft_max), and one token's whole MoE FFN block in one
// call. Included by sparse_ffn.cpp after the Mat helpers.

namespace {

// out[r] = dot(W[r], x) for f32 rows W (nrows, cols; rows ld floats apart) in the order of
// llama.cpp's f32 matmuls: a batch's tinyBLAS (one = false: one GW-lane FMA accumulator over
// cols / GW steps, reduced by hsum_gw) or one token's ggml_vec_dot_f32 (one = true: four GW-lane
// accumulators over 4 GW-element steps, summed (0 + 2) + (1 + 3), reduced by vreduce_gw, then
// the rest in order, see below); one = false needs cols % GW == 0.
inline void gemv_f32_gw(const float* W, int64_t ld, int64_t r0, int64_t r1, int64_t cols,
                        const float* x, float* out, int64_t ldo, bool one) {
  constexpr int LG = GW / VL;
  const int64_t np = one ? cols & ~(int64_t)(4 * GW - 1) : cols;
  for (int64_t r = r0; r < r1; ++r) {
    const float* w = W + r * ld;
    vf acc[4][LG];
    for (int j = 0; j < 4; ++j)
      for (int u = 0; u < LG; ++u) acc[j][u] = v_zero();
    const int step = one ? 4 * GW : GW;
    for (int64_t i = 0; i < np; i += step)
      for (int j = 0; j < step / GW; ++j)
        for (int u = 0; u < LG; ++u) {
          const int64_t e = i + GW * j + u * VL;
          acc[j][u] = v_fma(v_load(w + e), v_load(x + e), acc[j][u]);
        }
    if (!one) {
      out[r * ldo] = lanes_hsum(acc[0]);
      continue;
    }
    for (int u = 0; u < LG; ++u)
      acc[0][u] = v_add(v_add(acc[0][u], acc[2][u]), v_add(acc[1][u], acc[3][u]));
    float s = lanes_vreduce(acc[0]);
    // The rest as GCC builds ggml's leftover loop for this width: with AVX-512 it multiplies 8
    // at a time (each product rounded) and adds them in order, then fuses the last n % 8 into
    // FMAs; the AVX2 build keeps every product rounded.
    const int64_t nv = GW == 16 ? np + (cols - np) / 8 * 8 : cols;
    for (int64_t i = np; i < nv; ++i) s += no_contract(w[i] * x[i]);
    for (int64_t i = nv; i < cols; ++i) s = std::fma(w[i], x[i], s);
    out[r * ldo] = s;
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

// logits[r] = m[r] · x for every row of a router-like matrix and one token: an f32 one in
// llama.cpp's one-token f32 order (gemv_f32_gw) with quantized activations, else mat_gemv.
inline int logits_gemv(const Mat& m, const float* x, float* out, int act, int nthreads) {
  if (m.dtype == 0 && act) {
    gemv_f32_gw((const float*)m.w, m.ld / 4, 0, m.nrows, m.cols, x, out, 1, true);
    return 0;
  }
  return mat_gemv(m, x, nullptr, m.nrows, out, act, nthreads);
}

// The shared expert's gate as llama.cpp's qwen2moe graph computes it: silu(g) / g, with
// ggml_silu_f32's g / (1 + expf(-g)) (a row of one value: libm's expf); 0.5 at g = 0, where
// that form is 0/0.
inline float silu_div(float g) { return g == 0.0f ? 0.5f : (g / (1.0f + expf(-g))) / g; }

// A matrix of rows [r0, r0 + n) of m, as a Mat.
inline Mat sub_rows(const Mat& m, int64_t r0, int64_t n) {  // interleaved: r0 % 8 == 0
  const uint8_t* w = is_x8(m.dtype) ? m.w + r0 / 8 * m.ld : m.w + r0 * m.ld;
  const int64_t p[5] = {m.dtype, (int64_t)(intptr_t)w, m.ld, n, m.cols};
  return Mat(p);
}

}  // namespace

extern "C" {

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

// ggml's soft_max of `rows` rows of n (soft_max_row).
void pp_soft_max(const float* x, int64_t rows, int64_t n, float* y) {
  for (int64_t r = 0; r < rows; ++r) soft_max_row(x + r * n, n, y + r * n);
}

// One token's mixture-of-experts FFN block in one call (CPU decode, llama.cpp's build_moe_ffn):
// xn = rms_norm(r) * norm_w; logits = router · xn (logits_gemv); p = soft_max(logits); the k
// experts of largest p, largest first (ties: lower id); w_i = p[e_i] / max(sum_i p[e_i] (in
// double), 2^-14) when `norm`, then w_i *= scale unless scale is 0 or 1; h = silu(gate · xn) *
// (up · xn) over the routed experts' rows in one pass; with tau (n_expert * n_ff, or null) h_j = 0
// where |h_j| * w_i < tau; y_i = down_i · h_i; acc = (y_0 w_0 + y_1 w_1) + ..., llama.cpp's order.
// With a shared expert (qwen2moe): acc += (down_s · (silu(gate_s · xn) * (up_s · xn))) *
// silu_div(gate_inp_s · xn). out = r + acc. mats: router, gate and up stacks (n_expert * n_ff,
// n_embd), down stack (n_expert * n_embd, n_ff), then the shared expert's gate row (1, n_embd),
// gate and up (n_ff_s, n_embd) and down (n_embd, n_ff_s), all zeros without one: 8 x 5 int64.
// ids and wts (k, or null) receive the routing. Returns the routed neurons whose down column was
// added (their h nonzero), or -status.
int64_t pp_moe_decode(const int64_t* mats, int64_t k, int norm, float scale, const float* tau,
                      const float* r, const float* norm_w, float eps, float* out, int64_t* ids,
                      float* wts, int act, int nthreads) {
  const Mat router(mats), gate(mats + 5), up(mats + 10), down(mats + 15);
  const Mat s_inp(mats + 20), s_gate(mats + 25), s_up(mats + 30), s_down(mats + 35);
  const int64_t E = router.nrows, d = router.cols, ffs = s_up.nrows;
  if (E < 1 || k < 1 || k > E || gate.nrows % E || up.nrows != gate.nrows ||
      down.nrows != E * d || gate.cols != d || down.cols != gate.nrows / E)
    return -PP_ERR_ARG;
  if (ffs && (s_inp.nrows != 1 || s_inp.cols != d || s_gate.nrows != ffs || s_gate.cols != d ||
              s_up.cols != d || s_down.nrows != d || s_down.cols != ffs))
    return -PP_ERR_ARG;
  const int64_t ff = gate.nrows / E;
  if ((is_x8(gate.dtype) && ff % 8) || (is_x8(down.dtype) && d % 8) ||
      is_x8(gate.dtype) != is_x8(up.dtype))
    return -PP_ERR_ARG;  // an interleaved stack's experts start at whole groups
  float* buf = (float*)std::malloc(sizeof(float) * (d + 2 * E + k * ff + 2 * d + k + ffs) +
                                   sizeof(int64_t) * (k * ff + k));
  if (!buf) return -PP_ERR_ARG;
  float *x = buf, *logit = x + d, *p = logit + E, *h = p + E, *y = h + k * ff, *acc = y + d;
  float* hs = acc + d + k;
  int64_t* idx = (int64_t*)(hs + ffs);
  if (!ids) ids = idx + k * ff;  // the caller does not want the routing: kept here
  if (!wts) wts = acc + d;
  rms_norm(r, norm_w, d, eps, x);
  int st = logits_gemv(router, x, logit, act, nthreads);
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
  if (!st && is_x8(gate.dtype) && act) {  // interleaved stacks: every routed expert's rows
    float* g = (float*)std::malloc(sizeof(float) * (size_t)(k * ff));
    st = g ? x8_experts(gate.dtype, gate.w, gate.ld, ff, d, ids, k, x, 0, g, act, nthreads)
           : PP_ERR_ARG;
    if (!st) st = x8_experts(up.dtype, up.w, up.ld, ff, d, ids, k, x, 0, h, act, nthreads);
    for (int64_t j = 0; j < k * ff && !st; ++j) h[j] = activate(V_SWIGLU, g[j], h[j], nullptr);
    std::free(g);
  } else if (is_x8(gate.dtype)) {
    for (int64_t i = 0; i < k && !st; ++i)
      st = mat_glu(sub_rows(gate, ids[i] * ff, ff), sub_rows(up, ids[i] * ff, ff), x, nullptr, ff,
                   V_SWIGLU, h + i * ff, act, nthreads);
  } else if (!st) {
    st = mat_glu(gate, up, x, idx, k * ff, V_SWIGLU, h, act, nthreads);
  }
  int64_t kept = 0;
  for (int64_t i = 0; i < k * ff && !st; ++i) {
    if (tau && std::fabs(h[i]) * wts[i / ff] < tau[idx[i]]) h[i] = 0.0f;
    kept += h[i] != 0.0f;
  }
  float* ys = nullptr;  // interleaved down stacks: all k products in one call, then as below
  if (!st && is_x8(down.dtype) && act) {
    ys = (float*)std::malloc(sizeof(float) * (size_t)(k * d));
    st = ys ? x8_experts(down.dtype, down.w, down.ld, d, ff, ids, k, h, ff, ys, act, nthreads)
            : PP_ERR_ARG;
  }
  for (int64_t i = 0; i < k && !st; ++i) {
    if (ys)
      std::memcpy(i ? y : acc, ys + i * d, sizeof(float) * d);
    else
      st = mat_gemv(sub_rows(down, ids[i] * d, d), h + i * ff, nullptr, d, i ? y : acc, act,
                    nthreads);
    float* yi = i ? y : acc;  // y_i w_i rounded in a loop of its own, then added: llama.cpp's
    for (int64_t j = 0; j < d; ++j) yi[j] *= wts[i];  // ggml_mul, then ggml_add (no FMA)
    if (i)
      for (int64_t j = 0; j < d; ++j) acc[j] += y[j];
  }
  if (ffs && !st) {  // the shared expert: its gate, its SwiGLU FFN, scaled, then added
    float g = 0.0f;
    st = logits_gemv(s_inp, x, &g, act, nthreads);
    if (!st) st = mat_glu(s_gate, s_up, x, nullptr, ffs, V_SWIGLU, hs, act, nthreads);
    if (!st) st = mat_gemv(s_down, hs, nullptr, d, y, act, nthreads);
    const float sg = silu_div(g);
    for (int64_t j = 0; j < d && !st; ++j) y[j] *= sg;
    for (int64_t j = 0; j < d && !st; ++j) acc[j] += y[j];
  }
  for (int64_t j = 0; j < d && !st; ++j) out[j] = r[j] + acc[j];
  std::free(ys);
  std::free(buf);
  return st ? -st : kept;
}

}  // extern "C"
