// powerpy CPU kernels for the predictor-gated sparse FFN (batch-1 decode) and quantized GEMM.
//
// Built by powerpy/kernels.py with `g++ -O3 -march=native -fopenmp -shared` and called through
// ctypes with tensor data pointers. Everything is extern "C"; no torch headers.
//
// Matrices are row-major (nrows, cols) with a row stride of `ld` bytes; FFN matrices are
// neuron-major (n_ff, n_embd), so a sparse FFN reads whole rows. A row is processed in
// 32-element blocks (one ggml block for Q8_0/Q4_0), decoded to f32 in registers: decoded values
// equal the dequantized weights exactly (q * d is exact in f32), and all accumulation is f32.
// x stays f32 (no Q8_0 quantization of activations): slower than llama.cpp's integer dot
// products for Q4_0, but as accurate as dequantize-then-f32-math.
//
// The main speed lever is a software prefetch of the row `dist` indices ahead into L2, spread
// over the current row's loop (cpu-kernels.md section 4); `dist` covers at least
// g_prefetch_bytes and is at least 2 rows.
//
// SIMD is chosen at compile time: AVX-512F (16 lanes), AVX2+FMA+F16C (8 lanes), or scalar.
// Return codes: 0 ok, 1 an index was out of range (that output is NaN / that row skipped),
// 2 bad argument (unknown dtype or variant, cols not a multiple of the block size).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

enum DType { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2, DT_Q8_0 = 3, DT_Q4_0 = 4 };
enum Variant { V_REGLU = 0, V_DRELU = 1, V_SWIGLU = 2 };
enum Status { PP_OK = 0, PP_ERR_INDEX = 1, PP_ERR_ARG = 2 };

int64_t g_prefetch_bytes = 8192;  // how far ahead (at least) the next-row prefetch reaches
int64_t g_min_bytes_per_thread = 32768;  // below this much work per thread, use fewer threads

// ---- scalar helpers -----------------------------------------------------------------------------

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while (!(man & 0x400u));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Prefetch bytes [pf, end) of the upcoming row `nx`, one cache line at a time.
inline void prefetch_span(const uint8_t* nx, int64_t& pf, int64_t end) {
  for (; pf < end; pf += 64) prefetch_l2(nx + pf);
}

// ---- vector abstraction ---------------------------------------------------------------------

#if defined(__AVX512F__)
#define PP_SIMD 2
typedef __m512 vf;
constexpr int VL = 16;
inline vf v_zero() { return _mm512_setzero_ps(); }
inline vf v_set1(float a) { return _mm512_set1_ps(a); }
inline vf v_load(const float* p) { return _mm512_loadu_ps(p); }
inline void v_store(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline float v_sum(vf a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PP_SIMD 1
typedef __m256 vf;
constexpr int VL = 8;
inline vf v_zero() { return _mm256_setzero_ps(); }
inline vf v_set1(float a) { return _mm256_set1_ps(a); }
inline vf v_load(const float* p) { return _mm256_loadu_ps(p); }
inline void v_store(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline float v_sum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#define PP_SIMD 0
typedef float vf;
constexpr int VL = 1;
inline vf v_zero() { return 0.0f; }
inline vf v_set1(float a) { return a; }
inline vf v_load(const float* p) { return *p; }
inline void v_store(float* p, vf a) { *p = a; }
inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }
inline vf v_mul(vf a, vf b) { return a * b; }
inline vf v_add(vf a, vf b) { return a + b; }
inline float v_sum(vf a) { return a; }
#endif

constexpr int NV = 32 / VL;  // vectors per 32-element block

// ---- block decoders: 32 elements -> NV f32 vectors --------------------------------------------
// BB = bytes per 32-element block; one(row, i) decodes element i (float types only, for tails).

template <int DT>
struct Dec;

template <>
struct Dec<DT_F32> {
  static constexpr int64_t BB = 128;
  static constexpr bool QUANT = false;
  static inline void block(const uint8_t* p, vf* w) {
    for (int u = 0; u < NV; ++u) w[u] = v_load((const float*)p + u * VL);
  }
  static inline float one(const uint8_t* row, int64_t i) {
    float f;
    std::memcpy(&f, row + 4 * i, 4);
    return f;
  }
};

template <>
struct Dec<DT_F16> {
  static constexpr int64_t BB = 64;
  static constexpr bool QUANT = false;
  static inline void block(const uint8_t* p, vf* w) {
#if PP_SIMD == 2
    for (int u = 0; u < NV; ++u)
      w[u] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 32 * u)));
#elif PP_SIMD == 1
    for (int u = 0; u < NV; ++u) w[u] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * u)));
