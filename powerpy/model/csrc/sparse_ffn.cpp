// powerpy CPU kernels for the predictor-gated sparse FFN (batch-1 decode) and quantized GEMM.
//
// Built by powerpy/model/kernel_build.py with `g++ -O3 -march=native -fopenmp -shared` and called
// through ctypes with tensor data pointers. Everything exported is extern "C" (this file); no torch
// headers. One translation unit (a unity build): this file includes the others in csrc/ in the
// order below, and the build's cache key hashes every file of csrc/.
//
// Matrices are row-major (nrows, cols) with a row stride of `ld` bytes; FFN matrices are
// neuron-major (n_ff, n_embd), so a sparse FFN reads whole rows. A row is processed in
// 32-element chunks, decoded in registers: decoded values equal the dequantized weights exactly
// (q * d is exact in f32), and all accumulation is f32. Dot products with quantized weights
// round x as llama.cpp does (Q8_0 / Q8_1 / Q8_K blocks) and take integer block sums, unless the
// caller asks for f32 activations; Q4_0 runs four blocks per 512-bit step where AVX-512 VBMI is
// there. Row sums (axpy) decode the weights to f32 and add four rows per pass.
//
// The main speed lever is a software prefetch of the row `dist` indices ahead into L2, spread
// over the current row's loop (docs/kernels.md#prefetch); `dist` covers at least
// g_prefetch_bytes and is at least 2 rows.
//
// SIMD is chosen at compile time (simd.h): AVX-512F (16 lanes), AVX2+FMA+F16C (8 lanes), or
// scalar. Return codes: 0 ok, 1 an index was out of range (that output is NaN / that row skipped),
// 2 bad argument (unknown dtype or variant, cols not a multiple of the block size).

#include "common.h"          // codes shared with Python, scalar helpers, prefetch, threads
#include "simd.h"            // the ISA: vectors, block decoders, byte dots, ggml's exp
#include "quants.h"          // block layouts and decoders, quantized activations
#include "vec.h"             // the tile template and the row kernels
#include "ops.h"             // GEMV, GLU, axpy, GEMM, dequant over rows; the row engine
#include "wide_avx512.h"     // AVX-512 VNNI prompt tiles
#include "q4_0_avx512.h"     // Q4_0's own AVX-512 kernels
#include "numerics.h"        // attention, and llama.cpp's float steps

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
};

static int mat_gemv(const Mat& m, const float* x, const int64_t* idx, int64_t k, float* out,
                    int act, int nt) {
  if (!valid_shape(m.dtype, m.cols)) return PP_ERR_ARG;
  PP_DISPATCH(m.dtype, gemv_impl, m.w, m.ld, m.nrows, m.cols, x, idx, k, out, act, nt)
}

// out[i] = m[i] x for matrices of one type and width (see gemv_multi_impl).
static int mat_gemv_multi(const Mat* m, int nm, const float* x, float* const* out, int act,
                          int nt) {
  const uint8_t* w[4];
  int64_t ld[4], nrows[4];
  if (nm < 1 || nm > 4 || !valid_shape(m[0].dtype, m[0].cols)) return PP_ERR_ARG;
  for (int i = 0; i < nm; ++i) {
    if (m[i].dtype != m[0].dtype || m[i].cols != m[0].cols) return PP_ERR_ARG;
    w[i] = m[i].w;
    ld[i] = m[i].ld;
    nrows[i] = m[i].nrows;
  }
  PP_DISPATCH(m[0].dtype, gemv_multi_impl, w, ld, nrows, nm, m[0].cols, x, out, act, nt)
}

static int mat_glu(const Mat& g, const Mat& u, const float* x, const int64_t* idx, int64_t k,
                   int variant, float* out, int act, int nt) {
  if (!valid_shape(u.dtype, u.cols) || g.dtype != u.dtype) return PP_ERR_ARG;
  PP_DISPATCH(u.dtype, glu_impl, g.w, g.ld, u.w, u.ld, u.nrows, u.cols, x, idx, k, variant, out,
              act, nt)
}

