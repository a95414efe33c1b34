// powerpy CPU kernels for the predictor-gated sparse FFN (batch-1 decode) and quantized GEMM.
//
// Built by powerpy/model/kernel_build.py with `g++ -O3 -march=native -fopenmp -shared` and called
// through ctypes with tensor data pointers. Everything exported is extern "C" (this file); no torch
// headers. One translation unit: every header of csrc/ includes what it uses (#pragma once), and
// the build's cache key hashes every file of csrc/.
//
// Matrices are row-major (nrows, cols) with a row stride of `ld` bytes; FFN matrices are
// neuron-major (n_ff, n_embd), so a sparse FFN reads whole rows. A row is processed in
// 32-element chunks, decoded in registers: decoded values equal the dequantized weights exactly
// (q * d is exact in f32), and all accumulation is f32. Dot products with quantized weights
// round x as llama.cpp does (Q8_0 / Q8_1 / Q8_K blocks) and take integer block sums, unless the
// caller asks for f32 activations. Row sums (axpy) decode the weights to f32 and add four rows
// per pass.
//
// The main speed lever is a software prefetch of the row `dist` indices ahead into L2, spread
// over the current row's loop (docs/kernels.md#prefetch); `dist` covers at least
// PREFETCH_BYTES (a build constant, common.h) and is at least 2 rows.
//
// SIMD is chosen at compile time (simd.h): AVX-512F (16 lanes), AVX2+FMA+F16C (8 lanes), or
// scalar. Return codes: 0 ok, 1 an index was out of range (that output is NaN / that row skipped),
// 2 bad argument (unknown dtype or variant, cols not a multiple of the block size).

#include "mat.h"         // every kernel, and Mat: a matrix as Python describes it
#include "blocks.h"      // the decode blocks of every family's layout (MoE layers: moe.h's)
#include "mla.h"         // DeepSeek-2's latent attention block
#include "host_tasks.h"  // a hybrid layer's cold rows, run on a worker for a CUDA stream