#else
    for (int u = 0; u < NV; ++u) w[u] = half_to_float(load_u16(p + 2 * u));
#endif
  }
  static inline float one(const uint8_t* row, int64_t i) { return half_to_float(load_u16(row + 2 * i)); }
};

template <>
struct Dec<DT_BF16> {
  static constexpr int64_t BB = 64;
  static constexpr bool QUANT = false;
  static inline void block(const uint8_t* p, vf* w) {
#if PP_SIMD == 2
    for (int u = 0; u < NV; ++u) {
      __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + 32 * u)));
      w[u] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
#elif PP_SIMD == 1
    for (int u = 0; u < NV; ++u) {
      __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * u)));
      w[u] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
#else
    for (int u = 0; u < NV; ++u) w[u] = bf16_to_float(load_u16(p + 2 * u));
#endif
  }
  static inline float one(const uint8_t* row, int64_t i) { return bf16_to_float(load_u16(row + 2 * i)); }
};

// Q8_0 (34 B): f16 d, int8 qs[32]; y[j] = qs[j] * d.
template <>
struct Dec<DT_Q8_0> {
  static constexpr int64_t BB = 34;
  static constexpr bool QUANT = true;
  static inline void block(const uint8_t* p, vf* w) {
    const float d = half_to_float(load_u16(p));
    const uint8_t* qs = p + 2;
#if PP_SIMD == 2
    const vf vd = v_set1(d);
    for (int u = 0; u < NV; ++u) {
      __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qs + 16 * u)));
      w[u] = v_mul(_mm512_cvtepi32_ps(q), vd);
    }
#elif PP_SIMD == 1
    const vf vd = v_set1(d);
    for (int u = 0; u < NV; ++u) {
      __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qs + 8 * u)));
      w[u] = v_mul(_mm256_cvtepi32_ps(q), vd);
    }
#else
    for (int u = 0; u < NV; ++u) w[u] = (float)(int8_t)qs[u] * d;
#endif
  }
  static inline float one(const uint8_t*, int64_t) { return 0.0f; }  // never called (QUANT)
};

// Q4_0 (18 B): f16 d, u8 qs[16]; y[j] = ((qs[j] & 15) - 8) d, y[j+16] = ((qs[j] >> 4) - 8) d.
template <>
struct Dec<DT_Q4_0> {
  static constexpr int64_t BB = 18;
  static constexpr bool QUANT = true;
  static inline void block(const uint8_t* p, vf* w) {
    const float d = half_to_float(load_u16(p));
    const uint8_t* qs = p + 2;
#if PP_SIMD == 2
    // Table lookup instead of int->float conversion: vpermps reads only the low 4 bits of
    // each index lane, so the zero-extended byte selects its low nibble directly.
    const __m512 lut = _mm512_mul_ps(
        _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), v_set1(d));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
    w[0] = _mm512_permutexvar_ps(q, lut);                         // elements 0..15
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);  // elements 16..31
#elif PP_SIMD == 1
    const __m128i q = _mm_loadu_si128((const __m128i*)qs);
    const __m128i m4 = _mm_set1_epi8(15), k8 = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m4), k8);                     // elements 0..15
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), k8);  // 16..31
    const vf vd = v_set1(d);
    w[0] = v_mul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), vd);
    w[1] = v_mul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo))), vd);
    w[2] = v_mul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), vd);
    w[3] = v_mul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi))), vd);
#else
    for (int j = 0; j < 16; ++j) {
      w[j] = (float)((int)(qs[j] & 15) - 8) * d;
      w[j + 16] = (float)((int)(qs[j] >> 4) - 8) * d;
    }
#endif
  }
  static inline float one(const uint8_t*, int64_t) { return 0.0f; }  // never called (QUANT)
};

template <int DT>
inline int64_t row_bytes(int64_t cols) {
  return Dec<DT>::QUANT ? cols / 32 * Dec<DT>::BB : cols * (Dec<DT>::BB / 32);
}

// ---- per-row primitives ---------------------------------------------------------------------