static int mat_axpy(const Mat& m, const float* h, const int64_t* idx, int64_t k, float* out,
                    int nt, const float* tau = nullptr, int64_t* kept = nullptr) {
  if (!valid_shape(m.dtype, m.cols)) return PP_ERR_ARG;
  PP_DISPATCH(m.dtype, axpy_impl, m.w, m.ld, m.nrows, m.cols, h, idx, k, out, 0, nt, tau, kept)
}

#include "moe.h"  // mixtures of experts: the router in llama.cpp's order, the decode block

extern "C" {

// One token's attention block in one call (CPU-only decode): xn = rms_norm(x) * norm_w; q, k,
// v = W·xn; RoPE on the first n_rot
// dims of each head (adjacent pairs times rot[i] = (cos, sin)); k, v written to the cache row
// `pos` (f32 or f16: cdt 0 / 1, rows of n_kv * hd); each query head h reads kv head
// h / (n_head / n_kv) over positions 0..pos; out = W_o · attention. mats: 4 x 5 int64 (q, k,
// v, output); out = x + W_o · attention (the residual stream). Returns 0 or a status.
int pp_attn_decode(const int64_t* mats, const float* x, const float* norm_w, float eps,
                   const float* rot, int64_t n_rot, int64_t n_head, int64_t n_kv, int64_t hd,
                   void* kc, void* vc, int cdt, int64_t pos, float* out, int act, int nthreads) {
  const Mat wq(mats), wk(mats + 5), wv(mats + 10), wo(mats + 15);
  const int64_t nq = n_head * hd, nkv = n_kv * hd, S = pos + 1, group = n_head / n_kv;
  if (wq.nrows != nq || wk.nrows != nkv || wv.nrows != nkv || wo.cols != nq || n_rot > hd ||
      n_rot % 2 || n_head % n_kv || (cdt != 0 && cdt != 1))
    return PP_ERR_ARG;
  const int64_t d = wq.cols;
  float* buf = (float*)std::malloc(sizeof(float) * (2 * nq + 2 * nkv + n_head * S + 2 * d));
  if (!buf) return PP_ERR_ARG;
  float *q = buf, *k = q + nq, *v = k + nkv, *att = v + nkv, *sc = att + nq, *xn = sc + n_head * S;
  float* y = xn + d;
  rms_norm(x, norm_w, d, eps, xn);
  int st;
  if (wq.dtype == wk.dtype && wq.dtype == wv.dtype && wk.cols == d && wv.cols == d) {
    const Mat qkv[3] = {wq, wk, wv};
    float* const outs[3] = {q, k, v};
    st = mat_gemv_multi(qkv, 3, xn, outs, act, nthreads);
  } else {
    st = mat_gemv(wq, xn, nullptr, nq, q, act, nthreads);
    if (!st) st = mat_gemv(wk, xn, nullptr, nkv, k, act, nthreads);
    if (!st) st = mat_gemv(wv, xn, nullptr, nkv, v, act, nthreads);
  }
  if (st) {
    std::free(buf);
    return st;
  }
  auto rope = [&](float* y, int64_t heads) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < n_rot / 2; ++i) rope_pair(y + h * hd + 2 * i, rot[2 * i], rot[2 * i + 1]);
  };
  rope(q, n_head);
  rope(k, n_kv);
  for (int64_t i = 0; i < nkv; ++i) {  // the cache row of this position
    if (cdt == 0) {
      ((float*)kc)[pos * nkv + i] = k[i];
      ((float*)vc)[pos * nkv + i] = v[i];
    } else {
      ((uint16_t*)kc)[pos * nkv + i] = float_to_half(k[i]);
      ((uint16_t*)vc)[pos * nkv + i] = float_to_half(v[i]);
    }
  }
  const float scale = 1.0f / std::sqrt((float)hd);
  const int nt = team_size(nthreads, S * nkv * 8 * group);
  if (cdt == 1 && act)  // llama.cpp's numerics (see attn_ggml)
    st = attn_ggml(q, (const uint16_t*)kc, (const uint16_t*)vc, pos, 1, n_head, n_kv, hd, att,
                   nthreads);
  else run_partitioned(nt, n_head, [&](int64_t h0, int64_t h1) -> int {
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t off = h / group * hd;  // this head's kv head, within a cache row
      const float* qh = q + h * hd;
      float* s = sc + h * S;
      float mx = -INFINITY;
      for (int64_t t = 0; t < S; ++t) {
        s[t] = kv_dot(qh, kc, cdt, t * nkv + off, hd) * scale;
        mx = s[t] > mx ? s[t] : mx;
      }
      float sum = 0.0f;
      for (int64_t t = 0; t < S; ++t) sum += (s[t] = std::exp(s[t] - mx));
      float* o = att + h * hd;
      for (int64_t i = 0; i < hd; ++i) o[i] = 0.0f;
      for (int64_t t = 0; t < S; ++t) kv_axpy(s[t] / sum, vc, cdt, t * nkv + off, hd, o);
    }
    return 0;
  });
  if (!st) st = mat_gemv(wo, att, nullptr, wo.nrows, y, act, nthreads);
  for (int64_t i = 0; i < d && !st; ++i) out[i] = x[i] + y[i];
  std::free(buf);
  return st;
}

