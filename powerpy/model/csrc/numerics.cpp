// The float steps of llama.cpp's graph as exports (numerics.h): RoPE tables and RoPE, attention over
// f16 caches (and DeepSeek-2's latent one), the GELU table, soft-cap, RMSNorm and LayerNorm, GELU
// and SwiGLU, each in ggml's order of operations.

#include "blocks.h"    // rope_heads, the decode blocks' RoPE
#include "numerics.h"

extern "C" {

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

// YaRN's table (ggml's rope_yarn, ggml_rope_yarn_corr_dims): as pp_rope_table_ext, but pair j's
// angle mixes the interpolated freq_scale * theta' and the extrapolated theta' = theta /
// factors[j] by ramp_j * ext_factor, ramp_j 1 below the corner dims (from n_ctx_orig and the
// betas) and 0 above, and cos and sin are multiplied by mscale * (1 + 0.1 * logf(1 /
// freq_scale)). ggml's build fuses the first product of each sum into an FMA (as in its RoPE).
void pp_rope_table_yarn(const int64_t* pos, int64_t n, int64_t n_rot, float base, float freq_scale,
                        const float* factors, float mscale, float ext_factor, int64_t n_ctx_orig,
                        float beta_fast, float beta_slow, float* out) {
  const float theta_scale = powf(base, -2.0f / (float)n_rot);
  const auto corr_dim = [&](float beta) {
    return (float)n_rot * logf((float)n_ctx_orig / (beta * 2 * (float)M_PI)) / (2 * logf(base));
  };
  const float lo = std::max(0.0f, floorf(corr_dim(beta_fast)));
  const float hi = std::min((float)(n_rot - 1), ceilf(corr_dim(beta_slow)));
  const float ms = ext_factor != 0.0f ? mscale * std::fma(0.1f, logf(1.0f / freq_scale), 1.0f)
                                      : mscale;
  for (int64_t i = 0; i < n; ++i) {
    float theta = (float)pos[i];
    for (int64_t j = 0; j < n_rot / 2; ++j, theta *= theta_scale) {
      const float extrap = theta / (factors ? factors[j] : 1.0f), interp = freq_scale * extrap;
      float t = interp;
      if (ext_factor != 0.0f) {
        const float y = ((float)j - lo) / std::max(0.001f, hi - lo);  // j = i0 / 2
        const float mix = (1 - std::min(1.0f, std::max(0.0f, y))) * ext_factor;
        t = std::fma(interp, 1 - mix, extrap * mix);
      }
      out[(i * (n_rot / 2) + j) * 2] = cosf(t) * ms;
      out[(i * (n_rot / 2) + j) * 2 + 1] = sinf(t) * ms;
    }
  }
}

// The plain table: no scaling, no factors.
void pp_rope_table(const int64_t* pos, int64_t n, int64_t n_rot, float base, float* out) {
  pp_rope_table_ext(pos, n, n_rot, base, 1.0f, nullptr, 1.0f, out);
}

// RoPE in place: x (T, heads, hd) f32, the first n_rot dims of each head in adjacent pairs
// (neox 0) or pairs (i, i + n_rot / 2) (neox 1), rot (T, n_rot / 2, 2) (cos, sin) per token.
void pp_rope(float* x, int64_t T, int64_t heads, int64_t hd, int64_t n_rot, const float* rot,
             int neox) {
  for (int64_t t = 0; t < T; ++t)
    rope_heads(x + t * heads * hd, heads, hd, n_rot, neox, rot + t * n_rot);
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
// a soft-cap (0: none), a sliding window (0: none) and the heads' sinks (null: none), as
// attn_ggml takes them.
int pp_attn_ext(const float* q, const uint16_t* kc, const uint16_t* vc, int64_t p0, int64_t T,
                int64_t n_head, int64_t n_kv, int64_t hd, float scale, int scale_q, float softcap,
                int64_t window, const float* sinks, float* out, int nthreads) {
  if (T < 1 || n_kv < 1 || n_head % n_kv || window < 0) return PP_ERR_ARG;
  return attn_ggml(q, kc, vc, p0, T, n_head, n_kv, hd, out, nthreads, scale, scale_q != 0,
                   softcap, window, 0, 0, 0, sinks);
}

// The latent attention of DeepSeek-2 (MLA, absorbed as llama.cpp computes it): n_head queries
// of hk dims per token over one f16 cache of rows of hk dims (the latent, then the RoPE dims),
// whose first hv dims are the values; scale as pp_attn_ext's. out (T, n_head * hv).
int pp_attn_mla(const float* q, const uint16_t* kc, int64_t p0, int64_t T, int64_t n_head,
                int64_t hk, int64_t hv, float scale, float* out, int nthreads) {
  if (T < 1 || n_head < 1 || hv < 1 || hv > hk) return PP_ERR_ARG;
  return attn_ggml(q, kc, kc, p0, T, n_head, 1, hk, out, nthreads, scale, false, 0.0f, 0, hv, hk,
                   hk);
}

// ggml's GELU table (ggml_table_gelu_f16): for each f16 bit pattern i, the f16 of ggml_gelu_f32
// of its value (common.h gelu_table: the expression written as ggml writes it, so that the
// compiler fuses the same multiply-add (1 + a·x·x); tanh-form values near an f16 rounding
// midpoint depend on it). The native blocks read the same table.
void pp_gelu_table(uint16_t* out) { std::memcpy(out, gelu_table(), sizeof(uint16_t) * 65536); }

// x[i] = tanhf(x[i] * (1 / cap)) * cap in place (llama.cpp's soft-cap: ggml_scale, ggml_tanh,
// ggml_scale).
void pp_softcap(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t i = 0; i < n; ++i) x[i] = tanhf(x[i] * inv) * cap;
}

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w for T rows of n (ggml's rms_norm, then mul).
void pp_rms_norm(const float* x, const float* w, int64_t T, int64_t n, float eps, float* y,
                 int nthreads) {
  run_partitioned(team_size(nthreads, T * n * 64), T, [&](int64_t a, int64_t b) -> int {
    for (int64_t t = a; t < b; ++t) rms_norm(x + t * n, w, n, eps, y + t * n);
    return 0;
  });
}

// y[t] = (x[t] - mean) / sqrt(var + eps) * w + b for T rows of n (ggml's norm, mul, add; b may be
// null).
void pp_layer_norm(const float* x, const float* w, const float* b, int64_t T, int64_t n, float eps,
                   float* y, int nthreads) {
  run_partitioned(team_size(nthreads, T * n * 64), T, [&](int64_t t0, int64_t t1) -> int {
    for (int64_t t = t0; t < t1; ++t) layer_norm(x + t * n, w, b, n, eps, y + t * n);
    return 0;
  });
}

// y = GELU(x) for n values: ggml's (its f16 table) with act, else the erf form (y may be x).
void pp_gelu(const float* x, int64_t n, float* y, int act, int nthreads) {
  const uint16_t* t = gelu_lut(act);
  run_partitioned(team_size(nthreads, n * 64), n, [&](int64_t a, int64_t b) -> int {
    for (int64_t i = a; i < b; ++i) y[i] = gelu(x[i], t);
    return 0;
  });
}

// out = silu(g) * u elementwise (ggml's swiglu; out may alias g or u).
void pp_swiglu(const float* g, const float* u, int64_t n, float* out, int nthreads) {
  const int nt = team_size(nthreads, n * 64);
  run_partitioned(nt, n, [&](int64_t a, int64_t b) -> int {
    swiglu_range(g, u, a, b, out);
    return 0;
  });
}

}  // extern "C"