inline float sum_vectors(const vf* a, int n) {
  vf s = a[0];
  for (int i = 1; i < n; ++i) s = v_add(s, a[i]);
  return v_sum(s);
}

// dot(W row w, x); prefetches row nx (may be null) along the way.
template <int DT>
inline float row_dot(const uint8_t* w, const float* x, int64_t cols, const uint8_t* nx) {
  using D = Dec<DT>;
  const int64_t nb = cols / 32;
  vf a[2 * NV];
  for (int i = 0; i < 2 * NV; ++i) a[i] = v_zero();
  int64_t pf = 0, b = 0;
  for (; b + 2 <= nb; b += 2) {
    if (nx) prefetch_span(nx, pf, (b + 2) * D::BB);
    vf w0[NV], w1[NV];
    D::block(w + b * D::BB, w0);
    D::block(w + (b + 1) * D::BB, w1);
    const float* xb = x + b * 32;
    for (int u = 0; u < NV; ++u) {
      a[u] = v_fma(w0[u], v_load(xb + u * VL), a[u]);
      a[NV + u] = v_fma(w1[u], v_load(xb + 32 + u * VL), a[NV + u]);
    }
  }
  if (b < nb) {
    vf w0[NV];
    D::block(w + b * D::BB, w0);
    for (int u = 0; u < NV; ++u) a[u] = v_fma(w0[u], v_load(x + b * 32 + u * VL), a[u]);
  }
  if (nx) prefetch_span(nx, pf, row_bytes<DT>(cols));
  float s = sum_vectors(a, 2 * NV);
  for (int64_t i = nb * 32; i < cols; ++i) s += D::one(w, i) * x[i];
  return s;
}

// Two dots sharing x: gate row g and up row u (same dtype and cols).
template <int DT>
inline void row_dot2(const uint8_t* g, const uint8_t* up, const float* x, int64_t cols,
                     const uint8_t* ng, const uint8_t* nu, float* rg, float* ru) {
  using D = Dec<DT>;
  const int64_t nb = cols / 32;
  vf ag[NV], au[NV];
  for (int i = 0; i < NV; ++i) ag[i] = au[i] = v_zero();
  int64_t pg = 0, pu = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (ng) prefetch_span(ng, pg, (b + 1) * D::BB);
    if (nu) prefetch_span(nu, pu, (b + 1) * D::BB);
    vf wg[NV], wu[NV];
    D::block(g + b * D::BB, wg);
    D::block(up + b * D::BB, wu);
    const float* xb = x + b * 32;
    for (int u = 0; u < NV; ++u) {
      const vf xv = v_load(xb + u * VL);
      ag[u] = v_fma(wg[u], xv, ag[u]);
      au[u] = v_fma(wu[u], xv, au[u]);
    }
  }
  const int64_t rb = row_bytes<DT>(cols);
  if (ng) prefetch_span(ng, pg, rb);
  if (nu) prefetch_span(nu, pu, rb);
  float sg = sum_vectors(ag, NV), su = sum_vectors(au, NV);
  for (int64_t i = nb * 32; i < cols; ++i) {
    sg += D::one(g, i) * x[i];
    su += D::one(up, i) * x[i];
  }
  *rg = sg;
  *ru = su;
}

// acc += hj * row w; prefetches row nx (may be null).
template <int DT>
inline void row_axpy(const uint8_t* w, float hj, float* acc, int64_t cols, const uint8_t* nx) {
  using D = Dec<DT>;
  const int64_t nb = cols / 32;
  const vf hv = v_set1(hj);
  int64_t pf = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (nx) prefetch_span(nx, pf, (b + 1) * D::BB);
    vf wv[NV];
    D::block(w + b * D::BB, wv);
    float* ab = acc + b * 32;
    for (int u = 0; u < NV; ++u) v_store(ab + u * VL, v_fma(wv[u], hv, v_load(ab + u * VL)));
  }
  if (nx) prefetch_span(nx, pf, row_bytes<DT>(cols));
  for (int64_t i = nb * 32; i < cols; ++i) acc[i] += D::one(w, i) * hj;
}