// One token's FFN block in one call (CPU-only decode): with a predictor (mats 0, 1 = fc1, fc2),
// the neurons j with fc2·relu(fc1·r) >= thr for the residual r; without (mats 0, 1 zero), all
// of them. Then xn = rms_norm(r) * norm_w, h_j = act(gate_j·xn, up_j·xn) and
// out = r + sum_j h_j down_t[j]. With tau (n_ff per-neuron cuts, or null), a computed neuron
// with |h_j| < tau[j] is dropped before the down rows are read. mats: 5 x 5 int64 (Mat) for fc1,
// fc2, gate, up, down_t; with down_stored (a dense GGUF's ffn_down, (n_embd, n_ff) as stored),
// mat 4 is ffn_down and out = ffn_down · h (no predictor and no cut then). Returns the number of
// neurons whose down row was added, or -status.
int64_t pp_ffn_decode(const int64_t* mats, float thr, const float* tau, const float* r,
                      const float* norm_w, float eps, int variant, int down_stored, float* out,
                      int act, int nthreads) {
  const Mat fc1(mats), fc2(mats + 5), gate(mats + 10), up(mats + 15), down(mats + 20);
  const int64_t n_ff = up.nrows;
  if (variant < V_REGLU || variant > V_SWIGLU || gate.nrows != n_ff ||
      (down_stored ? down.cols != n_ff || fc1.w || tau : down.nrows != n_ff))
    return -PP_ERR_ARG;
  const int64_t H = fc1.w ? fc1.nrows : 0;
  const int64_t d = up.cols, nd = down_stored ? down.nrows : down.cols;
  float* buf =
      (float*)std::malloc(sizeof(float) * (H + 2 * n_ff + d + nd) + sizeof(int64_t) * n_ff);
  if (!buf) return -PP_ERR_ARG;
  float *z = buf, *logit = buf + H, *h = logit + n_ff, *x = h + n_ff, *y = x + d;
  int64_t* idx = (int64_t*)(y + nd);
  const float* xp = r;
  rms_norm(r, norm_w, d, eps, x);
  int64_t k = n_ff;
  int st = 0;
  const int64_t* sel = nullptr;
  if (fc1.w) {
    if (fc2.nrows != n_ff || fc2.cols != H) st = PP_ERR_ARG;
    if (!st) st = mat_gemv(fc1, xp, nullptr, H, z, act, nthreads);
    for (int64_t i = 0; i < H && !st; ++i) z[i] = z[i] > 0.0f ? z[i] : 0.0f;
    if (!st) st = mat_gemv(fc2, z, nullptr, n_ff, logit, act, nthreads);
    k = 0;
    for (int64_t j = 0; j < n_ff && !st; ++j)
      if (logit[j] >= thr) idx[k++] = j;
    sel = idx;
  }
  if (!st && k) st = mat_glu(gate, up, x, sel, k, variant, h, act, nthreads);
  int64_t kept = k;  // with a cut: the rows the down pass really adds
  if (!st) {
    if (down_stored) {
      st = mat_gemv(down, h, nullptr, down.nrows, y, act, nthreads);
    } else if (k) {
      st = mat_axpy(down, h, sel, k, y, nthreads, tau, tau ? &kept : nullptr);
    } else {
      kept = 0;
      std::memset(y, 0, sizeof(float) * nd);
    }
  }
  for (int64_t i = 0; i < nd && !st; ++i) out[i] = r[i] + y[i];
  std::free(buf);
  return st ? -st : kept;
}

