#pragma once
// Mixtures of experts (powerpy/model/moe.py, docs/moe.md): the router as llama.cpp computes it
// (f32 logits in tinyBLAS's order, ggml's soft_max), and one token's whole MoE FFN block in one
// call.

#include "mat.h"

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

// GPT-OSS's SwiGLU (ggml's swiglu_oai, alpha 1.702, limit 7): the gate capped at 7, the up
// clamped to [-7, 7], then (x / (1 + expf(-1.702 x))) * (y + 1).
inline float swiglu_oai(float g, float u) {
  const float x = std::min(g, 7.0f), y = std::clamp(u, -7.0f, 7.0f);
  return (x / (1.f + expf(1.702f * (-x)))) * (y + 1.f);
}

// p = the routing probabilities of logits z (n) by R's gating (layer_record.h RecRoute); s = the
// scores the top k is taken of: p plus R's bias, -inf outside the `used` groups whose two best
// scores sum highest (ties: the lower group), as llama.cpp's build_moe_ffn. Returns false for
// groups that do not split n.
inline bool route_scores(const RecRoute& R, const float* z, int64_t n, float* p, float* s) {
  if (R.gating == 0) soft_max_row(z, n, p);
  for (int64_t e = 0; e < n && R.gating == 1; ++e) p[e] = 1.f / (1.f + expf(-z[e]));
  for (int64_t e = 0; e < n && R.gating == 2; ++e) p[e] = z[e];
  for (int64_t e = 0; e < n; ++e) s[e] = R.bias ? p[e] + R.bias[e] : p[e];
  if (R.groups <= 1) return true;
  const int64_t per = n / R.groups;
  if (n % R.groups || per < 2 || R.used < 1 || R.used > R.groups) return false;
  float* score = (float*)std::malloc(sizeof(float) * R.groups);
  bool* keep = (bool*)std::calloc(R.groups, sizeof(bool));
  if (!score || !keep) {
    std::free(score);
    std::free(keep);
    return false;
  }
  for (int64_t g = 0; g < R.groups; ++g) {  // the group's two best scores, summed
    float a = -INFINITY, b = -INFINITY;
    for (int64_t e = g * per; e < (g + 1) * per; ++e) {
      if (s[e] > a) {
        b = a;
        a = s[e];
      } else if (s[e] > b) {
        b = s[e];
      }
    }
    score[g] = a + b;
  }
  for (int64_t i = 0; i < R.used; ++i) {
    int64_t best = -1;
    for (int64_t g = 0; g < R.groups; ++g)
      if (!keep[g] && (best < 0 || score[g] > score[best])) best = g;
    keep[best] = true;
  }
  for (int64_t e = 0; e < n; ++e)
    if (!keep[e / per]) s[e] = -INFINITY;
  std::free(score);
  std::free(keep);
  return true;
}

// A matrix of rows [r0, r0 + n) of m, as a Mat.
inline Mat sub_rows(const Mat& m, int64_t r0, int64_t n) {  // interleaved: r0 % 8 == 0
  const uint8_t* w = is_x8(m.dtype) ? m.w + r0 / 8 * m.ld : m.w + r0 * m.ld;
  return Mat(m.dtype, w, m.ld, n, m.cols);
}

// The MoE cut works on groups of neurons, one block of the down stack's type (K-quants 256,
// the others 32 values): a group's down columns are one block in every row of the stored
// (n_embd, n_ff) matrix, so a cut group is bytes not read (down_runs).
inline int64_t cut_group(int dtype) { return dtype >= DT_Q4_K && dtype <= DT_Q6_K ? 256 : 32; }

// The cut of one expert's h (n neurons, weight w): each group of g neurons is zeroed when
// w · sum_j |h_j| / tau_j < 1 (tau_j = t / |down column j|, per neuron idx[j] or j; tau 0: the
// neuron is kept), the sum in neuron order.
inline void cut_groups(float* h, int64_t n, int64_t g, float w, const float* tau,
                       const int64_t* idx) {
  for (int64_t j0 = 0; j0 < n; j0 += g) {
    float s = 0.0f;
    for (int64_t j = j0; j < j0 + g && j < n; ++j) {
      const float t = tau[idx ? idx[j] : j];
      s += t > 0.0f ? std::fabs(h[j]) * w / t : (h[j] != 0.0f ? INFINITY : 0.0f);
    }
    if (s < 1.0f)
      for (int64_t j = j0; j < j0 + g && j < n; ++j) h[j] = 0.0f;
  }
}