extern "C" {

// One token's attention block in one call (blocks.h attn_block): rec is the layer's record
// (common.h LayerRecord), x (n_embd) the residual stream, rot (n_rot / 2, 2) the (cos, sin) of
// this position (null: no RoPE), kc / vc one layer's cache (cdt 0: f32, 1: f16), out = x +
// attention. Returns 0 or a status.
int pp_attn_decode(const int64_t* rec, int64_t n_head, int64_t n_kv, int64_t hd, int64_t n_rot,
                   float eps, const float* rot, const float* x, void* kc, void* vc, int cdt,
                   int64_t pos, float* out, int act, int nthreads) {
  const Heads H{n_head, n_kv, hd, n_rot, eps};
  return attn_block(Layer(rec), H, rot, x, kc, vc, cdt, pos, out, act, nthreads);
}

// One token's FFN block in one call (blocks.h ffn_block): r the residual stream it adds to, xs
// the FFN's source (r, or the block's input in a parallel block), out = r + FFN (may be xs).
// Returns the number of neurons whose down rows were added, or -status.
int64_t pp_ffn_decode(const int64_t* rec, float eps, float thr, const float* r, const float* xs,
                      float* out, int act, int nthreads) {
  return ffn_block(Layer(rec), eps, thr, r, xs, out, act, nthreads);
}

// One token through every block (CPU-only decode), one call per token instead of two per layer:
// per layer the attention block then the FFN block, x (n_embd) updated in place. layers: n_layer
// records of REC_LEN int64 (common.h); rots[l]: layer l's (cos, sin) table (0: no RoPE). Layer
// l's keys and values are at kc/vc + l * layer_bytes; counts[l] receives the number of neurons
// whose down rows layer l added. phases (n_phases = PH_COUNT doubles, or null: untimed): the
// seconds of each blocks.h Phase are added to it. Returns 0 or the first failing status.
int pp_decode_layers(int64_t n_layer, const int64_t* layers, const int64_t* rots, int64_t n_head,
                     int64_t n_kv, int64_t hd, int64_t n_rot, float eps, void* kc, void* vc,
                     int64_t layer_bytes, int cdt, int64_t pos, float thr, float* x,
                     int64_t* counts, double* phases, int64_t n_phases, int act, int nthreads) {
  if (n_layer <= 0) return 0;
  if (phases && n_phases != PH_COUNT) return PP_ERR_ARG;
  const int64_t d = layers[REC_ATTN + 4];  // attn_q's cols
  const Heads H{n_head, n_kv, hd, n_rot, eps};
  float* y = (float*)std::malloc(sizeof(float) * d);
  if (!y) return PP_ERR_ARG;
  int st = 0;
  for (int64_t l = 0; l < n_layer && !st; ++l) {
    const Layer L(layers + REC_LEN * l);
    if (L.q.cols != d) {
      st = PP_ERR_ARG;
      break;
    }
    {
      const Lap lap(phases, PH_ATTENTION);
      st = attn_block(L, H, rec_ptr(rots[l]), x, (char*)kc + l * layer_bytes,
                      (char*)vc + l * layer_bytes, cdt, pos, y, act, nthreads, phases);
    }
    if (st) break;
    const Lap lap(phases, PH_FFN);
    const int64_t k =
        ffn_block(L, eps, thr, y, L.flags & LF_PARALLEL ? x : y, x, act, nthreads, phases);
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

// Bumped whenever a signature changes; kernels.py refuses a library with another version.
int pp_abi_version(void) { return PP_ABI_VERSION; }

// The int64 per layer record of the decode blocks (kernels.py checks its LAYER_RECORD_LEN).
int pp_layer_record_len(void) { return REC_LEN; }

// The record's layout, for kernels.py to check against its own (RECORD_LAYOUT): the slots of
// LayerRecord, the LF_* flags, then the variant codes, 31 int64 in all.
void pp_layer_record_layout(int64_t* out) {
  const int64_t v[] = {REC_ATTN, REC_FFN, REC_ATTN_NORM, REC_FFN_NORM, REC_POST_NORM,
                       REC_QK_NORM, REC_BIAS, REC_TAU, REC_FLAGS, REC_VARIANT, REC_WINDOW,
                       REC_SCALE, REC_SOFTCAP, REC_MOE, REC_SHEXP, REC_ROUTE, REC_MLA, REC_SINKS,
                       REC_LEN,
                       LF_LAYER_NORM, LF_ROPE,
                       LF_NEOX, LF_PARALLEL, LF_DOWN_STORED, LF_Q_SCALED, LF_MOE, LF_MLA, V_GEGLU,
                       V_RELU, V_GELU, V_COUNT};
  for (size_t i = 0; i < sizeof v / sizeof v[0]; ++i) out[i] = v[i];
}

// The dtype code (enum DType) of ggml type id ggml_type, or -1 when the kernels do not read it
// (kernels.py checks its DTYPE_CODES against this).
int pp_dtype_code(int ggml_type) {
  for (int dt = 0; dt < DT_COUNT; ++dt)
    if (GGML_TYPE_OF[dt] == ggml_type) return dt;
  return -1;
}

// 2 = AVX-512F, 1 = AVX2+FMA+F16C, 0 = scalar.
int pp_simd_level(void) { return PP_SIMD; }

// out[j] = dot(W[idx[j]], x) for j < k; idx == NULL means rows 0..k-1 (dense GEMV).
int pp_gather_gemv(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols,
                   const float* x, const int64_t* idx, int64_t k, float* out, int act,
                   int nthreads) {
  return mat_gemv(Mat(dtype, W, ld, nrows, cols), x, idx, k, out, act, nthreads);
}

// out (+)= sum_{j: h[j] != 0} h[j] * W[idx[j]]; out is zeroed first unless accumulate.
int pp_gather_axpy(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols,
                   const float* h, const int64_t* idx, int64_t k, float* out, int accumulate,
                   int nthreads) {
  if (dtype == DT_MXFP4)
    return mx_axpy((const uint8_t*)W, ld, nrows, cols, h, 0, 1, idx, k, out, accumulate, nthreads);
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  PP_DISPATCH(dtype, axpy_impl, (const uint8_t*)W, ld, nrows, cols, h, idx, k, out, accumulate,
              nthreads)
}

// out[t] = sum_{j: h[t][j] != 0} h[t][j] * W[j] for T tokens: h (T, nrows), out (T, cols).
int pp_rows_sum(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols, const float* h,
                int64_t T, float* out, int nthreads) {
  if (dtype == DT_MXFP4)
    return mx_axpy((const uint8_t*)W, ld, nrows, cols, h, nrows, T, nullptr, nrows, out, 0,
                   nthreads);
  if (!valid_shape(dtype, cols) || T < 0) return PP_ERR_ARG;
  PP_DISPATCH(dtype, rows_gemm_impl, (const uint8_t*)W, ld, nrows, cols, h, T, out, nthreads)
}

// out[j] = act(G[idx[j]]·x, U[idx[j]]·x) (variant 0 reglu, 1 drelu, 2 swiglu, 3 geglu).
int pp_glu_gemv(int dtype, const void* G, int64_t ldg, const void* U, int64_t ldu, int64_t nrows,
                int64_t cols, const float* x, const int64_t* idx, int64_t k, int variant,
                float* out, int act, int nthreads) {
  if (variant < V_REGLU || variant > V_GEGLU || !G) return PP_ERR_ARG;
  return mat_glu(Mat(dtype, G, ldg, nrows, cols), Mat(dtype, U, ldu, nrows, cols), x, idx, k,
                 variant, out, act, nthreads);
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
  if (dtype == DT_MXFP4) return mx_dequant((const uint8_t*)W, ld, nrows, cols, idx, k, out);
  if (is_x8(dtype))
    return x8_layout(dtype, [&](auto X) {
      return x8_dequant<decltype(X)>((const uint8_t*)W, nrows, cols, idx, k, out, nthreads);
    });
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  PP_DISPATCH(dtype, dequant_impl, (const uint8_t*)W, ld, nrows, cols, idx, k, out, nthreads)
}

// Rows of dtype Q4_K or Q4_0 (raw, ld bytes apart; nrows a multiple of 8) interleaved 8 at a time
// into out (q4_k_x8.h, q4_0_x8.h); back with unpack != 0 (dtype then the interleaved code, W the
// interleaved matrix and out the rows). Returns the layout's dtype code, or -1 where the kernels
// have no interleaved products (no AVX2), the dtype has no layout or the shape does not fit.
int pp_repack_x8(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols, void* out,
                 int unpack, int nthreads) {
  const int of_rows = dtype == DT_Q4_K ? DT_Q4_KX8 : dtype == DT_Q4_0 ? DT_Q4_0X8 : -1;
  const int code = unpack ? dtype : of_rows;  // the layout's
  if (!is_x8(code)) return -1;
  return x8_layout(code, [&](auto X) {
    return x8_repack<decltype(X)>((const uint8_t*)W, ld, nrows, cols, (uint8_t*)out, unpack,
                                  nthreads);
  });
}

}  // extern "C"