// One token through every block (CPU-only decode), one call per token instead of two per layer:
// per layer the attention block (pp_attn_decode) then the FFN block (pp_ffn_decode), x (n_embd)
// updated in place. layers: n_layer records of REC_LEN (49) int64 (common.h): attention mats q,
// k, v, output (20), FFN mats fc1, fc2, gate, up, down (25; fc1 and fc2 zero: dense), then
// attn_norm, ffn_norm, down_stored and the FFN's cut tau (zero: none); down_stored 2 is a mixture
// of experts (pp_moe_decode: FFN mats router, gate, up, down, then k, norm and the scale's bits).
// Layer l's keys and values are at
// kc/vc + l * layer_bytes; rot holds (cos, sin) per pair; counts[l] receives the number of
// neurons whose down rows layer l added. Returns 0 or the first failing status.
int pp_decode_layers(int64_t n_layer, const int64_t* layers, float eps, const float* rot,
                     int64_t n_rot, int64_t n_head, int64_t n_kv, int64_t hd, void* kc, void* vc,
                     int64_t layer_bytes, int cdt, int64_t pos, float thr, int variant, float* x,
                     int64_t* counts, int act, int nthreads) {
  if (n_layer <= 0) return 0;
  const int64_t d = layers[4];  // attn_q's cols
  float* y = (float*)std::malloc(sizeof(float) * d);
  if (!y) return PP_ERR_ARG;
  int st = 0;
  for (int64_t l = 0; l < n_layer && !st; ++l) {
    const int64_t* rec = layers + REC_LEN * l;
    if (rec[4] != d) {
      st = PP_ERR_ARG;
      break;
    }
    st = pp_attn_decode(rec + REC_ATTN, x, (const float*)rec[REC_ATTN_NORM], eps, rot, n_rot,
                        n_head, n_kv, hd, (char*)kc + l * layer_bytes,
                        (char*)vc + l * layer_bytes, cdt, pos, y, act, nthreads);
    if (st) break;
    const int64_t* f = rec + REC_FFN;
    int64_t k;
    if (rec[REC_DOWN_STORED] == 2) {  // a mixture of experts: router, gate, up, down stacks,
      float scale;                    // then k, norm and the scale's bits in the fifth slot
      std::memcpy(&scale, &f[22], sizeof(float));
      k = pp_moe_decode(f, f[20], (int)f[21], scale, (const float*)rec[REC_TAU], y,
                        (const float*)rec[REC_FFN_NORM], eps, x, nullptr, nullptr, act, nthreads);
    } else {
      k = pp_ffn_decode(f, thr, (const float*)rec[REC_TAU], y, (const float*)rec[REC_FFN_NORM],
                        eps, variant, (int)rec[REC_DOWN_STORED], x, act, nthreads);
    }
    if (k < 0) st = (int)-k;
    else counts[l] = k;
  }
  std::free(y);
  return st;
}

// ggml's RoPE angles (ggml_rope_cache_init without YaRN): for each position p = pos[i],
// theta = p and, pair by pair, (cosf, sinf) of freq_scale * (theta / factors[j]) times mscale,
// then theta *= base^(-2 / n_rot), all in f32. factors (n_rot / 2) may be NULL (all 1: llama-3's
// rope_freqs, phi3's long/short factors otherwise). out (n, n_rot / 2, 2).
void pp_rope_table_ext(const int64_t* pos, int64_t n, int64_t n_rot, float base, float freq_scale,
                       const float* factors, float mscale, float* out) {
  const float theta_scale = powf(base, -2.0f / (float)n_rot);
  for (int64_t i = 0; i < n; ++i) {
    float theta = (float)pos[i];
    for (int64_t j = 0; j < n_rot / 2; ++j, theta *= theta_scale) {
      const float t = freq_scale * (theta / (factors ? factors[j] : 1.0f));
      out[(i * (n_rot / 2) + j) * 2] = cosf(t) * mscale;
      out[(i * (n_rot / 2) + j) * 2 + 1] = sinf(t) * mscale;
    }
  }
}