// out[t * ldo] = dot(row w, x_t) for NT vectors x_t = x + t * ldx; decodes each block once.
template <int DT, int NT>
inline void row_dot_multi(const uint8_t* w, const float* x, int64_t ldx, int64_t cols,
                          const uint8_t* nx, float* out, int64_t ldo) {
  using D = Dec<DT>;
  const int64_t nb = cols / 32;
  vf a[NT][NV];
  for (int t = 0; t < NT; ++t)
    for (int u = 0; u < NV; ++u) a[t][u] = v_zero();
  int64_t pf = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (nx) prefetch_span(nx, pf, (b + 1) * D::BB);
    vf wv[NV];
    D::block(w + b * D::BB, wv);
    for (int t = 0; t < NT; ++t) {
      const float* xb = x + t * ldx + b * 32;
      for (int u = 0; u < NV; ++u) a[t][u] = v_fma(wv[u], v_load(xb + u * VL), a[t][u]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    float s = sum_vectors(a[t], NV);
    for (int64_t i = nb * 32; i < cols; ++i) s += D::one(w, i) * x[t * ldx + i];
    out[t * ldo] = s;
  }
}

template <int DT>
inline void row_decode(const uint8_t* w, float* y, int64_t cols) {
  using D = Dec<DT>;
  const int64_t nb = cols / 32;
  for (int64_t b = 0; b < nb; ++b) {
    vf wv[NV];
    D::block(w + b * D::BB, wv);
    for (int u = 0; u < NV; ++u) v_store(y + b * 32 + u * VL, wv[u]);
  }
  for (int64_t i = nb * 32; i < cols; ++i) y[i] = D::one(w, i);
}

// ---- threading helpers ------------------------------------------------------------------------

// Threads worth starting for `work_bytes` of memory traffic (an OpenMP region costs ~2 us).
inline int team_size(int nthreads, int64_t work_bytes) {
  int64_t t = work_bytes / g_min_bytes_per_thread;
  if (t < 1) t = 1;
  if (t > nthreads) t = nthreads;
#if !defined(_OPENMP)
  t = 1;
#endif
  return (int)t;
}

inline int thread_id() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline int team_threads() {
#if defined(_OPENMP)
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// Rows to prefetch ahead: at least 2, enough to cover g_prefetch_bytes.
inline int64_t prefetch_dist(int64_t rb) {
  int64_t d = rb > 0 ? (g_prefetch_bytes + rb - 1) / rb : 2;
  if (d < 2) d = 2;
  if (d > 16) d = 16;
  return d;
}

// Row id of list position j (identity when idx is null); -1 when out of range.
inline int64_t row_at(const int64_t* idx, int64_t j, int64_t nrows) {
  const int64_t r = idx ? idx[j] : j;
  return (uint64_t)r < (uint64_t)nrows ? r : -1;
}

// Run fn(a, b) over a fixed contiguous partition of [0, k) with up to nt threads; returns the
// OR of the fn results.
template <class Fn>
inline int run_partitioned(int nt, int64_t k, Fn fn) {
  if (nt <= 1) return fn((int64_t)0, k);
  int err = 0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(nt) reduction(| : err)
  {
    const int64_t t = thread_id(), n = team_threads();
    err |= fn(k * t / n, k * (t + 1) / n);
  }
#else
  err = fn((int64_t)0, k);
#endif
  return err;
}

// ---- kernels ----------------------------------------------------------------------------------

template <int DT>
int gemv_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
              const int64_t* idx, int64_t k, float* out, int nthreads) {
  const int64_t rb = row_bytes<DT>(cols), dist = prefetch_dist(rb);
  const int nt = team_size(nthreads, k * rb);
  return run_partitioned(nt, k, [&](int64_t a, int64_t b) -> int {
    int err = 0;
    for (int64_t j = a; j < b; ++j) {
      const int64_t r = row_at(idx, j, nrows);
      if (r < 0) {
        out[j] = NAN;
        err = 1;
        continue;
      }
      const int64_t rn = j + dist < b ? row_at(idx, j + dist, nrows) : -1;
      out[j] = row_dot<DT>(W + r * ld, x, cols, rn >= 0 ? W + rn * ld : nullptr);
    }
    return err;
  });
}

inline float activate(int variant, float g, float u) {
  switch (variant) {
    case V_REGLU:
      return (g > 0.0f ? g : 0.0f) * u;
    case V_DRELU:
      return (g > 0.0f ? g : 0.0f) * (u > 0.0f ? u : 0.0f);
    default:  // V_SWIGLU
      return g / (1.0f + std::exp(-g)) * u;
  }
}

template <int DT>
int glu_impl(const uint8_t* G, int64_t ldg, const uint8_t* U, int64_t ldu, int64_t nrows,
             int64_t cols, const float* x, const int64_t* idx, int64_t k, int variant, float* out,
             int nthreads) {
  const int64_t rb = row_bytes<DT>(cols), dist = prefetch_dist(rb);
  const int nt = team_size(nthreads, k * rb * 2);
  return run_partitioned(nt, k, [&](int64_t a, int64_t b) -> int {
    int err = 0;
    for (int64_t j = a; j < b; ++j) {
      const int64_t r = row_at(idx, j, nrows);
      if (r < 0) {
        out[j] = NAN;
        err = 1;
        continue;
      }
      const int64_t rn = j + dist < b ? row_at(idx, j + dist, nrows) : -1;
      const uint8_t* nu = rn >= 0 ? U + rn * ldu : nullptr;
      float g, u;
      row_dot2<DT>(G + r * ldg, U + r * ldu, x, cols, rn >= 0 ? G + rn * ldg : nullptr, nu, &g, &u);
      out[j] = activate(variant, g, u);
    }
    return err;
  });
}

// acc += sum_{j in [a, b), h[j] != 0} h[j] * W[idx[j]]
template <int DT>
int axpy_range(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* h,
               const int64_t* idx, int64_t a, int64_t b, int64_t dist, float* acc) {
  int err = 0;
  for (int64_t j = a; j < b; ++j) {
    const float hj = h[j];
    if (hj == 0.0f) continue;
    const int64_t r = row_at(idx, j, nrows);
    if (r < 0) {
      err = 1;
      continue;
    }
    const int64_t jn = j + dist;
    const int64_t rn = jn < b && h[jn] != 0.0f ? row_at(idx, jn, nrows) : -1;
    row_axpy<DT>(W + r * ld, hj, acc, cols, rn >= 0 ? W + rn * ld : nullptr);
  }
  return err;
}

template <int DT>
int axpy_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* h,
              const int64_t* idx, int64_t k, float* out, int accumulate, int nthreads) {
  const int64_t rb = row_bytes<DT>(cols), dist = prefetch_dist(rb);
  if (!accumulate) std::memset(out, 0, sizeof(float) * cols);
  const int nt = team_size(nthreads, k * rb);
  if (nt <= 1) return axpy_range<DT>(W, ld, nrows, cols, h, idx, 0, k, dist, out);

  // One private f32 accumulator per thread over a fixed partition of the index list, then a
  // column-parallel reduction in thread order: deterministic for a given thread count.
  const int64_t cpad = (cols + 15) / 16 * 16;
  float* buf = (float*)std::aligned_alloc(64, sizeof(float) * cpad * nt);
  if (!buf) return PP_ERR_ARG;
  int err = 0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(nt) reduction(| : err)
  {
    const int64_t t = thread_id(), n = team_threads();
    float* acc = buf + t * cpad;
    std::memset(acc, 0, sizeof(float) * cpad);
    err |= axpy_range<DT>(W, ld, nrows, cols, h, idx, k * t / n, k * (t + 1) / n, dist, acc);
#pragma omp barrier
    const int64_t c0 = cpad / 16 * t / n * 16, c1 = cpad / 16 * (t + 1) / n * 16;
    for (int64_t c = c0; c < c1 && c < cols; ++c) {
      float s = buf[c];
      for (int64_t i = 1; i < n; ++i) s += buf[i * cpad + c];
      out[c] += s;
    }
  }
#endif
  std::free(buf);
  return err;
}

