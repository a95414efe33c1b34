#pragma once
// Attention and the float steps around it. kv_dot / kv_axpy: the f32 attention of the decode block
// with f32 activations. The rest is llama.cpp's float numerics (RMSNorm, SwiGLU, f16 dots, softmax,
// f16-cache attention): with quantized activations and an f16 KV cache, powerpy follows ggml's CPU
// operations step by step (llama.cpp without flash attention), so that its logits equal
// llama.cpp's bit for bit. Each step is one IEEE operation in ggml's order, written as loops over
// GW lanes: ggml's vector width on this CPU (16 with AVX-512, 8 with AVX2), which sets its
// summation orders. The 16-lane hooks (kq_cells16, ...) are numerics_avx512.h's; swiglu_vec is
// also simd_avx2.h's (8 lanes).

#include "ops.h"

// y = x / sqrt(mean(x^2) + eps) * w, in ggml's order (squares summed in double).
static void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += (double)(x[i] * x[i]);
  const float scale = 1.0f / std::sqrt((float)(sum / (double)n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * scale) * w[i];
}

// y = (x - mean) / sqrt(var + eps) * w + b in ggml's order (ggml_norm, then mul, then add; b
// may be null): the mean from a double sum rounded to f32, the variance from squares summed GW
// lanes at a time (hsum_gw, as ggml_vec_cvar_f32), the lane sums and the rest in double.
static void layer_norm(const float* x, const float* w, const float* b, int64_t n, float eps,
                       float* y) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += (double)x[i];
  const float mean = (float)s / (float)n;
  double v = 0.0;
  int64_t i = 0;
  if (GW == 8 || GW == 16)
    for (; i + GW <= n; i += GW) {
      float t[16];
      for (int l = 0; l < GW; ++l) {  // each square rounded before the lane sums (GCC would
        const float dv = x[i + l] - mean;  // fuse it into their first add: ggml multiplies
        t[l] = no_contract(dv * dv);  // the vector, then adds)
      }
      v += (double)hsum_gw(t);
    }
  for (; i < n; ++i) {
    const float dv = x[i] - mean;
    v += (double)(dv * dv);
  }
  const float var = (float)(v / (double)n);
  const float scale = 1.0f / std::sqrt(var + eps);
  for (int64_t j = 0; j < n; ++j) {
    const float yw = no_contract(((x[j] - mean) * scale) * w[j]);
    y[j] = b ? yw + b[j] : yw;
  }
}

// dot(q, cache[at : at + n]) for an f32 (cdt 0) or f16 (cdt 1) cache.
static inline float kv_dot(const float* q, const void* c, int cdt, int64_t at, int64_t n) {
  vf a = v_zero();
  int64_t i = 0;
  float r = 0.0f;
  if (cdt == 0) {
    const float* k = (const float*)c + at;
    for (; i + VL <= n; i += VL) a = v_fma(v_load(q + i), v_load(k + i), a);
    for (; i < n; ++i) r += q[i] * k[i];
  } else {
    const uint16_t* k = (const uint16_t*)c + at;
    for (; i + VL <= n; i += VL) a = v_fma(v_load(q + i), v_load_h(k + i), a);
    for (; i < n; ++i) r += q[i] * half_to_float(k[i]);
  }
  return v_sum(a) + r;
}

// o += p * cache[at : at + n] for an f32 (cdt 0) or f16 (cdt 1) cache.
static inline void kv_axpy(float p, const void* c, int cdt, int64_t at, int64_t n, float* o) {
  const vf pv = v_set1(p);
  int64_t i = 0;
  if (cdt == 0) {
    const float* v = (const float*)c + at;
    for (; i + VL <= n; i += VL) v_store(o + i, v_fma(v_load(v + i), pv, v_load(o + i)));
    for (; i < n; ++i) o[i] += p * v[i];
  } else {
    const uint16_t* v = (const uint16_t*)c + at;
    for (; i + VL <= n; i += VL) v_store(o + i, v_fma(v_load_h(v + i), pv, v_load(o + i)));
    for (; i < n; ++i) o[i] += p * half_to_float(v[i]);
  }
}

// out[i] = silu(g[i]) * u[i] for i in [a, b), ggml's swiglu.
inline void swiglu_range(const float* g, const float* u, int64_t a, int64_t b, float* out) {
  int64_t i = swiglu_vec(g, u, a, b, out);
  for (; i < b; ++i) out[i] = ggml_silu(g[i]) * u[i];
}