// The plain table: no scaling, no factors.
void pp_rope_table(const int64_t* pos, int64_t n, int64_t n_rot, float base, float* out) {
  pp_rope_table_ext(pos, n, n_rot, base, 1.0f, nullptr, 1.0f, out);
}

// RoPE in place: x (T, heads, hd) f32, the first n_rot dims of each head in adjacent pairs,
// rot (T, n_rot / 2, 2) (cos, sin) per token.
void pp_rope(float* x, int64_t T, int64_t heads, int64_t hd, int64_t n_rot, const float* rot) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < n_rot / 2; ++i)
        rope_pair(x + (t * heads + h) * hd + 2 * i, rot[(t * (n_rot / 2) + i) * 2],
                  rot[(t * (n_rot / 2) + i) * 2 + 1]);
}

// Causal attention of T tokens at positions p0.. over f16 caches in llama.cpp's numerics
// (attn_ggml): q (T, n_head * hd) after RoPE, caches (n_ctx, n_kv * hd) filled up to p0 + T,
// out (T, n_head * hd). Returns 0 or a status.
int pp_attn(const float* q, const uint16_t* kc, const uint16_t* vc, int64_t p0, int64_t T,
            int64_t n_head, int64_t n_kv, int64_t hd, float* out, int nthreads) {
  if (T < 1 || n_kv < 1 || n_head % n_kv) return PP_ERR_ARG;
  return attn_ggml(q, kc, vc, p0, T, n_head, n_kv, hd, out, nthreads);
}

// pp_attn with a scale of the scores (0: 1/sqrt(hd)) applied to q (scale_q) or in the softmax,
// a soft-cap (0: none) and a sliding window (0: none), as attn_ggml takes them.
int pp_attn_ext(const float* q, const uint16_t* kc, const uint16_t* vc, int64_t p0, int64_t T,
                int64_t n_head, int64_t n_kv, int64_t hd, float scale, int scale_q, float softcap,
                int64_t window, float* out, int nthreads) {
  if (T < 1 || n_kv < 1 || n_head % n_kv || window < 0) return PP_ERR_ARG;
  return attn_ggml(q, kc, vc, p0, T, n_head, n_kv, hd, out, nthreads, scale, scale_q != 0,
                   softcap, window);
}

// ggml's GELU table (ggml_table_gelu_f16): for each f16 bit pattern i, the f16 of ggml_gelu_f32
// of its value, the expression written as ggml writes it, so that the compiler fuses the same
// multiply-add (1 + a·x·x); tanh-form values near an f16 rounding midpoint depend on it.
void pp_gelu_table(uint16_t* out) {
  const float a = 0.044715f, s = 0.79788456080286535587989211986876f;
  for (int i = 0; i < 65536; ++i) {
    const float x = half_to_float((uint16_t)i);
    out[i] = float_to_half(0.5f * x * (1.0f + tanhf(s * x * (1.0f + a * x * x))));
  }
}