// One row's dot with x over the 32-value chunks ch[0..nc) only, by the row kernel K (vec.h:
// QDot for quantized activations, FDot for f32 ones): one accumulator, one sum at the end.
template <class K, int R>
PP_ALWAYS_INLINE void kept_dot(const uint8_t* const* w, const typename K::X x, const int64_t* ch,
                               int64_t nc, float* out) {
  typename K::Acc acc[R];
  typename K::Sm sm[R];
  for (int r = 0; r < R; ++r) K::zero(acc[r], sm[r]);
  for (int64_t i = 0; i < nc; ++i) {  // R rows side by side: each chunk of x read once
    const auto a = K::act(x, 0, ch[i]);
    for (int r = 0; r < R; ++r) {
      typename K::W wv;
      K::decode(w[r], ch[i], x, wv);
      K::add(acc[r], sm[r], wv, a);
    }
  }
  for (int r = 0; r < R; ++r) {
    float res = K::template sum<1>(&acc[r], &sm[r]);
    K::template tail<1>(&res, &w[r], x, 0);  // FDot: the elements past whole chunks (none)
    out[r] = res;
  }
}

// out[r] = row r of W · h over the chunks ch (the kept groups'): h rounded once, as a GEMV.
template <int DT>
int kept_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* h,
              const int64_t* ch, int64_t nc, float* out, int act, int nthreads) {
  ActBuf<DT> xa(act, h, cols, 1, cols);
  if (xa.failed(act)) return PP_ERR_ARG;
  const int team = team_size(nthreads, nrows * nc * row_bytes<DT>(32));
  auto rows = [&](auto R, int64_t r) {  // R rows from r
    const uint8_t* w[decltype(R)::value];
    for (int i = 0; i < decltype(R)::value; ++i) w[i] = W + (r + i) * ld;
    if constexpr (act_kind<DT>() != ACT_F32)
      if (xa.p) return kept_dot<QDot<DT>, decltype(R)::value>(w, {xa.p, cols / 32}, ch, nc, out + r);
    kept_dot<FDot<DT>, decltype(R)::value>(w, {h, 0, cols}, ch, nc, out + r);
  };
  return run_partitioned(team, nrows, [&](int64_t a, int64_t b) -> int {
    int64_t r = a;
    for (; r + 4 <= b; r += 4) rows(std::integral_constant<int, 4>(), r);
    for (; r < b; ++r) rows(std::integral_constant<int, 1>(), r);
    return 0;
  });
}

// The same for MXFP4 rows (mxfp4.h): each kept block's lanes times d_x · d_w, added in order.
static int mx_kept(const Mat& m, const float* h, const int64_t* ch, int64_t nc, float* out,
                   int act, int nt) {
  const int64_t nb = m.cols / 32;
  std::vector<QAct> a((size_t)(act ? nb : 0));
  if (act) quantize_act(ACT_Q8_0, h, m.cols, a.data());
  return run_partitioned(team_size(nt, m.nrows * nc * MX_TS), m.nrows, [&](int64_t r0, int64_t r1) {
    float y[32];
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = m.w + r * m.ld;
      float s = 0.0f;
      for (int64_t i = 0; i < nc; ++i) {
        const int64_t b = ch[i];
        if (act) {
          int32_t lane[8], si = 0;
          mx_lanes(row + b * MX_TS, a[b], lane);
          for (int l = 0; l < 8; ++l) si += lane[l];
          s = std::fma(a[b].d * e8m0_half(row[b * MX_TS]), (float)si, s);
        } else {
          mx_block(row + b * MX_TS, y);
          for (int j = 0; j < 32; ++j) s = std::fma(y[j], h[32 * b + j], s);
        }
      }
      out[r] = s;
    }
    return 0;
  });
}

// out = m · h for a stored (not interleaved) down matrix, reading only the 32-value chunks of
// the groups of h that are not all zero (a cut's): a row's bytes of a cut group are not read.
// Every group kept (or an interleaved matrix): one mat_gemv, its bits.
static int down_runs(const Mat& m, const float* h, float* out, int act, int nt) {
  const int64_t G = cut_group(m.dtype), ng = m.cols / G;
  if (is_x8(m.dtype) || m.cols % G) return mat_gemv(m, h, nullptr, m.nrows, out, act, nt);
  std::vector<int64_t> ch;  // the kept groups' chunks, in order
  for (int64_t g = 0; g < ng; ++g) {
    bool zero = true;
    for (int64_t j = g * G; j < (g + 1) * G && zero; ++j) zero = h[j] == 0.0f;
    for (int64_t c = g * G / 32; !zero && c < (g + 1) * G / 32; ++c) ch.push_back(c);
  }
  const int64_t nc = (int64_t)ch.size();
  if (nc == m.cols / 32) return mat_gemv(m, h, nullptr, m.nrows, out, act, nt);
  if (m.dtype == DT_MXFP4) return mx_kept(m, h, ch.data(), nc, out, act, nt);
  PP_DISPATCH(m.dtype, kept_impl, m.w, m.ld, m.nrows, m.cols, h, ch.data(), nc, out, act, nt)
}