// A dot product of two f16 vectors of n elements in ggml's order. one = true: ggml_vec_dot_f16
// (one token: four GW-lane accumulators over 4 GW-element steps, summed (0 + 2) + (1 + 3) and
// reduced by vreduce_gw, then the rest in double); one = false: the batched tinyBLAS kernel (one
// GW-lane accumulator, n % GW == 0, reduced by hsum_gw).
inline float dot_f16(const uint16_t* x, const uint16_t* y, int64_t n, bool one) {
  constexpr int LG = GW / VL;  // vectors per GW lanes
  if (!one) {
    vf acc[LG];
    for (int u = 0; u < LG; ++u) acc[u] = v_zero();
    for (int64_t i = 0; i < n; i += GW)
      for (int u = 0; u < LG; ++u)
        acc[u] = v_fma(v_load_h(x + i + u * VL), v_load_h(y + i + u * VL), acc[u]);
    return lanes_hsum(acc);
  }
  vf acc[4][LG];
  for (int j = 0; j < 4; ++j)
    for (int u = 0; u < LG; ++u) acc[j][u] = v_zero();
  const int64_t np = n & ~(int64_t)(4 * GW - 1);
  for (int64_t i = 0; i < np; i += 4 * GW)
    for (int j = 0; j < 4; ++j)
      for (int u = 0; u < LG; ++u) {
        const int64_t e = i + GW * j + u * VL;
        acc[j][u] = v_fma(v_load_h(x + e), v_load_h(y + e), acc[j][u]);
      }
  for (int u = 0; u < LG; ++u) acc[0][u] = v_add(v_add(acc[0][u], acc[2][u]), v_add(acc[1][u], acc[3][u]));
  double s = lanes_vreduce(acc[0]);
  for (int64_t i = np; i < n; ++i) s += (double)(half_to_float(x[i]) * half_to_float(y[i]));
  return (float)s;
}

// Softmax of scores s[0..S) (scaled by `scale`, ggml_soft_max_ext) into f16 weights p16, in
// GW-cell chunks: each chunk's exps are summed as one vector (hsum_gw), the chunk sums in double.
// llama.cpp's cache pads a row with masked cells; their exps are 0 and change no sum. A sink
// (GPT-OSS's per-head logit; NaN: none) joins the max and adds expf(sink - max) to the sum, as
// ggml_soft_max_add_sinks, without a value.
inline void softmax_f16(float* s, int64_t S, float scale, uint16_t* p16, float sink = NAN) {
  float mx = -INFINITY;
  int64_t t1 = scale_max16(s, S, scale, mx);
  for (; t1 < S; ++t1) mx = (s[t1] *= scale) > mx ? s[t1] : mx;
  if (!std::isnan(sink)) mx = mx > sink ? mx : sink;
  double sum = 0.0;
  for (int64_t t0 = 0; t0 < S; t0 += GW) {
    float e[16] = {};
    const int64_t m = S - t0 < GW ? S - t0 : GW;
    if (!exp16(s + t0, m, mx, e))
      for (int64_t t = 0; t < m; ++t) e[t] = ggml_expf(s[t0 + t] - mx);
    for (int64_t t = 0; t < m; ++t) s[t0 + t] = e[t];
    sum += (double)hsum_gw(e);
  }
  if (!std::isnan(sink)) sum += (double)expf(sink - mx);
  const float inv = (float)(1.0 / sum);
  int64_t t = store_f16x16(s, S, inv, p16);
  for (; t < S; ++t) p16[t] = float_to_half(s[t] * inv);
}