// x[i] = tanhf(x[i] * (1 / cap)) * cap in place (llama.cpp's soft-cap: ggml_scale, ggml_tanh,
// ggml_scale).
void pp_softcap(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t i = 0; i < n; ++i) x[i] = tanhf(x[i] * inv) * cap;
}

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w for T rows of n (ggml's rms_norm, then mul).
void pp_rms_norm(const float* x, const float* w, int64_t T, int64_t n, float eps, float* y) {
  for (int64_t t = 0; t < T; ++t) rms_norm(x + t * n, w, n, eps, y + t * n);
}

// out = silu(g) * u elementwise (ggml's swiglu; out may alias g or u).
void pp_swiglu(const float* g, const float* u, int64_t n, float* out, int nthreads) {
  const int nt = team_size(nthreads, n * 64);
  run_partitioned(nt, n, [&](int64_t a, int64_t b) -> int {
    swiglu_range(g, u, a, b, out);
    return 0;
  });
}

// Bumped whenever a signature changes; kernels.py refuses a library with another version.
int pp_abi_version(void) { return PP_ABI_VERSION; }

// The int64 per layer record of pp_decode_layers (kernels.py checks its LAYER_RECORD_LEN).
int pp_layer_record_len(void) { return REC_LEN; }

// The dtype code (enum DType) of ggml type id ggml_type, or -1 when the kernels do not read it
// (kernels.py checks its DTYPE_CODES against this).
int pp_dtype_code(int ggml_type) {
  for (int dt = 0; dt < DT_COUNT; ++dt)
    if (GGML_TYPE_OF[dt] == ggml_type) return dt;
  return -1;
}

// 2 = AVX-512F, 1 = AVX2+FMA+F16C, 0 = scalar.
int pp_simd_level(void) { return PP_SIMD; }

// Tuning knobs (process-wide): prefetch reach in bytes, and work per thread before a 2nd thread.
void pp_set_tuning(int64_t prefetch_bytes, int64_t min_bytes_per_thread) {
  if (prefetch_bytes >= 0) g_prefetch_bytes = prefetch_bytes;
  if (min_bytes_per_thread > 0) g_min_bytes_per_thread = min_bytes_per_thread;
}

// out[j] = dot(W[idx[j]], x) for j < k; idx == NULL means rows 0..k-1 (dense GEMV).
int pp_gather_gemv(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols,
                   const float* x, const int64_t* idx, int64_t k, float* out, int act,
                   int nthreads) {
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  PP_DISPATCH(dtype, gemv_impl, (const uint8_t*)W, ld, nrows, cols, x, idx, k, out, act, nthreads)
}

// out (+)= sum_{j: h[j] != 0} h[j] * W[idx[j]]; out is zeroed first unless accumulate.
int pp_gather_axpy(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols,
                   const float* h, const int64_t* idx, int64_t k, float* out, int accumulate,
                   int nthreads) {
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  PP_DISPATCH(dtype, axpy_impl, (const uint8_t*)W, ld, nrows, cols, h, idx, k, out, accumulate,
              nthreads)
}

// out[j] = act(G[idx[j]]·x, U[idx[j]]·x) (variant 0 reglu, 1 drelu, 2 swiglu).
int pp_glu_gemv(int dtype, const void* G, int64_t ldg, const void* U, int64_t ldu, int64_t nrows,
                int64_t cols, const float* x, const int64_t* idx, int64_t k, int variant,
                float* out, int act, int nthreads) {
  if (!valid_shape(dtype, cols) || variant < V_REGLU || variant > V_SWIGLU || !G) return PP_ERR_ARG;
  const uint8_t* g = (const uint8_t*)G;
  PP_DISPATCH(dtype, glu_impl, g, ldg, (const uint8_t*)U, ldu, nrows, cols, x, idx, k, variant,
              out, act, nthreads)
}

// out[t * ldo + r] = dot(W[r], x[t * ldx : t * ldx + cols]) for r < nrows, t < T. need (may be
// null) is (T, nrows) bytes: where need[t * nrows + r] is 0 the caller ignores out[t * ldo + r],
// and the Q4_0 integer GEMM skips (writes 0 to) the row pairs and 8-token tiles no token needs.
int pp_gemm(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
            int64_t ldx, int64_t T, float* out, int64_t ldo, const uint8_t* need, int act,
            int nthreads) {
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  PP_DISPATCH(dtype, gemm_impl, (const uint8_t*)W, ld, nrows, cols, x, ldx, T, out, ldo, need,
              act, nthreads)
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
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  PP_DISPATCH(dtype, dequant_impl, (const uint8_t*)W, ld, nrows, cols, idx, k, out, nthreads)
}

}  // extern "C"