template <int DT>
int gemm_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
              int64_t ldx, int64_t T, float* out, int64_t ldo, int nthreads) {
  constexpr int G = VL == 16 ? 4 : 2;  // vectors per pass (register budget)
  if (T == 1) return gemv_impl<DT>(W, ld, nrows, cols, x, nullptr, nrows, out, nthreads);
  const int64_t rb = row_bytes<DT>(cols), dist = prefetch_dist(rb);
  const int nt = team_size(nthreads, nrows * (rb + T * 64));
  return run_partitioned(nt, nrows, [&](int64_t a, int64_t b) -> int {
    for (int64_t r = a; r < b; ++r) {
      const uint8_t* w = W + r * ld;
      const uint8_t* nx = r + dist < b ? W + (r + dist) * ld : nullptr;
      for (int64_t t0 = 0; t0 < T; t0 += G) {
        const float* xt = x + t0 * ldx;
        float* o = out + t0 * ldo + r;
        const uint8_t* p = t0 == 0 ? nx : nullptr;
        switch (T - t0 >= G ? G : T - t0) {
          case 1:
            row_dot_multi<DT, 1>(w, xt, ldx, cols, p, o, ldo);
            break;
          case 2:
            row_dot_multi<DT, 2>(w, xt, ldx, cols, p, o, ldo);
            break;
          case 3:
            row_dot_multi<DT, 3>(w, xt, ldx, cols, p, o, ldo);
            break;
          default:
            row_dot_multi<DT, G>(w, xt, ldx, cols, p, o, ldo);
            break;
        }
      }
    }
    return 0;
  });
}