// Attention of T query tokens at positions p0.. in ggml's numerics: q (T, n_head * hd) f32 after
// RoPE; the f16 caches hold rows of n_kv * hd per position (0 .. p0 + T - 1 filled); query head h
// reads kv head h / (n_head / n_kv); out (T, n_head * hd). One token follows llama.cpp's
// one-token order (ggml_vec_dot_f16), a batch its tinyBLAS order where that kernel applies
// (head_dim % GW == 0 for q·k, head_dim % 4 == 0 for the weighted sum of v). The scores'
// scale (0: 1/sqrt(hd)) applies in the softmax, or to q before its f16 rounding (scale_q: the
// graphs that ggml_scale q, gemma's and phi3's); softcap > 0 caps the scores at
// softcap·tanh(s/softcap); window > 0 masks the keys more than window - 1 positions back. Values
// may have their own head size hv and both caches their own row strides (k_ld, v_ld elements; 0:
// n_kv * hd and n_kv * hv): a latent cache's values are the first hv dims of its key rows (MLA).
// sinks (n_head, or null): each head's sink logit in its softmax (softmax_f16).
static int attn_ggml(const float* q, const uint16_t* kc, const uint16_t* vc, int64_t p0, int64_t T,
                     int64_t n_head, int64_t n_kv, int64_t hd, float* out, int nthreads,
                     float qk_scale = 0.0f, bool scale_q = false, float softcap = 0.0f,
                     int64_t window = 0, int64_t hv = 0, int64_t k_ld = 0, int64_t v_ld = 0,
                     const float* sinks = nullptr) {
  hv = hv ? hv : hd;
  const bool one_kq = T == 1 || hd % GW, one_kqv = T == 1 || hv % 4;
  const int64_t nkv = k_ld ? k_ld : n_kv * hd, vld = v_ld ? v_ld : n_kv * hv;
  const int64_t group = n_head / n_kv, S = p0 + T;
  const float qs = qk_scale > 0.0f ? qk_scale : 1.0f / std::sqrt((float)hd);
  const float scale = scale_q ? 1.0f : qs, cap_inv = softcap > 0.0f ? 1.0f / softcap : 0.0f;
  const int nt = team_size(nthreads, T * S * nkv * 8 * group);
  // jobs (token, head) in chunks handed out as threads finish, the last tokens' first: a causal
  // prompt's later tokens see more cells (a fixed half each left one thread 3/4 of the work)
  const int64_t jobs = T * n_head, lanes = (one_kqv ? 4 : 1) * GW;
  return run_dynamic(nt, jobs, 1, [&](int64_t a, int64_t b) -> int {
    std::vector<float> s(S), acc(lanes * hv);
    std::vector<uint16_t> q16(hd), p16(S);
    for (int64_t job = jobs - b; job < jobs - a; ++job) {
      const int64_t i = job / n_head, h = job % n_head, n = p0 + i + 1;  // cells seen
      const int64_t off = h / group * hd;
      const float* qi = q + i * n_head * hd + h * hd;
      for (int64_t e = 0; e < hd; ++e) q16[e] = float_to_half(scale_q ? qi[e] * qs : qi[e]);
      const int64_t c0 = window > 0 && n > window ? n - window : 0;  // the window's first cell
      const int64_t t0 = c0 + kq_cells16(kc + c0 * nkv, nkv, off, hd, one_kq, q16.data(), n - c0,
                                         s.data() + c0);
      for (int64_t t = t0; t < n; ++t) s[t] = dot_f16(kc + t * nkv + off, q16.data(), hd, one_kq);
      if (softcap > 0.0f)  // ggml_scale, ggml_tanh, ggml_scale
        for (int64_t t = c0; t < n; ++t) s[t] = tanhf(s[t] * cap_inv) * softcap;
      for (int64_t t = 0; t < c0; ++t) s[t] = -INFINITY;  // the mask: exp 0, weight 0
      softmax_f16(s.data(), n, scale, p16.data(), sinks ? sinks[h] : NAN);
      // out[d] = dot over cells of v[., d] and p16, cell t in lane (t / GW) % 4 (one token) or
      // 0, and t % GW; the padding cells of llama.cpp's cache add zeros, which change no sum.
      float* o = out + i * n_head * hv + h * hv;
      const int64_t voff = h / group * hv;
      if (kqv16(vc, vld, voff, hv, n, one_kqv, p16.data(), s.data(), o)) continue;
      std::fill(acc.begin(), acc.end(), 0.0f);  // (lanes, hv): lane-major sums
      for (int64_t t = 0; t < n; ++t) {
        const vf p = v_set1(half_to_float(p16[t]));
        float* ac = acc.data() + ((one_kqv ? (t / GW) % 4 * GW : 0) + t % GW) * hv;
        const uint16_t* vr = vc + t * vld + voff;
        int64_t d = 0;
        for (; d + VL <= hv; d += VL) v_store(ac + d, v_fma(v_load_h(vr + d), p, v_load(ac + d)));
        for (; d < hv; ++d) ac[d] = std::fma(half_to_float(vr[d]), half_to_float(p16[t]), ac[d]);
      }
      // lane l: (accumulators 0 + 2) + (1 + 3) for one token; then the GW lanes reduced as
      // ggml_vec_dot_f16 (one token) or tinyBLAS (a batch) does, VL dims at a time
      int64_t d0 = 0;
      for (; d0 + VL <= hv; d0 += VL) {
        const float* c = acc.data() + d0;
        vf L[16];
        for (int l = 0; l < GW; ++l)
          L[l] = one_kqv ? v_add(v_add(v_load(c + l * hv), v_load(c + (2 * GW + l) * hv)),
                                 v_add(v_load(c + (GW + l) * hv), v_load(c + (3 * GW + l) * hv)))
                         : v_load(c + l * hv);
        v_store(o + d0, one_kqv ? vreduce_gw(L) : hsum_gw(L));
      }
      for (int64_t d = d0; d < hv; ++d) {
        const float* c = acc.data() + d;
        float lanes[16];
        for (int l = 0; l < GW; ++l)
          lanes[l] = one_kqv ? (c[l * hv] + c[(2 * GW + l) * hv]) + (c[(GW + l) * hv] + c[(3 * GW + l) * hv])
                             : c[l * hv];
        o[d] = one_kqv ? vreduce_gw(lanes) : hsum_gw(lanes);
      }
    }
    return 0;
  });
}