// One token's mixture-of-experts FFN block in one call (CPU decode, llama.cpp's build_moe_ffn):
// xn = rms_norm(r) * norm_w; logits = router · xn (logits_gemv); p and the selection scores s
// by `route` (RecRoute, route_scores; null: p = soft_max(logits) = s); the k experts of largest s,
// largest first (ties: lower id); w_i = p[e_i] (gating 2: the soft_max of the k logits);
// w_i /= max(sum_i w_i (in double), 2^-14) when `norm`, then w_i *= scale unless scale is 0 or
// 1; h = silu(gate · xn) *
// (up · xn) over the routed experts' rows in one pass; with tau (n_expert * n_ff, or null) the
// cut by groups (cut_groups), and y_i = down_i · h_i reads only the kept groups (down_runs); acc = (y_0 w_0 + y_1 w_1) + ..., llama.cpp's order.
// With a shared expert: acc += (down_s · (silu(gate_s · xn) * (up_s · xn))), times
// silu_div(gate_inp_s · xn) where it has that gate row (qwen2moe). out = r + acc. mats: router,
// gate and up stacks (n_expert * n_ff, n_embd), down stack (n_expert * n_embd, n_ff), then the
// shared expert's gate row (1, n_embd; zeros: none), gate and up (n_ff_s, n_embd) and down
// (n_embd, n_ff_s), all zeros without one: 8 RecMatrix. ids and wts (k, or null) receive the
// routing. Returns the routed neurons whose down column was added (their h nonzero), or -status.
int64_t moe_decode(const RecMatrix* mats, int64_t k, int norm, float scale, const RecRoute* route,
                   const float* tau, const float* r, const float* norm_w, float eps, float* out,
                   int64_t* ids, float* wts, int act, int nthreads) {
  const Mat router(mats[0]), gate(mats[1]), up(mats[2]), down(mats[3]);
  const Mat s_inp(mats[4]), s_gate(mats[5]), s_up(mats[6]), s_down(mats[7]);
  const int64_t E = router.nrows, d = router.cols, ffs = s_up.nrows;
  const RecRoute R = route ? *route : RecRoute{};
  if (E < 1 || k < 1 || k > E || gate.nrows % E || up.nrows != gate.nrows ||
      down.nrows != E * d || gate.cols != d || down.cols != gate.nrows / E || R.gating < 0 ||
      R.gating > 2)
    return -PP_ERR_ARG;
  if (ffs && ((s_inp.w && (s_inp.nrows != 1 || s_inp.cols != d)) || s_gate.nrows != ffs ||
              s_gate.cols != d || s_up.cols != d || s_down.nrows != d || s_down.cols != ffs))
    return -PP_ERR_ARG;
  const int64_t ff = gate.nrows / E;
  if ((is_x8(gate.dtype) && ff % 8) || (is_x8(down.dtype) && d % 8) ||
      is_x8(gate.dtype) != is_x8(up.dtype))
    return -PP_ERR_ARG;  // an interleaved stack's experts start at whole groups
  float* buf = (float*)std::malloc(sizeof(float) * (d + 3 * E + k * ff + 2 * d + 2 * k + ffs) +
                                   sizeof(int64_t) * (k * ff + k));
  if (!buf) return -PP_ERR_ARG;
  float *x = buf, *logit = x + d, *p = logit + E, *sel = p + E, *h = sel + E, *y = h + k * ff;
  float *acc = y + d, *zk = acc + d + k, *hs = zk + k;
  int64_t* idx = (int64_t*)(hs + ffs);
  if (!ids) ids = idx + k * ff;  // the caller does not want the routing: kept here
  if (!wts) wts = acc + d;
  rms_norm(r, norm_w, d, eps, x);
  int st = logits_gemv(router, x, logit, act, nthreads);
  for (int64_t e = 0; e < E && R.router_b; ++e) logit[e] += R.router_b[e];  // ggml_add
  if (!st && !route_scores(R, logit, E, p, sel)) st = PP_ERR_ARG;
  for (int64_t i = 0; i < k && !st; ++i) {  // selection: largest first, ties to the lower id
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t j = 0; j < i; ++j) taken |= ids[j] == e;
      if (!taken && (best < 0 || sel[e] > sel[best])) best = e;
    }
    ids[i] = best;
    zk[i] = wts[i] = p[best];
  }
  if (!st && R.gating == 2) soft_max_row(zk, k, wts);  // the chosen logits' softmax
  double sum = 0.0;
  for (int64_t i = 0; i < k && !st; ++i) sum += (double)wts[i];
  if (norm) {
    float s = (float)sum;
    s = s < 6.103515625e-5f ? 6.103515625e-5f : s;
    for (int64_t i = 0; i < k; ++i) wts[i] = wts[i] / s;
  }
  if (scale != 0.0f && scale != 1.0f)
    for (int64_t i = 0; i < k; ++i) wts[i] = wts[i] * scale;
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = 0; j < ff; ++j) idx[i * ff + j] = ids[i] * ff + j;
  const bool split = R.act || R.gate_b || R.up_b;  // gate and up apart, biased, then activated
  if (!st && ((is_x8(gate.dtype) && act) || split)) {  // (interleaved: every routed expert's rows)
    float* g = (float*)std::malloc(sizeof(float) * (size_t)(k * ff));
    if (!g) st = PP_ERR_ARG;
    else if (is_x8(gate.dtype) && act)
      st = x8_experts(gate.dtype, gate.w, gate.ld, ff, d, ids, k, x, 0, g, act, nthreads);
    else
      st = mat_gemv(gate, x, idx, k * ff, g, act, nthreads);
    if (!st && is_x8(up.dtype) && act)
      st = x8_experts(up.dtype, up.w, up.ld, ff, d, ids, k, x, 0, h, act, nthreads);
    else if (!st)
      st = mat_gemv(up, x, idx, k * ff, h, act, nthreads);
    for (int64_t j = 0; j < k * ff && !st; ++j) {  // ggml_add_id of each expert's biases
      if (R.up_b) h[j] += R.up_b[idx[j]];
      if (R.gate_b) g[j] += R.gate_b[idx[j]];
      h[j] = R.act ? swiglu_oai(g[j], h[j]) : activate(V_SWIGLU, g[j], h[j], nullptr);
    }
    std::free(g);
  } else if (is_x8(gate.dtype)) {
    for (int64_t i = 0; i < k && !st; ++i)
      st = mat_glu(sub_rows(gate, ids[i] * ff, ff), sub_rows(up, ids[i] * ff, ff), x, nullptr, ff,
                   V_SWIGLU, h + i * ff, act, nthreads);
  } else if (!st) {
    st = mat_glu(gate, up, x, idx, k * ff, V_SWIGLU, h, act, nthreads);
  }
  int64_t kept = 0;
  for (int64_t i = 0; i < k && tau && !st; ++i)  // the cut, by groups (cut_groups)
    cut_groups(h + i * ff, ff, cut_group(down.dtype), wts[i], tau, idx + i * ff);
  for (int64_t i = 0; i < k * ff && !st; ++i) kept += h[i] != 0.0f;
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
      st = tau ? down_runs(sub_rows(down, ids[i] * d, d), h + i * ff, i ? y : acc, act, nthreads)
               : mat_gemv(sub_rows(down, ids[i] * d, d), h + i * ff, nullptr, d, i ? y : acc, act,
                          nthreads);
    float* yi = i ? y : acc;  // y_i w_i rounded in a loop of its own, then added: llama.cpp's
    for (int64_t j = 0; j < d && R.down_b; ++j) yi[j] += R.down_b[ids[i] * d + j];  // add_id
    for (int64_t j = 0; j < d; ++j) yi[j] *= wts[i];  // ggml_mul, then ggml_add (no FMA)
    if (i)
      for (int64_t j = 0; j < d; ++j) acc[j] += y[j];
  }
  if (ffs && !st) {  // the shared expert: its SwiGLU FFN, scaled by its gate, then added
    float g = 0.0f;
    if (s_inp.w) st = logits_gemv(s_inp, x, &g, act, nthreads);
    if (!st) st = mat_glu(s_gate, s_up, x, nullptr, ffs, V_SWIGLU, hs, act, nthreads);
    if (!st) st = mat_gemv(s_down, hs, nullptr, d, y, act, nthreads);
    const float sg = silu_div(g);
    for (int64_t j = 0; j < d && !st && s_inp.w; ++j) y[j] *= sg;
    for (int64_t j = 0; j < d && !st; ++j) acc[j] += y[j];
  }
  for (int64_t j = 0; j < d && !st; ++j) out[j] = r[j] + acc[j];
  std::free(ys);
  std::free(buf);
  return st ? -st : kept;
}

}  // namespace