template <int DT>
int dequant_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const int64_t* idx,
                 int64_t k, float* out, int nthreads) {
  const int nt = team_size(nthreads, k * (row_bytes<DT>(cols) + 4 * cols));
  return run_partitioned(nt, k, [&](int64_t a, int64_t b) -> int {
    int err = 0;
    for (int64_t j = a; j < b; ++j) {
      const int64_t r = row_at(idx, j, nrows);
      if (r < 0) {
        for (int64_t i = 0; i < cols; ++i) out[j * cols + i] = NAN;
        err = 1;
        continue;
      }
      row_decode<DT>(W + r * ld, out + j * cols, cols);
    }
    return err;
  });
}

inline bool valid_shape(int dtype, int64_t cols) {
  if (cols < 0) return false;
  if (dtype == DT_Q8_0 || dtype == DT_Q4_0) return cols % 32 == 0;
  return dtype >= DT_F32 && dtype <= DT_Q4_0;
}

}  // namespace

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
    default:                                   \
      return PP_ERR_ARG;                       \
  }

extern "C" {

// Bumped whenever a signature changes; kernels.py refuses a library with another version.
int pp_abi_version(void) { return 1; }

// 2 = AVX-512F, 1 = AVX2+FMA+F16C, 0 = scalar.
int pp_simd_level(void) { return PP_SIMD; }

// Tuning knobs (process-wide): prefetch reach in bytes, and work per thread before a 2nd thread.
void pp_set_tuning(int64_t prefetch_bytes, int64_t min_bytes_per_thread) {
  if (prefetch_bytes >= 0) g_prefetch_bytes = prefetch_bytes;
  if (min_bytes_per_thread > 0) g_min_bytes_per_thread = min_bytes_per_thread;
}

// out[j] = dot(W[idx[j]], x) for j < k; idx == NULL means rows 0..k-1 (dense GEMV).
int pp_gather_gemv(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols,
                   const float* x, const int64_t* idx, int64_t k, float* out, int nthreads) {
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  PP_DISPATCH(dtype, gemv_impl, (const uint8_t*)W, ld, nrows, cols, x, idx, k, out, nthreads)
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
                float* out, int nthreads) {
  if (!valid_shape(dtype, cols) || variant < V_REGLU || variant > V_SWIGLU || !G) return PP_ERR_ARG;
  const uint8_t* g = (const uint8_t*)G;
  PP_DISPATCH(dtype, glu_impl, g, ldg, (const uint8_t*)U, ldu, nrows, cols, x, idx, k, variant,
              out, nthreads)
}

// out[t * ldo + r] = dot(W[r], x[t * ldx : t * ldx + cols]) for r < nrows, t < T.
int pp_gemm(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
            int64_t ldx, int64_t T, float* out, int64_t ldo, int nthreads) {
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  PP_DISPATCH(dtype, gemm_impl, (const uint8_t*)W, ld, nrows, cols, x, ldx, T, out, ldo,
              nthreads)
}

// out[j, :] = W[idx[j], :] as f32 (idx == NULL: rows 0..k-1); out is (k, cols) contiguous.
int pp_dequant_rows(int dtype, const void* W, int64_t ld, int64_t nrows, int64_t cols,
                    const int64_t* idx, int64_t k, float* out, int nthreads) {
  if (!valid_shape(dtype, cols)) return PP_ERR_ARG;
  PP_DISPATCH(dtype, dequant_impl, (const uint8_t*)W, ld, nrows, cols, idx, k, out, nthreads)
}

}  // extern "C"
