// powerpy CPU kernels for the predictor-gated sparse FFN (batch-1 decode) and quantized GEMM.
//
// Built by powerpy/kernels.py with `g++ -O3 -march=native -fopenmp -shared` and called through
// ctypes with tensor data pointers. Everything is extern "C"; no torch headers.
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
// SIMD is chosen at compile time: AVX-512F (16 lanes), AVX2+FMA+F16C (8 lanes), or scalar.
// Return codes: 0 ok, 1 an index was out of range (that output is NaN / that row skipped),
// 2 bad argument (unknown dtype or variant, cols not a multiple of the block size).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

enum DType {
  DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2, DT_Q8_0 = 3, DT_Q4_0 = 4,
  DT_Q4_1 = 5, DT_Q5_0 = 6, DT_Q5_1 = 7, DT_Q4_K = 8, DT_Q5_K = 9, DT_Q6_K = 10
};
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

inline uint16_t float_to_half(float f) {  // round to nearest even
#if defined(__F16C__)
  return _cvtss_sh(f, 0);
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to infinity
  if (ax < 0x38800000u) {  // subnormal or zero: scale into f16's subnormal grid
    float a;
    std::memcpy(&a, &ax, 4);
    return (uint16_t)(sign | (uint32_t)std::nearbyint(a * 16777216.0f));
  }
  const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);  // round the 13 dropped bits to even
  return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
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

// _mm512_reduce_add_ps's pairing (as GCC and clang emit it): halves 8 + 8, 4 + 4, then
// (0 + 2) + (1 + 3). tree16 sums 16 floats, or 16 vectors lane by lane (overwriting a).
template <class T>
inline T tree16(T* a) {
  for (int i = 0; i < 8; ++i) a[i] = a[i + 8] + a[i];
  for (int i = 0; i < 4; ++i) a[i] = a[i + 4] + a[i];
  return (a[0] + a[2]) + (a[1] + a[3]);
}

inline float reduce16(const float* a) {
  float t[16];
  std::memcpy(t, a, sizeof t);
  return tree16(t);
}

// The 8-lane (AVX2) reductions of llama.cpp: hsum8 is tinyBLAS's hsum and the softmax's chunk
// sum (halves 4 + 4, then (0 + 2) + (1 + 3)); hadd8 is GGML_F32x8_REDUCE's two hadds (halves
// 4 + 4, then (0 + 1) + (2 + 3)). Floats, or vectors lane by lane.
template <class T>
inline T hsum8(const T* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}
template <class T>
inline T hadd8(const T* a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// One rotated pair as ggml's rotate_pairs computes it (GCC contracts a * c - b * s into one FMA
// with b * s rounded first).
inline void rope_pair(float* p, float c, float s) {
  const float a = p[0], b = p[1];
  p[0] = std::fma(a, c, -(b * s));
  p[1] = std::fma(a, s, b * c);
}

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Prefetch bytes [pf, end) of the upcoming row `nx`, one cache line at a time.
inline void prefetch_span(const uint8_t* nx, int64_t& pf, int64_t end) {
  for (; pf < end; pf += 64) prefetch_l2(nx + pf);
}

// The same for n upcoming rows nx[i] (null: skipped), read side by side: all advance together.
inline void prefetch_spans(const uint8_t* const* nx, int n, int64_t& pf, int64_t end) {
  int64_t p = pf;
  for (int i = 0; i < n; ++i) {
    p = pf;
    if (nx[i]) prefetch_span(nx[i], p, end);
  }
  pf = p > pf ? p : pf;
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
inline vf v_load_h(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
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
inline vf v_load_h(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
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
inline vf v_load_h(const uint16_t* p) { return half_to_float(*p); }
#endif

constexpr int NV = 32 / VL;  // vectors per 32-element block

// ggml's vectorized expf, lane by lane: n = round(x / ln 2) by the 1.5 * 2^23 trick, b = x - n ln 2
// in two parts, a degree-5 polynomial, then times 2^n. llama.cpp built for this CPU runs its
// AVX-512 form (j(b) then j * 2^n, saturating beyond |n| > 192) or, with AVX2, its AVX2 form (the
// polynomial without its 1, then k + k * j with k = 2^n, rescaled in two steps beyond |n| > 126).
inline float ggml_expf(float x) {
  const float r = 0x1.8p23f;
  const float z = std::fma(x, 0x1.715476p+0f, r);
  const float n = z - r;
#if PP_SIMD == 1
  const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
  uint32_t zb, one_b;
  const float one = 1.0f;
  std::memcpy(&zb, &z, 4);
  std::memcpy(&one_b, &one, 4);
  const uint32_t e = zb << 23;
  const uint32_t kb = e + one_b;
  float k;
  std::memcpy(&k, &kb, 4);
  const float u = b * b;
  const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                    std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                           u, 0x1.ffffecp-1f * b);
  if (!(std::fabs(n) > 126.0f)) return std::fma(k, j, k);
  const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
  const uint32_t s1b = g + 0x7f000000u, s2b = e - g;
  float s1, s2;
  std::memcpy(&s1, &s1b, 4);
  std::memcpy(&s2, &s2b, 4);
  if (std::fabs(n) > 192.0f) return s1 * s1;
  return std::fma(s2, j, s2) * s1;
#else
  if (n != n) return n;
  if (std::fabs(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
  const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
  const float u = b * b;
  const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                    std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                           u, std::fma(0x1.ffffecp-1f, b, 1.0f));
  const int e = (int)n, e1 = e / 2, e2 = e - e1;  // two exact powers: one rounding, as scalef
  uint32_t b1 = (uint32_t)(e1 + 127) << 23, b2 = (uint32_t)(e2 + 127) << 23;
  float p1, p2;
  std::memcpy(&p1, &b1, 4);
  std::memcpy(&p2, &b2, 4);
  return (j * p1) * p2;
#endif
}

inline float ggml_silu(float x) { return x / (1.0f + ggml_expf(0.0f - x)); }

// ggml's vector width on this CPU (llama.cpp is built for the same one): its dot products and
// softmax sum in GW-lane vectors, and reduce them as below.
#if PP_SIMD == 1
constexpr int GW = 8;
#else
constexpr int GW = 16;
#endif

// A vector of GW lanes summed as tinyBLAS and the softmax do (hsum), or as ggml_vec_dot_f16's
// GGML_F16_VEC_REDUCE does (vreduce). AVX-512: both are _mm512_reduce_add_ps (reduce16).
template <class T>
inline T hsum_gw(T* a) {
  if constexpr (GW == 8) return hsum8(a);
  else return tree16(a);
}
template <class T>
inline T vreduce_gw(T* a) {
  if constexpr (GW == 8) return hadd8(a);
  else return tree16(a);
}

// ---- block decoders: 32 elements -> NV f32 vectors --------------------------------------------
// BB = bytes per 32-element block; one(row, i) decodes element i (float types only, for tails).

template <int DT>
struct Dec;

template <>
struct Dec<DT_F32> {
  static constexpr int64_t BB = 128;
  static constexpr bool QUANT = false;
  static constexpr int64_t QK = 32, TS = BB;
  static inline void chunk(const uint8_t* row, int64_t c, vf* w) { block(row + c * BB, w); }
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
  static constexpr int64_t QK = 32, TS = BB;
  static inline void chunk(const uint8_t* row, int64_t c, vf* w) { block(row + c * BB, w); }
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
  static constexpr int64_t QK = 32, TS = BB;
  static inline void chunk(const uint8_t* row, int64_t c, vf* w) { block(row + c * BB, w); }
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
  static constexpr int64_t QK = 32, TS = BB;
  static inline void chunk(const uint8_t* row, int64_t c, vf* w) { block(row + c * BB, w); }
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
  static constexpr int64_t QK = 32, TS = BB;
  static inline void chunk(const uint8_t* row, int64_t c, vf* w) { block(row + c * BB, w); }
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

// ---- byte decoders for the other ggml types --------------------------------------------------
// A 32-element chunk decodes to 32 bytes q plus one affine map per half (elements 0..15 and
// 16..31): y = a_h * q + b_h. Every value is exact in f32 (a_h * q needs at most 25 bits and one
// rounding, as in ggml), so the f32 decode equals ggml's dequantization. The same bytes feed the
// integer dot products against quantized activations (vec_dot) below. q is unsigned except for
// Q8_0 (SIGNED: the bytes are int8 values).

#if defined(__AVX2__)
#define PP_ISIMD 1
struct U8x32 {
  __m256i v;
};
#else
#define PP_ISIMD 0
struct U8x32 {
  uint8_t b[32];
};
#endif

struct Affine {
  float a0, a1, b0, b1;
};

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 16 bytes -> 32 nibbles: low nibbles are elements 0..15, high nibbles 16..31 (Q4_0/Q4_1/Q5_x).
inline void nibbles_split(const uint8_t* qs, U8x32& q) {
#if PP_ISIMD
  const __m128i v = _mm_loadu_si128((const __m128i*)qs);
  const __m128i m4 = _mm_set1_epi8(15);
  q.v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
#else
  for (int j = 0; j < 16; ++j) {
    q.b[j] = qs[j] & 15;
    q.b[j + 16] = qs[j] >> 4;
  }
#endif
}

// 32 bytes -> their low (hi == false) or high nibbles, in order (K-quants).
inline void nibbles_32(const uint8_t* qs, bool hi, U8x32& q) {
#if PP_ISIMD
  __m256i v = _mm256_loadu_si256((const __m256i*)qs);
  if (hi) v = _mm256_srli_epi16(v, 4);
  q.v = _mm256_and_si256(v, _mm256_set1_epi8(15));
#else
  for (int j = 0; j < 32; ++j) q.b[j] = hi ? qs[j] >> 4 : qs[j] & 15;
#endif
}

// q[j] |= 16 where bit j of `bits` is set (Q5_0/Q5_1 high bits).
inline void or_bits16(uint32_t bits, U8x32& q) {
#if PP_ISIMD
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m256i h = _mm256_maskz_set1_epi8((__mmask32)bits, 16);
#else
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                        2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
  __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
  h = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, sel), sel), _mm256_set1_epi8(16));
#endif
  q.v = _mm256_or_si256(q.v, h);
#else
  for (int j = 0; j < 32; ++j) q.b[j] |= ((bits >> j) & 1u) << 4;
#endif
}

// q[j] |= ((hb[j] >> shift) & mask) << 4 for the 32 bytes hb (Q5_K: mask 1, Q6_K: mask 3).
inline void or_high(const uint8_t* hb, int shift, int mask, U8x32& q) {
#if PP_ISIMD
  __m256i h = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)hb), _mm_cvtsi32_si128(shift));
  h = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8((char)mask)), 4);
  q.v = _mm256_or_si256(q.v, h);
#else
  for (int j = 0; j < 32; ++j) q.b[j] |= ((hb[j] >> shift) & mask) << 4;
#endif
}

// ggml's 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block.
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K/Q5_K sub-block s of the super-block at p: y = d sc_s q - dmin m_s.
inline Affine affine_k4(const uint8_t* p, int s) {
  int sc, m;
  scale_min_k4(s, p + 4, &sc, &m);
  const float a = half_to_float(load_u16(p)) * sc, b = -(half_to_float(load_u16(p + 2)) * m);
  return {a, a, b, b};
}

// A type's block layout: QK elements in TS bytes; SIGNED bytes (Q8_0) or unsigned q whose value
// in ggml's integer dot is q - OFF.
template <int64_t QK_, int64_t TS_, bool SIGNED_, int OFF_>
struct Layout {
  static constexpr int64_t QK = QK_, TS = TS_;
  static constexpr bool SIGNED = SIGNED_;
  static constexpr int OFF = OFF_;
};

template <int DT>
struct UDec;

// Q8_0 (34 B / 32): f16 d, int8 qs[32].
template <>
struct UDec<DT_Q8_0> : Layout<32, 34, true, 0> {
  static inline void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + c * TS;
    const float d = half_to_float(load_u16(p));
    f = {d, d, 0.0f, 0.0f};
#if PP_ISIMD
    q.v = _mm256_loadu_si256((const __m256i*)(p + 2));
#else
    std::memcpy(q.b, p + 2, 32);
#endif
  }
};

// Q4_0 (18 B / 32): f16 d, qs[16]; y = (q - 8) d.
template <>
struct UDec<DT_Q4_0> : Layout<32, 18, false, 8> {
  static inline void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + c * TS;
    const float d = half_to_float(load_u16(p));
    f = {d, d, -8.0f * d, -8.0f * d};
    nibbles_split(p + 2, q);
  }
};

// Q4_1 (20 B / 32): f16 d, f16 m, qs[16]; y = q d + m.
template <>
struct UDec<DT_Q4_1> : Layout<32, 20, false, 0> {
  static inline void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + c * TS;
    const float d = half_to_float(load_u16(p)), m = half_to_float(load_u16(p + 2));
    f = {d, d, m, m};
    nibbles_split(p + 4, q);
  }
};

// Q5_0 (22 B / 32): f16 d, u32 qh, qs[16]; q = nibble | bit << 4, y = (q - 16) d.
template <>
struct UDec<DT_Q5_0> : Layout<32, 22, false, 16> {
  static inline void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + c * TS;
    const float d = half_to_float(load_u16(p));
    f = {d, d, -16.0f * d, -16.0f * d};
    nibbles_split(p + 6, q);
    or_bits16(load_u32(p + 2), q);
  }
};

// Q5_1 (24 B / 32): f16 d, f16 m, u32 qh, qs[16]; y = q d + m.
template <>
struct UDec<DT_Q5_1> : Layout<32, 24, false, 0> {
  static inline void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + c * TS;
    const float d = half_to_float(load_u16(p)), m = half_to_float(load_u16(p + 2));
    f = {d, d, m, m};
    nibbles_split(p + 8, q);
    or_bits16(load_u32(p + 4), q);
  }
};

// Q4_K (144 B / 256): f16 d, f16 dmin, scales[12], qs[128]; sub-block s of 32 elements:
// y = d sc_s q - dmin m_s, q the low (s even) or high nibbles of qs[32 (s / 2) ...].
template <>
struct UDec<DT_Q4_K> : Layout<256, 144, false, 0> {
  static inline void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + (c >> 3) * TS;
    const int s = (int)(c & 7);
    f = affine_k4(p, s);
    nibbles_32(p + 16 + 32 * (s >> 1), s & 1, q);
  }
};

// Q5_K (176 B / 256): f16 d, f16 dmin, scales[12], qh[32], qs[128]; as Q4_K plus bit s of qh.
template <>
struct UDec<DT_Q5_K> : Layout<256, 176, false, 0> {
  static inline void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + (c >> 3) * TS;
    const int s = (int)(c & 7);
    f = affine_k4(p, s);
    nibbles_32(p + 48 + 32 * (s >> 1), s & 1, q);
    or_high(p + 16, s, 1, q);
  }
};

// Q6_K (210 B / 256): ql[128], qh[64], int8 scales[16], f16 d; sub-block s = 4 n + k:
// q = nibble of ql[64 n + 32 (k & 1) ...] (high when k >= 2) | 2 bits (2 k) of qh[32 n ...] << 4,
// y = d sc (q - 32) with sc = scales[8 n + 2 k] for elements 0..15, scales[8 n + 2 k + 1] after.
template <>
struct UDec<DT_Q6_K> : Layout<256, 210, false, 0> {
  static inline void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + (c >> 3) * TS;
    const int s = (int)(c & 7), n = s >> 2, k = s & 3;
    const float d = half_to_float(load_u16(p + 208));
    const int8_t* sc = (const int8_t*)(p + 192 + 8 * n + 2 * k);
    const float a0 = d * sc[0], a1 = d * sc[1];
    f = {a0, a1, -32.0f * a0, -32.0f * a1};
    nibbles_32(p + 64 * n + 32 * (k & 1), k >= 2, q);
    or_high(p + 128 + 32 * n, 2 * k, 3, q);
  }
};

// f32 decode of the byte decoders: the primary template of Dec (Q4_1, Q5_x, K-quants).
template <int DT>
struct Dec {
  using U = UDec<DT>;
  static constexpr int64_t QK = U::QK, TS = U::TS, BB = TS * 32 / QK;  // BB: prefetch pacing
  static constexpr bool QUANT = true;
  static inline void chunk(const uint8_t* row, int64_t c, vf* w) {
    U8x32 q;
    Affine f;
    U::chunk(row, c, q, f);
#if PP_SIMD == 2
    const __m128i lo = _mm256_castsi256_si128(q.v), hi = _mm256_extracti128_si256(q.v, 1);
    w[0] = v_fma(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), v_set1(f.a0), v_set1(f.b0));
    w[1] = v_fma(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), v_set1(f.a1), v_set1(f.b1));
#elif PP_SIMD == 1
    const __m128i lo = _mm256_castsi256_si128(q.v), hi = _mm256_extracti128_si256(q.v, 1);
    const vf a0 = v_set1(f.a0), b0 = v_set1(f.b0), a1 = v_set1(f.a1), b1 = v_set1(f.b1);
    w[0] = v_fma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), a0, b0);
    w[1] = v_fma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo))), a0, b0);
    w[2] = v_fma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), a1, b1);
    w[3] = v_fma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi))), a1, b1);
#else
#if PP_ISIMD
    alignas(32) uint8_t b[32];
    _mm256_store_si256((__m256i*)b, q.v);
#else
    const uint8_t* b = q.b;
#endif
    for (int j = 0; j < 32; ++j)
      w[j] = j < 16 ? std::fma((float)b[j], f.a0, f.b0) : std::fma((float)b[j], f.a1, f.b1);
#endif
  }
  static inline float one(const uint8_t*, int64_t) { return 0.0f; }  // never called (QUANT)
};

template <int DT>
inline int64_t row_bytes(int64_t cols) {
  return Dec<DT>::QUANT ? cols / Dec<DT>::QK * Dec<DT>::TS : cols * (Dec<DT>::BB / 32);
}

// ---- quantized activations (ggml's vec_dot_type) -----------------------------------------------
// With act != 0, x is rounded the way llama.cpp rounds it before a quantized matmul: Q8_0 blocks
// for Q8_0/Q4_0/Q5_0 weights, Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants; each 32-element chunk
// then contributes d_x (a0 I0 + a1 I1) + bias, with I_h the integer dot of the weight bytes and the
// int8 activations of half h, and the bias b0 S0 + b1 S1 scaled by d_x (S_h: sums of the int8
// values); for Q8_1, b s with llama.cpp's f16 s = d_x * (S0 + S1).

enum ActKind { ACT_F32 = 0, ACT_Q8_0 = 1, ACT_Q8_1 = 2, ACT_Q8_K = 3 };

template <int DT>
constexpr int act_kind() {
  return DT == DT_Q4_1 || DT == DT_Q5_1                    ? ACT_Q8_1
         : DT == DT_Q4_K || DT == DT_Q5_K || DT == DT_Q6_K ? ACT_Q8_K
         : DT == DT_Q8_0 || DT == DT_Q4_0 || DT == DT_Q5_0 ? ACT_Q8_0
                                                           : ACT_F32;
}

struct QAct {  // one 32-element chunk of quantized activations
  float d;         // scale: f16-rounded (Q8_0, Q8_1) or f32 (Q8_K)
  float s;         // Q8_1: f16(d_f32 * sum); otherwise d * sum
  int32_t s0, s1;  // sums of qs[0..15] and qs[16..31]
  int8_t qs[32];
  int32_t ls[8];  // sums of qs[4 i .. 4 i + 3]: the offset (q - OFF) of Q4_0/Q5_0, per lane
};

inline void lane_sums(QAct& a) {
  for (int i = 0; i < 8; ++i) a.ls[i] = a.qs[4 * i] + a.qs[4 * i + 1] + a.qs[4 * i + 2] + a.qs[4 * i + 3];
}

inline float round_f16(float f) { return half_to_float(float_to_half(f)); }

// x (cols, a multiple of 32; of 256 for Q8_K) -> cols / 32 chunks.
inline void quantize_act(int kind, const float* x, int64_t cols, QAct* out) {
  const int64_t nch = cols / 32;
  if (kind == ACT_Q8_K) {
    for (int64_t b = 0; b < cols / 256; ++b) {
      const float* xb = x + 256 * b;
      float amax = 0.0f, mx = 0.0f;
      for (int j = 0; j < 256; ++j) {
        const float ax = std::fabs(xb[j]);
        if (ax > amax) {
          amax = ax;
          mx = xb[j];
        }
      }
      const float iscale = amax != 0.0f ? -127.0f / mx : 0.0f;
      const float d = amax != 0.0f ? 1.0f / iscale : 0.0f;
      for (int c = 0; c < 8; ++c) {
        QAct& a = out[8 * b + c];
        a.d = d;
        a.s0 = a.s1 = 0;
        for (int j = 0; j < 32; ++j) {
          int v = (int)std::nearbyint(iscale * xb[32 * c + j]);
          v = v > 127 ? 127 : v;
          a.qs[j] = (int8_t)v;
          (j < 16 ? a.s0 : a.s1) += v;
        }
        a.s = d * (float)(a.s0 + a.s1);
        lane_sums(a);
      }
    }
    return;
  }
  for (int64_t c = 0; c < nch; ++c) {
    const float* xb = x + 32 * c;
    QAct& a = out[c];
#if PP_SIMD == 2 && defined(__AVX512BW__) && defined(__AVX512VL__)
    {  // the same operations as the scalar loop below, 16 lanes at a time
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
      const __m512 vid = _mm512_set1_ps(id);
      constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, vid), R));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, vid), R));
      _mm_storeu_si128((__m128i*)a.qs, _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128((__m128i*)(a.qs + 16), _mm512_cvtepi32_epi8(q1));
      a.s0 = _mm512_reduce_add_epi32(q0);
      a.s1 = _mm512_reduce_add_epi32(q1);
      lane_sums(a);
      a.d = round_f16(d);
      a.s = kind == ACT_Q8_1 ? round_f16(d * (float)(a.s0 + a.s1)) : a.d * (float)(a.s0 + a.s1);
      continue;
    }
#endif
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    a.s0 = a.s1 = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = (int)std::nearbyint(xb[j] * id);
      a.qs[j] = (int8_t)v;
      (j < 16 ? a.s0 : a.s1) += v;
    }
    lane_sums(a);
    a.d = round_f16(d);
    a.s = kind == ACT_Q8_1 ? round_f16(d * (float)(a.s0 + a.s1)) : a.d * (float)(a.s0 + a.s1);
  }
}

// Integer dot of the 32 weight bytes with the chunk's int8 values, per half.
template <bool SIGNED>
inline void idot32(const U8x32& q, const int8_t* x, int32_t& i0, int32_t& i1) {
#if PP_ISIMD
  const __m256i xv = _mm256_loadu_si256((const __m256i*)x);
  __m256i u = q.v, s = xv;
  if (SIGNED) {  // |w| as unsigned times sign(w) * x
    u = _mm256_sign_epi8(q.v, q.v);
    s = _mm256_sign_epi8(xv, q.v);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
  __m128i t = _mm_hadd_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
  t = _mm_hadd_epi32(t, t);  // [I0, I1, I0, I1]
  i0 = _mm_cvtsi128_si32(t);
  i1 = _mm_extract_epi32(t, 1);
#else
  int32_t a = 0, b = 0;
  for (int j = 0; j < 16; ++j) {
    a += (SIGNED ? (int)(int8_t)q.b[j] : (int)q.b[j]) * x[j];
    b += (SIGNED ? (int)(int8_t)q.b[j + 16] : (int)q.b[j + 16]) * x[j + 16];
  }
  i0 = a;
  i1 = b;
#endif
}

template <int DT>
inline float chunk_qdot(const U8x32& q, const Affine& f, const QAct& a) {
  int32_t i0, i1;
  idot32<UDec<DT>::SIGNED>(q, a.qs, i0, i1);
  const float dot = f.a0 == f.a1 ? (f.a0 * a.d) * (float)(i0 + i1)
                                 : a.d * (f.a0 * (float)i0 + f.a1 * (float)i1);
  if (f.b0 == f.b1) return dot + f.b0 * a.s;  // Q8_1: llama.cpp's m * s
  return dot + a.d * (f.b0 * (float)a.s0 + f.b1 * (float)a.s1);
}

// ggml's order for the 32-element block types (vec_dot_q4_0_q8_0 and friends on AVX2): eight
// lanes, each the integer sum of four products (q - OFF) y, scaled by d_w d_x and accumulated
// with one FMA per block; then a fixed horizontal sum, plus (Q8_1) the sequential sum of m s.
// Following it exactly keeps powerpy's matmuls within rounding noise of llama.cpp's.
#if PP_ISIMD
typedef __m256 F8;
inline F8 f8_zero() { return _mm256_setzero_ps(); }
struct Prep {  // a block's weight bytes, ready for the u8 x s8 dot
  __m256i u, s;  // unsigned bytes (|q| for signed q), and the signs
  bool sgn;      // q is signed (Q8_0): the dot takes |q| times sign(q) * y
  int shift;     // q - OFF with OFF = 1 << shift: the dot subtracts OFF * (lane sums of y)
};
inline Prep prep8(const U8x32& q, bool sgn, int off) {
  Prep p{q.v, q.v, sgn, off == 8 ? 3 : off == 16 ? 4 : 0};
  if (sgn) p.u = _mm256_sign_epi8(q.v, q.v);
  return p;
}
inline void lanes8(const Prep& w, const QAct& a, F8& acc, float d) {
  __m256i y = _mm256_loadu_si256((const __m256i*)a.qs);
  if (w.sgn) y = _mm256_sign_epi8(y, w.s);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w.u, y);
#else
  __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w.u, y), _mm256_set1_epi16(1));
#endif
  if (w.shift) {  // the same integers as sum (q - OFF) y
    const __m256i ls = _mm256_loadu_si256((const __m256i*)a.ls);
    p = _mm256_sub_epi32(p, _mm256_sll_epi32(ls, _mm_cvtsi32_si128(w.shift)));
  }
  acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc);
}
inline float f8_hsum(F8 x) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
#else
struct F8 {
  float v[8];
};
inline F8 f8_zero() { return F8{{0, 0, 0, 0, 0, 0, 0, 0}}; }
struct Prep {
  const U8x32* q;
  bool sgn;
  int off;
};
inline Prep prep8(const U8x32& q, bool sgn, int off) { return Prep{&q, sgn, off}; }
inline void lanes8(const Prep& w, const QAct& a, F8& acc, float d) {
  const int8_t* x = a.qs;
  const U8x32& q = *w.q;
  const bool sgn = w.sgn;
  const int off = w.off;
  for (int l = 0; l < 8; ++l) {
    int32_t s = 0;
    for (int j = 4 * l; j < 4 * l + 4; ++j) s += ((sgn ? (int)(int8_t)q.b[j] : (int)q.b[j]) - off) * x[j];
    acc.v[l] = std::fma(d, (float)s, acc.v[l]);
  }
}
inline float f8_hsum(const F8& x) {
  float r[4];
  for (int i = 0; i < 4; ++i) r[i] = x.v[4 + i] + x.v[i];
  return (r[0] + r[2]) + (r[1] + r[3]);
}
#endif

template <int DT, int NT>
inline void row_qdot_blocks(const uint8_t* w, const QAct* xa, int64_t nch, const uint8_t* nx,
                            float* out, int64_t ldo) {
  using U = UDec<DT>;
  F8 acc[NT];
  float summs[NT];
  for (int t = 0; t < NT; ++t) {
    acc[t] = f8_zero();
    summs[t] = 0.0f;
  }
  int64_t pf = 0;
  for (int64_t c = 0; c < nch; ++c) {
    if (nx) prefetch_span(nx, pf, (c + 1) * Dec<DT>::BB);
    U8x32 q;
    Affine f;
    U::chunk(w, c, q, f);
    const Prep pw = prep8(q, U::SIGNED, U::OFF);
    for (int t = 0; t < NT; ++t) {
      const QAct& a = xa[t * nch + c];
      lanes8(pw, a, acc[t], f.a0 * a.d);
      if (act_kind<DT>() == ACT_Q8_1) summs[t] += f.b0 * a.s;
    }
  }
  if (nx) prefetch_span(nx, pf, row_bytes<DT>(nch * 32));
  for (int t = 0; t < NT; ++t) out[t * ldo] = f8_hsum(acc[t]) + summs[t];
}

// dot(W row w, quantized x); prefetches row nx (may be null).
template <int DT>
inline float row_qdot(const uint8_t* w, const QAct* xa, int64_t nch, const uint8_t* nx) {
  if constexpr (UDec<DT>::QK == 32) {
    float r;
    row_qdot_blocks<DT, 1>(w, xa, nch, nx, &r, 0);
    return r;
  }
  float s0 = 0.0f, s1 = 0.0f;
  int64_t pf = 0, c = 0;
  for (; c + 2 <= nch; c += 2) {
    if (nx) prefetch_span(nx, pf, (c + 2) * Dec<DT>::BB);
    U8x32 q0, q1;
    Affine f0, f1;
    UDec<DT>::chunk(w, c, q0, f0);
    UDec<DT>::chunk(w, c + 1, q1, f1);
    s0 += chunk_qdot<DT>(q0, f0, xa[c]);
    s1 += chunk_qdot<DT>(q1, f1, xa[c + 1]);
  }
  if (c < nch) {
    U8x32 q;
    Affine f;
    UDec<DT>::chunk(w, c, q, f);
    s0 += chunk_qdot<DT>(q, f, xa[c]);
  }
  if (nx) prefetch_span(nx, pf, row_bytes<DT>(nch * 32));
  return s0 + s1;
}

// out[t * ldo] = dot(row w, x_t) for NT quantized vectors x_t = xa + t * nch.
template <int DT, int NT>
inline void row_qdot_multi(const uint8_t* w, const QAct* xa, int64_t nch, const uint8_t* nx,
                           float* out, int64_t ldo) {
  if constexpr (UDec<DT>::QK == 32) return row_qdot_blocks<DT, NT>(w, xa, nch, nx, out, ldo);
  float acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  int64_t pf = 0;
  for (int64_t c = 0; c < nch; ++c) {
    if (nx) prefetch_span(nx, pf, (c + 1) * Dec<DT>::BB);
    U8x32 q;
    Affine f;
    UDec<DT>::chunk(w, c, q, f);
    for (int t = 0; t < NT; ++t) acc[t] += chunk_qdot<DT>(q, f, xa[t * nch + c]);
  }
  for (int t = 0; t < NT; ++t) out[t * ldo] = acc[t];
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
    D::chunk(w, b, w0);
    D::chunk(w, b + 1, w1);
    const float* xb = x + b * 32;
    for (int u = 0; u < NV; ++u) {
      a[u] = v_fma(w0[u], v_load(xb + u * VL), a[u]);
      a[NV + u] = v_fma(w1[u], v_load(xb + 32 + u * VL), a[NV + u]);
    }
  }
  if (b < nb) {
    vf w0[NV];
    D::chunk(w, b, w0);
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
    D::chunk(g, b, wg);
    D::chunk(up, b, wu);
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
    D::chunk(w, b, wv);
    float* ab = acc + b * 32;
    for (int u = 0; u < NV; ++u) v_store(ab + u * VL, v_fma(wv[u], hv, v_load(ab + u * VL)));
  }
  if (nx) prefetch_span(nx, pf, row_bytes<DT>(cols));
  for (int64_t i = nb * 32; i < cols; ++i) acc[i] += D::one(w, i) * hj;
}

// acc += sum_i h[i] * row w[i] for four rows at once: each slice of acc is loaded and stored once
// per four rows (one store per row would bound short quantized rows by the store port);
// prefetches rows nx[i] (null: none).
template <int DT>
inline void row_axpy4(const uint8_t* const* w, const float* h, float* acc, int64_t cols,
                      const uint8_t* const* nx) {
  using D = Dec<DT>;
  const int64_t nb = cols / 32;
  int64_t pf = 0;  // bytes of the upcoming rows prefetched so far (all four alike)
#if PP_SIMD == 2
  if constexpr (DT == DT_Q4_0) {  // h_i d folded into one scalar: the table stays constant
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_spans(nx, 4, pf, (b + 1) * D::BB);
      float* ab = acc + b * 32;
      vf a0 = v_load(ab), a1 = v_load(ab + 16);
      for (int r = 0; r < 4; ++r) {
        const uint8_t* p = w[r] + b * D::BB;
        const vf sr = v_set1(half_to_float(load_u16(p)) * h[r]);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 2)));
        a0 = v_fma(_mm512_permutexvar_ps(q, lut), sr, a0);  // vpermps reads the low 4 bits
        a1 = v_fma(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut), sr, a1);
      }
      v_store(ab, a0);
      v_store(ab + 16, a1);
    }
    prefetch_spans(nx, 4, pf, row_bytes<DT>(cols));
    return;
  }
#endif
  const vf h0 = v_set1(h[0]), h1 = v_set1(h[1]), h2 = v_set1(h[2]), h3 = v_set1(h[3]);
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_spans(nx, 4, pf, (b + 1) * D::BB);
    vf w0[NV], w1[NV], w2[NV], w3[NV];
    D::chunk(w[0], b, w0);
    D::chunk(w[1], b, w1);
    D::chunk(w[2], b, w2);
    D::chunk(w[3], b, w3);
    float* ab = acc + b * 32;
    for (int u = 0; u < NV; ++u) {
      vf a = v_load(ab + u * VL);
      a = v_fma(w0[u], h0, a);
      a = v_fma(w1[u], h1, a);
      a = v_fma(w2[u], h2, a);
      a = v_fma(w3[u], h3, a);
      v_store(ab + u * VL, a);
    }
  }
  prefetch_spans(nx, 4, pf, row_bytes<DT>(cols));
  for (int64_t c = nb * 32; c < cols; ++c)
    acc[c] += D::one(w[0], c) * h[0] + D::one(w[1], c) * h[1] + D::one(w[2], c) * h[2] +
              D::one(w[3], c) * h[3];
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
    D::chunk(w, b, wv);
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
    D::chunk(w, b, wv);
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

// ---- Q4_0 four blocks at a time (AVX-512 VBMI + VNNI) ---------------------------------------------
// A group of 4 Q4_0 blocks (128 elements, 72 bytes) is read with two loads: one two-register byte
// permute gathers its 64 nibble bytes, one word permute its 4 scales (the f16 d of block b is word
// 9 b). The low nibbles (elements 0..15 of each block) and the high ones (16..31), as unsigned
// bytes 0..15, each take one 512-bit u8 x s8 dot against the int8 activations, stored in the same
// order (QGroup), so a 32-bit lane sums 8 products of one block. The lane starts at -8 * (its 8
// activations), stored with them, which leaves sum (q - 8) y; it is then scaled by d_w d_x with
// one FMA. The integers equal ggml's; only the f32 summation order of the block terms differs from
// the one-block path (16 lanes instead of 8). A tile of R rows and NT tokens shares each weight
// decode among the tokens and each activation load among the rows.
#if PP_SIMD == 2 && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define PP_Q4W 1
struct alignas(64) QGroup {  // 4 Q8_0 activation blocks in the Q4_0 group order
  int8_t lo[64];     // elements 0..15 of blocks 0..3
  int8_t hi[64];     // elements 16..31 of blocks 0..3
  float dx[16];      // lane 4 b + l: d_x of block b
  int32_t minus8[16];  // lane i: -8 * (lo[4 i .. 4 i + 3] + hi[4 i .. 4 i + 3])
};

// One vector's QAct chunks (nch of them) -> (nch + 3) / 4 groups g[0], g[T], g[2 T], ... (the
// groups of T vectors are interleaved, so a GEMM reads its tokens' groups from one span);
// missing blocks of the last group are zeros (with d_x 0).
inline void pack_groups(const QAct* xa, int64_t nch, QGroup* g, int64_t T) {
  const int64_t ng = (nch + 3) / 4;
  for (int64_t i = 0; i < ng; ++i) std::memset((void*)(g + i * T), 0, sizeof(QGroup));
  for (int64_t c = 0; c < nch; ++c) {
    QGroup& q = g[c / 4 * T];
    const int b = (int)(c % 4);
    for (int j = 0; j < 16; ++j) {
      q.lo[16 * b + j] = xa[c].qs[j];
      q.hi[16 * b + j] = xa[c].qs[16 + j];
    }
    for (int l = 0; l < 4; ++l) {  // lane l: qs[4 l ..] (lo) and qs[16 + 4 l ..] (hi)
      q.dx[4 * b + l] = xa[c].d;
      q.minus8[4 * b + l] = -8 * (xa[c].ls[l] + xa[c].ls[4 + l]);
    }
  }
}

struct Q4Group {   // one row's group, decoded
  __m512i lo, hi;  // q as bytes 0..15, in the QGroup order
  __m512 dw;       // per lane: d_w of its block
};

// Decode group g of Q4_0 row w (nch blocks: the last group may be partial).
inline Q4Group q40_group(const uint8_t* w, int64_t g, int64_t nch) {
  alignas(64) static const uint8_t nib_at[64] = {
      2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17,   // block 0: bytes 2..17
      20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35,   // block 1: 20..35
      38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53,   // block 2: 38..53
      56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71};  // block 3: 56..71
  const __m512i d_idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 27, 27,
                                         27, 27, 18, 18, 18, 18, 9, 9, 9, 9, 0, 0, 0, 0);
  const uint8_t* p = w + 72 * g;
  __m512i v0, v1;
  if (4 * g + 4 <= nch) {
    v0 = _mm512_loadu_si512(p);
    v1 = _mm512_maskz_loadu_epi8(0xFF, p + 64);
  } else {  // the last, partial group: only its blocks' bytes are read (the rest decode as 0)
    const int64_t n = 18 * (nch - 4 * g);
    v0 = _mm512_maskz_loadu_epi8(n >= 64 ? ~0ULL : (1ULL << n) - 1, p);
    v1 = _mm512_setzero_si512();
  }
  const __m512i m4 = _mm512_set1_epi8(15);
  const __m512i nib = _mm512_permutex2var_epi8(v0, _mm512_load_si512(nib_at), v1);
  Q4Group q;
  q.lo = _mm512_and_si512(nib, m4);
  q.hi = _mm512_and_si512(_mm512_srli_epi16(nib, 4), m4);
  q.dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(d_idx, v0)));
  return q;
}

// out[r * ldr + t * ldo] = dot(Q4_0 row w[r], x_t) for R rows and NT activation vectors, group g
// of x_t at xg[g * T + t]; prefetches rows nx[r] (null: none) along the way. The R rows are
// read side by side, so R gathered rows are in flight at once.
template <int R, int NT>
inline void q40_tile(const uint8_t* const* w, const uint8_t* const* nx, const QGroup* xg,
                     int64_t T, int64_t nch, float* out, int64_t ldr, int64_t ldo) {
  const int64_t ng = (nch + 3) / 4;
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t pf = 0;  // bytes of the upcoming rows prefetched so far (all alike)
  for (int64_t g = 0; g < ng; ++g) {
    Q4Group q[R];
    for (int r = 0; r < R; ++r) q[r] = q40_group(w[r], g, nch);
    prefetch_spans(nx, R, pf, 72 * (g + 1));
    for (int t = 0; t < NT; ++t) {
      const QGroup& a = xg[g * T + t];
      const __m512i ylo = _mm512_load_si512(a.lo), yhi = _mm512_load_si512(a.hi);
      const __m512i m8 = _mm512_load_si512(a.minus8);
      const __m512 dx = _mm512_load_ps(a.dx);
      for (int r = 0; r < R; ++r) {
        __m512i s = _mm512_dpbusd_epi32(m8, q[r].lo, ylo);
        s = _mm512_dpbusd_epi32(s, q[r].hi, yhi);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(q[r].dw, dx), acc[r][t]);
      }
    }
  }
  prefetch_spans(nx, R, pf, 18 * nch);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) out[r * ldr + t * ldo] = _mm512_reduce_add_ps(acc[r][t]);
}
#endif

// Quantized activations for the kernels (act != 0 and a quantized DT): T vectors x + t * ldx,
// as QAct chunks (p), plus Q4_0's group layout (g) where it applies.
template <int DT>
struct ActBuf {
  QAct* p = nullptr;
  void* g = nullptr;
  int64_t nch = 0;
  ActBuf(int act, const float* x, int64_t ldx, int64_t T, int64_t cols, int nthreads = 1) {
    if (!act || act_kind<DT>() == ACT_F32) return;
    nch = cols / 32;
    p = (QAct*)std::malloc(sizeof(QAct) * (size_t)(nch * T > 0 ? nch * T : 1));
    if (!p) return;
#if defined(PP_Q4W)
    if constexpr (DT == DT_Q4_0) {
      const int64_t ng = (nch + 3) / 4;
      g = std::aligned_alloc(64, sizeof(QGroup) * (size_t)(ng * T > 0 ? ng * T : 1));
      if (!g) {
        std::free(p);
        p = nullptr;
        return;
      }
    }
#endif
    const int nt = T >= 16 ? nthreads : 1;  // a prompt's tokens are rounded in parallel
    run_partitioned(nt, T, [&](int64_t a, int64_t b) -> int {
      for (int64_t t = a; t < b; ++t) {
        quantize_act(act_kind<DT>(), x + t * ldx, cols, p + t * nch);
#if defined(PP_Q4W)
        if (g) pack_groups(p + t * nch, nch, (QGroup*)g + t, T);
#endif
      }
      return 0;
    });
  }
  ~ActBuf() {
    std::free(p);
    std::free(g);
  }
  bool failed(int act) const { return act && act_kind<DT>() != ACT_F32 && !p; }
};

// ---- kernels ----------------------------------------------------------------------------------

// dot(W row w, x), with the quantized activations of xa when it has them (else f32 x).
template <int DT>
inline float row_dot_any(const uint8_t* w, const float* x, const ActBuf<DT>& xa, int64_t cols,
                         const uint8_t* nx) {
#if defined(PP_Q4W)
  if constexpr (DT == DT_Q4_0)
    if (xa.g) {
      float r;
      q40_tile<1, 1>(&w, &nx, (const QGroup*)xa.g, 1, xa.nch, &r, 0, 0);
      return r;
    }
#endif
  if constexpr (act_kind<DT>() != ACT_F32)
    if (xa.p) return row_qdot<DT>(w, xa.p, cols / 32, nx);
  return row_dot<DT>(w, x, cols, nx);
}

template <int DT>
int gemv_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
              const int64_t* idx, int64_t k, float* out, int act, int nthreads) {
  const int64_t rb = row_bytes<DT>(cols), dist = prefetch_dist(rb);
  const int nt = team_size(nthreads, k * rb);
  ActBuf<DT> xa(act, x, cols, 1, cols);
  if (xa.failed(act)) return PP_ERR_ARG;
  return run_partitioned(nt, k, [&](int64_t a, int64_t b) -> int {
    int err = 0;
    auto row = [&](int64_t j) -> const uint8_t* {  // list position j's row; null past b
      const int64_t r = j < b ? row_at(idx, j, nrows) : -1;
      return r >= 0 ? W + r * ld : nullptr;
    };
    for (int64_t j = a; j < b; ++j) {
#if defined(PP_Q4W)
      if constexpr (DT == DT_Q4_0)
        if (xa.g && j + 1 < b) {  // two rows side by side
          const uint8_t* w[2] = {row(j), row(j + 1)};
          if (w[0] && w[1]) {
            const uint8_t* nx[2] = {row(j + dist), row(j + 1 + dist)};
            q40_tile<2, 1>(w, nx, (const QGroup*)xa.g, 1, xa.nch, out + j, 1, 0);
            ++j;
            continue;
          }
        }
#endif
      const uint8_t* w = row(j);
      if (!w) {
        out[j] = NAN;
        err = 1;
        continue;
      }
      out[j] = row_dot_any<DT>(w, x, xa, cols, row(j + dist));
    }
    return err;
  });
}

// out[i] = W_i x for nm (at most 4) matrices of one type and width, as one GEMV over their
// concatenated rows: x is rounded once and one thread team splits all the rows (attention's
// q, k and v; k and v alone are too small to pay for a team of their own).
template <int DT>
int gemv_multi_impl(const uint8_t* const* W, const int64_t* ld, const int64_t* nrows, int nm,
                    int64_t cols, const float* x, float* const* out, int act, int nthreads) {
  int64_t start[5] = {0, 0, 0, 0, 0};
  for (int i = 0; i < nm; ++i) start[i + 1] = start[i] + nrows[i];
  const int64_t total = start[nm], rb = row_bytes<DT>(cols), dist = prefetch_dist(rb);
  const int nt = team_size(nthreads, total * rb);
  ActBuf<DT> xa(act, x, cols, 1, cols);
  if (xa.failed(act)) return PP_ERR_ARG;
  return run_partitioned(nt, total, [&](int64_t a, int64_t b) -> int {
    int i = 0, k = 0;  // the matrices of rows j and j + dist
    for (int64_t j = a; j < b; ++j) {
      while (j >= start[i + 1]) ++i;
      const int64_t jn = j + dist;
      const uint8_t* nx = nullptr;
      if (jn < b) {
        while (jn >= start[k + 1]) ++k;
        nx = W[k] + (jn - start[k]) * ld[k];
      }
      const int64_t r = j - start[i];
      out[i][r] = row_dot_any<DT>(W[i] + r * ld[i], x, xa, cols, nx);
    }
    return 0;
  });
}

inline float activate(int variant, float g, float u) {
  switch (variant) {
    case V_REGLU:
      return (g > 0.0f ? g : 0.0f) * u;
    case V_DRELU:
      return (g > 0.0f ? g : 0.0f) * (u > 0.0f ? u : 0.0f);
    default:  // V_SWIGLU
      return ggml_silu(g) * u;
  }
}

template <int DT>
int glu_impl(const uint8_t* G, int64_t ldg, const uint8_t* U, int64_t ldu, int64_t nrows,
             int64_t cols, const float* x, const int64_t* idx, int64_t k, int variant, float* out,
             int act, int nthreads) {
  const int64_t rb = row_bytes<DT>(cols), dist = prefetch_dist(rb);
  const int nt = team_size(nthreads, k * rb * 2);
  ActBuf<DT> xa(act, x, cols, 1, cols);
  if (xa.failed(act)) return PP_ERR_ARG;
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
      const uint8_t* ng = rn >= 0 ? G + rn * ldg : nullptr;
      float g, u;
#if defined(PP_Q4W)
      if constexpr (DT == DT_Q4_0)
        if (xa.g) {  // gate and up rows as one 2-row tile: two streams at once
          float gu[2];
          const uint8_t* rows[2] = {G + r * ldg, U + r * ldu};
          const uint8_t* next[2] = {ng, nu};
          q40_tile<2, 1>(rows, next, (const QGroup*)xa.g, 1, xa.nch, gu, 1, 0);
          out[j] = activate(variant, gu[0], gu[1]);
          continue;
        }
#endif
      if (xa.p) {
        g = row_dot_any<DT>(G + r * ldg, x, xa, cols, ng);
        u = row_dot_any<DT>(U + r * ldu, x, xa, cols, nu);
      } else {
        row_dot2<DT>(G + r * ldg, U + r * ldu, x, cols, ng, nu, &g, &u);
      }
      out[j] = activate(variant, g, u);
    }
    return err;
  });
}

// acc += sum_{j in [a, b), h[j] != 0} h[j] * W[idx[j]]: the nonzero rows four at a time (the
// last 0-3 alone), prefetching the rows `dist` (at least 4) positions ahead. With tau, a row r
// also needs |h[j]| >= tau[r] (the cut); *kept (if given) receives the number of rows added.
template <int DT>
int axpy_range(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* h,
               const int64_t* idx, int64_t a, int64_t b, int64_t dist, float* acc,
               const float* tau = nullptr, int64_t* kept = nullptr) {
  const int64_t m = b > a ? b - a : 1;
  const uint8_t** rows = (const uint8_t**)std::malloc(sizeof(void*) * m);
  float* hs = (float*)std::malloc(sizeof(float) * m);
  if (!rows || !hs) {
    std::free(rows);
    std::free(hs);
    return PP_ERR_ARG;
  }
  int err = 0;
  int64_t n = 0;
  for (int64_t j = a; j < b; ++j) {
    if (h[j] == 0.0f) continue;
    const int64_t r = row_at(idx, j, nrows);
    if (r < 0) {
      err = 1;
      continue;
    }
    if (tau && !(std::fabs(h[j]) >= tau[r])) continue;  // as torch: NaN is cut
    rows[n] = W + r * ld;
    hs[n++] = h[j];
  }
  if (dist < 4) dist = 4;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint8_t* nx[4];
    for (int u = 0; u < 4; ++u) nx[u] = i + dist + u < n ? rows[i + dist + u] : nullptr;
    row_axpy4<DT>(rows + i, hs + i, acc, cols, nx);
  }
  for (; i < n; ++i) row_axpy<DT>(rows[i], hs[i], acc, cols, i + dist < n ? rows[i + dist] : nullptr);
  if (kept) *kept = n;
  std::free(rows);
  std::free(hs);
  return err;
}

template <int DT>
int axpy_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* h,
              const int64_t* idx, int64_t k, float* out, int accumulate, int nthreads,
              const float* tau = nullptr, int64_t* kept = nullptr) {
  const int64_t rb = row_bytes<DT>(cols), dist = prefetch_dist(rb);
  if (!accumulate) std::memset(out, 0, sizeof(float) * cols);
  const int nt = team_size(nthreads, k * rb);
  if (nt <= 1) return axpy_range<DT>(W, ld, nrows, cols, h, idx, 0, k, dist, out, tau, kept);

  // One private f32 accumulator per thread over a fixed partition of the index list, then a
  // column-parallel reduction in thread order: deterministic for a given thread count.
  const int64_t cpad = (cols + 15) / 16 * 16;
  float* buf = (float*)std::aligned_alloc(64, sizeof(float) * cpad * nt);
  if (!buf) return PP_ERR_ARG;
  int err = 0;
  int64_t added = 0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(nt) reduction(| : err) reduction(+ : added)
  {
    const int64_t t = thread_id(), n = team_threads();
    float* acc = buf + t * cpad;
    std::memset(acc, 0, sizeof(float) * cpad);
    int64_t mine = 0;  // the cut is applied here, by the thread that computed these h
    err |= axpy_range<DT>(W, ld, nrows, cols, h, idx, k * t / n, k * (t + 1) / n, dist, acc,
                          tau, &mine);
    added += mine;
#pragma omp barrier
    const int64_t c0 = cpad / 16 * t / n * 16, c1 = cpad / 16 * (t + 1) / n * 16;
    for (int64_t c = c0; c < c1 && c < cols; ++c) {
      float s = buf[c];
      for (int64_t i = 1; i < n; ++i) s += buf[i * cpad + c];
      out[c] += s;
    }
  }
#endif
  if (kept) *kept = added;
  std::free(buf);
  return err;
}

#if PP_SIMD == 2 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PP_WIDE 1
// Prompt batches (AVX-512 VNNI, 32-element block types): two blocks per 512-bit integer dot,
// activations as separate int8 rows (qs: T x cols), scales d and Q8_1 sums s (T x nch). The
// block terms then join one 8-lane accumulator block by block, in the one-token order
// (row_qdot_blocks), so a token's result is bit for bit the one-token result (and llama.cpp's).
template <int DT, int NT>
inline void row_qdot_wide(const uint8_t* w, const int8_t* qs, const float* dx, const float* sx,
                          int64_t cols, int64_t nch, float* out, int64_t ldo) {
  using U = UDec<DT>;
  constexpr bool SGN = U::SIGNED || U::OFF != 0;
  __m256 acc[NT];
  float summs[NT];
  for (int t = 0; t < NT; ++t) {
    acc[t] = _mm256_setzero_ps();
    summs[t] = 0.0f;
  }
  for (int64_t c = 0; c < nch; c += 2) {
    U8x32 q0, q1;
    Affine f0, f1;
    U::chunk(w, c, q0, f0);
    U::chunk(w, c + 1, q1, f1);
    __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(q0.v), q1.v, 1);
    if (U::OFF) wq = _mm512_sub_epi8(wq, _mm512_set1_epi8((char)U::OFF));
    const __m512i wu = SGN ? _mm512_abs_epi8(wq) : wq;
    const __mmask64 neg = SGN ? _mm512_movepi8_mask(wq) : 0;
    for (int t = 0; t < NT; ++t) {
      __m512i y = _mm512_loadu_si512(qs + t * cols + 32 * c);
      if (SGN) y = _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y);  // sign(w) * y
      const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, y));
      const float* d = dx + t * nch + c;
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(f0.a0 * d[0]), _mm512_castps512_ps256(p), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(f1.a0 * d[1]), _mm512_extractf32x8_ps(p, 1), acc[t]);
      if (act_kind<DT>() == ACT_Q8_1) {
        summs[t] += f0.b0 * sx[t * nch + c];
        summs[t] += f1.b0 * sx[t * nch + c + 1];
      }
    }
  }
  for (int t = 0; t < NT; ++t) out[t * ldo] = f8_hsum(acc[t]) + summs[t];
}

template <int DT>
int qgemm_wide(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const QAct* xa,
               int64_t T, float* out, int64_t ldo, int nt) {
  constexpr int64_t QT = 32;
  const int64_t nch = cols / 32;
  int8_t* qs = (int8_t*)std::malloc((size_t)(T * cols) + sizeof(float) * 2 * T * nch);
  if (!qs) return PP_ERR_ARG;
  float* dx = (float*)(qs + T * cols);  // T * cols is a multiple of 64: aligned enough
  float* sx = dx + T * nch;
  for (int64_t i = 0; i < T * nch; ++i) {
    std::memcpy(qs + 32 * i, xa[i].qs, 32);
    dx[i] = xa[i].d;
    sx[i] = xa[i].s;
  }
  const int64_t dist = prefetch_dist(row_bytes<DT>(cols));
  int st = run_partitioned(nt, nrows, [&](int64_t a, int64_t b) -> int {
    for (int64_t t0 = 0; t0 < T; t0 += QT) {
      const int64_t t1 = t0 + QT < T ? t0 + QT : T;
      for (int64_t r = a; r < b; ++r) {
        const uint8_t* w = W + r * ld;
        if (r + dist < b) prefetch_l2(W + (r + dist) * ld);
        int64_t t = t0;
        for (; t + 8 <= t1; t += 8)
          row_qdot_wide<DT, 8>(w, qs + t * cols, dx + t * nch, sx + t * nch, cols, nch,
                               out + t * ldo + r, ldo);
        for (; t < t1; ++t)
          row_qdot_wide<DT, 1>(w, qs + t * cols, dx + t * nch, sx + t * nch, cols, nch,
                               out + t * ldo + r, ldo);
      }
    }
    return 0;
  });
  std::free(qs);
  return st;
}
#endif

// Whether any of tokens t0..t0+n-1 needs any of rows r0..r0+nr-1: need is (T, nrows) bytes,
// laid out like the output, nonzero where the caller uses it.
inline bool any_needed(const uint8_t* need, int64_t nrows, int64_t r0, int nr, int64_t t0, int n) {
  for (int t = 0; t < n; ++t)
    for (int r = 0; r < nr; ++r)
      if (need[(t0 + t) * nrows + r0 + r]) return true;
  return false;
}

#if defined(PP_Q4W)
// Q4_0 prompt batches: tokens in tiles of 32 (their groups stay in L2), rows split over the
// threads in pairs, each weight group decoded once per 8 tokens.
inline int qgemm_q40(const uint8_t* W, int64_t ld, int64_t nrows, const QGroup* xg, int64_t nch,
                     int64_t T, float* out, int64_t ldo, const uint8_t* need, int nt) {
  constexpr int64_t QT = 32;
  const int64_t dist = prefetch_dist(18 * nch) * 2;
  return run_partitioned(nt, (nrows + 1) / 2, [&](int64_t a, int64_t b) -> int {
    a *= 2;
    b = 2 * b < nrows ? 2 * b : nrows;
    for (int64_t t0 = 0; t0 < T; t0 += QT) {
      const int64_t t1 = t0 + QT < T ? t0 + QT : T;
      for (int64_t r = a; r < b; r += 2) {
        const uint8_t* w[2] = {W + r * ld, W + (r + 1) * ld};
        const uint8_t* nx[2] = {nullptr, nullptr};
        if (r + dist + 1 < b) {
          nx[0] = W + (r + dist) * ld;
          nx[1] = nx[0] + ld;
        }
        const uint8_t* none[2] = {nullptr, nullptr};
        float* o = out + r;
        if (r + 2 > b) {  // an odd last row
          for (int64_t t = t0; t < t1; ++t)
            q40_tile<1, 1>(w, none, xg + t, T, nch, o + t * ldo, 1, ldo);
          continue;
        }
        // no token of the tile t .. t + n - 1 needs these rows: zeros instead
        auto skip = [&](int64_t t, int n) -> bool {
          if (!need || any_needed(need, nrows, r, 2, t, n)) return false;
          for (int64_t u = t; u < t + n; ++u) o[u * ldo] = o[u * ldo + 1] = 0.0f;
          return true;
        };
        int64_t t = t0;
        for (; t + 8 <= t1; t += 8)
          if (!skip(t, 8)) q40_tile<2, 8>(w, t == t0 ? nx : none, xg + t, T, nch, o + t * ldo, 1, ldo);
        for (; t + 4 <= t1; t += 4)
          if (!skip(t, 4)) q40_tile<2, 4>(w, t == t0 ? nx : none, xg + t, T, nch, o + t * ldo, 1, ldo);
        for (; t < t1; ++t)
          if (!skip(t, 1)) q40_tile<2, 1>(w, t == t0 ? nx : none, xg + t, T, nch, o + t * ldo, 1, ldo);
      }
    }
    return 0;
  });
}
#endif

// Quantized-activation GEMM: tokens in tiles of QT (their int8 rows stay in cache), rows split
// over the threads, each weight chunk decoded once per 4 tokens.
template <int DT>
int qgemm(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* x, int64_t ldx,
          int64_t T, float* out, int64_t ldo, const uint8_t* need, int nt) {
  constexpr int64_t QT = 32;
  ActBuf<DT> xa(1, x, ldx, T, cols, nt);
  if (!xa.p) return PP_ERR_ARG;
  const int64_t nch = cols / 32, dist = prefetch_dist(row_bytes<DT>(cols));
#if defined(PP_Q4W)
  if constexpr (DT == DT_Q4_0)
    return qgemm_q40(W, ld, nrows, (const QGroup*)xa.g, nch, T, out, ldo, need, nt);
#endif
#if defined(PP_WIDE)
  if constexpr (UDec<DT>::QK == 32)
    if (T >= 8 && nch % 2 == 0) return qgemm_wide<DT>(W, ld, nrows, cols, xa.p, T, out, ldo, nt);
#endif
  return run_partitioned(nt, nrows, [&](int64_t a, int64_t b) -> int {
    for (int64_t t0 = 0; t0 < T; t0 += QT) {
      const int64_t t1 = t0 + QT < T ? t0 + QT : T;
      for (int64_t r = a; r < b; ++r) {
        const uint8_t* w = W + r * ld;
        const uint8_t* nx = r + dist < b ? W + (r + dist) * ld : nullptr;
        for (int64_t t = t0; t < t1; t += 8) {
          const QAct* xt = xa.p + t * nch;
          float* o = out + t * ldo + r;
          const uint8_t* p = t == t0 ? nx : nullptr;
          switch (t1 - t >= 8 ? 8 : t1 - t) {
            case 1:
              row_qdot_multi<DT, 1>(w, xt, nch, p, o, ldo);
              break;
            case 2:
              row_qdot_multi<DT, 2>(w, xt, nch, p, o, ldo);
              break;
            case 3:
              row_qdot_multi<DT, 3>(w, xt, nch, p, o, ldo);
              break;
            case 4:
            case 5:
              row_qdot_multi<DT, 4>(w, xt, nch, p, o, ldo);
              if (t1 - t == 5) row_qdot_multi<DT, 1>(w, xt + 4 * nch, nch, nullptr, o + 4 * ldo, ldo);
              break;
            case 6:
            case 7:
              row_qdot_multi<DT, 6>(w, xt, nch, p, o, ldo);
              if (t1 - t == 7) row_qdot_multi<DT, 1>(w, xt + 6 * nch, nch, nullptr, o + 6 * ldo, ldo);
              break;
            default:
              row_qdot_multi<DT, 8>(w, xt, nch, p, o, ldo);
              break;
          }
        }
      }
    }
    return 0;
  });
}

template <int DT>
int gemm_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
              int64_t ldx, int64_t T, float* out, int64_t ldo, const uint8_t* need, int act,
              int nthreads) {
  constexpr int G = VL == 16 ? 4 : 2;  // vectors per pass (register budget)
  if (T == 1) return gemv_impl<DT>(W, ld, nrows, cols, x, nullptr, nrows, out, act, nthreads);
  const int64_t rb = row_bytes<DT>(cols), dist = prefetch_dist(rb);
  const int nt = team_size(nthreads, nrows * (rb + T * 64));
  if constexpr (act_kind<DT>() != ACT_F32)
    if (act) return qgemm<DT>(W, ld, nrows, cols, x, ldx, T, out, ldo, need, nt);
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
  if (dtype >= DT_Q4_K && dtype <= DT_Q6_K) return cols % 256 == 0;
  if (dtype >= DT_Q8_0 && dtype <= DT_Q5_1) return cols % 32 == 0;
  return dtype >= DT_F32 && dtype <= DT_BF16;
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

// ---- the fused decode FFN ------------------------------------------------------------------------

// y = x / sqrt(mean(x^2) + eps) * w, in ggml's order (squares summed in double).
static void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += (double)(x[i] * x[i]);
  const float scale = 1.0f / std::sqrt((float)(sum / (double)n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * scale) * w[i];
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

// ---- llama.cpp's float numerics: exp, SiLU, RoPE and f16-cache attention ----------------------
// With quantized activations and an f16 KV cache, powerpy follows ggml's CPU operations step by
// step (llama.cpp without flash attention), so that its logits equal llama.cpp's bit for bit.
// Each step below is one IEEE operation in ggml's order, written as loops over GW lanes: ggml's
// vector width on this CPU (16 with AVX-512, 8 with AVX2), which sets its summation orders.

// ggml_expf on 16 lanes at once: the same operations (scalef is j * 2^n with one rounding).
#if PP_SIMD == 2
inline __m512 ggml_expf16(__m512 x) {
  const __m512 r = _mm512_set1_ps(0x1.8p23f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r), r);
  const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
  const __m512 u = _mm512_mul_ps(b, b);
  const __m512 j = _mm512_fmadd_ps(
      _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)),
                      u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
      u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
  const __m512 res = _mm512_scalef_ps(j, n);
  const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
  if (!big) return res;
  const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ),
                                          _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
  return _mm512_mask_blend_ps(big, res, alt);
}
#endif

// out[i] = silu(g[i]) * u[i] for i in [a, b), ggml's swiglu.
inline void swiglu_range(const float* g, const float* u, int64_t a, int64_t b, float* out) {
  int64_t i = a;
#if PP_SIMD == 2
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= b; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = ggml_expf16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)),
                                            _mm512_loadu_ps(u + i)));
  }
#endif
  for (; i < b; ++i) out[i] = ggml_silu(g[i]) * u[i];
}

// A dot product of two f16 vectors of n elements in ggml's order. one = true: ggml_vec_dot_f16
// (one token: four GW-lane accumulators over 4 GW-element steps, summed (0 + 2) + (1 + 3) and
// reduced by vreduce_gw, then the rest in double); one = false: the batched tinyBLAS kernel (one
// GW-lane accumulator, n % GW == 0, reduced by hsum_gw).
inline float dot_f16(const uint16_t* x, const uint16_t* y, int64_t n, bool one) {
  constexpr int LG = GW / VL;  // vectors per GW lanes
  float lanes[16];
  if (!one) {
    vf acc[LG];
    for (int u = 0; u < LG; ++u) acc[u] = v_zero();
    for (int64_t i = 0; i < n; i += GW)
      for (int u = 0; u < LG; ++u)
        acc[u] = v_fma(v_load_h(x + i + u * VL), v_load_h(y + i + u * VL), acc[u]);
#if PP_SIMD == 2
    return _mm512_reduce_add_ps(acc[0]);
#else
    for (int u = 0; u < LG; ++u) v_store(lanes + u * VL, acc[u]);
    return hsum_gw(lanes);
#endif
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
#if PP_SIMD == 2
  double s = _mm512_reduce_add_ps(acc[0][0]);
#else
  for (int u = 0; u < LG; ++u) v_store(lanes + u * VL, acc[0][u]);
  double s = vreduce_gw(lanes);
#endif
  for (int64_t i = np; i < n; ++i) s += (double)(half_to_float(x[i]) * half_to_float(y[i]));
  return (float)s;
}

#if PP_SIMD == 2
// The batched (tinyBLAS) q·k of 16 cells k + c * stride at once, q (nq vectors of 16) preloaded:
// one accumulator per cell, then reduce16 of all 16 by shuffles that pair the same lanes as
// reduce16 does (halves 8 + 8, 4 + 4, then (0 + 2) + (1 + 3)), so each result is bit for bit
// dot_f16(..., one = false). s[c] = the score of cell c.
inline void reduce16_cells(const __m512* A, float* s);

template <int NQ>
inline void kq16(const uint16_t* k, int64_t stride, const __m512* qv, float* s) {
  __m512 A[16];
  for (int c = 0; c < 16; ++c) A[c] = _mm512_setzero_ps();
  for (int e = 0; e < NQ; ++e)  // NQ known: the 16 accumulators stay in registers
    for (int c = 0; c < 16; ++c)
      A[c] = _mm512_fmadd_ps(v_load_h(k + c * stride + 16 * e), qv[e], A[c]);
  reduce16_cells(A, s);
}

// The one-token q·k (ggml_vec_dot_f16's order) of 16 cells at once, head_dim 64 NS: per cell
// four 16-lane accumulators over 64-element steps, summed (0 + 2) + (1 + 3), then reduced as
// kq16 does; bit for bit dot_f16(..., one = true).
template <int NS>
inline void kq16_one(const uint16_t* k, int64_t stride, const __m512* qv, float* s) {
  __m512 A[16];
  for (int c = 0; c < 16; ++c) {
    __m512 a[4];
    for (int j = 0; j < 4; ++j) a[j] = _mm512_setzero_ps();
    for (int st = 0; st < NS; ++st)
      for (int j = 0; j < 4; ++j)
        a[j] = _mm512_fmadd_ps(v_load_h(k + c * stride + 64 * st + 16 * j), qv[4 * st + j], a[j]);
    A[c] = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
  }
  reduce16_cells(A, s);
}

// s[c] = reduce16(A[c]) for 16 cells, by shuffles that pair lanes as reduce16 does.
inline void reduce16_cells(const __m512* A, float* s) {
  __m512 H[8], Q[4];
  for (int p = 0; p < 8; ++p)  // H[p] = (h of cell 2p, h of cell 2p + 1), 8 lanes each
    H[p] = _mm512_add_ps(_mm512_shuffle_f32x4(A[2 * p], A[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(A[2 * p], A[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k4 = 0; k4 < 4; ++k4)  // Q[k4] = q of cells 4 k4 .. 4 k4 + 3, 4 lanes each
    Q[k4] = _mm512_add_ps(_mm512_shuffle_f32x4(H[2 * k4], H[2 * k4 + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(H[2 * k4], H[2 * k4 + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 R[2];  // 128-bit lane j of R[m]: (r0, r1) of cell 8 m + j, then of cell 8 m + 4 + j
  for (int m = 0; m < 2; ++m)
    R[m] = _mm512_add_ps(_mm512_shuffle_ps(Q[2 * m], Q[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(Q[2 * m], Q[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // element 4 j + k: the sum of cell 4 k + j
  const __m512 Z = _mm512_add_ps(_mm512_shuffle_ps(R[0], R[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(R[0], R[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  _mm512_storeu_ps(s, _mm512_permutexvar_ps(idx, Z));
}
#endif

// Softmax of scores s[0..S) (scaled by `scale`, ggml_soft_max_ext) into f16 weights p16, in
// GW-cell chunks: each chunk's exps are summed as one vector (hsum_gw), the chunk sums in double.
// llama.cpp's cache pads a row with masked cells; their exps are 0 and change no sum.
inline void softmax_f16(float* s, int64_t S, float scale, uint16_t* p16) {
  float mx = -INFINITY;
  int64_t t1 = 0;
#if PP_SIMD == 2
  __m512 m16 = _mm512_set1_ps(-INFINITY);
  for (; t1 + 16 <= S; t1 += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + t1), _mm512_set1_ps(scale));
    _mm512_storeu_ps(s + t1, v);
    m16 = _mm512_max_ps(m16, v);
  }
  mx = _mm512_reduce_max_ps(m16);  // a maximum is exact in any order
#endif
  for (; t1 < S; ++t1) mx = (s[t1] *= scale) > mx ? s[t1] : mx;
  double sum = 0.0;
  for (int64_t t0 = 0; t0 < S; t0 += GW) {
    float e[16] = {};
    const int64_t m = S - t0 < GW ? S - t0 : GW;
#if PP_SIMD == 2
    const __mmask16 k = (__mmask16)((1u << m) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(k, s + t0);
    _mm512_storeu_ps(e, _mm512_maskz_mov_ps(k, ggml_expf16(_mm512_sub_ps(v, _mm512_set1_ps(mx)))));
#else
    for (int64_t t = 0; t < m; ++t) e[t] = ggml_expf(s[t0 + t] - mx);
#endif
    for (int64_t t = 0; t < m; ++t) s[t0 + t] = e[t];
    sum += (double)hsum_gw(e);
  }
  const float inv = (float)(1.0 / sum);
  int64_t t = 0;
#if PP_SIMD == 2
  for (; t + 16 <= S; t += 16)
    _mm256_storeu_si256((__m256i*)(p16 + t),
                        _mm512_cvtps_ph(_mm512_mul_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(inv)),
                                        _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; t < S; ++t) p16[t] = float_to_half(s[t] * inv);
}

// Attention of T query tokens at positions p0.. in ggml's numerics: q (T, n_head * hd) f32 after
// RoPE; the f16 caches hold rows of n_kv * hd per position (0 .. p0 + T - 1 filled); query head h
// reads kv head h / (n_head / n_kv); out (T, n_head * hd). One token follows llama.cpp's
// one-token order (ggml_vec_dot_f16), a batch its tinyBLAS order where that kernel applies
// (head_dim % GW == 0 for q·k, head_dim % 4 == 0 for the weighted sum of v).
static int attn_ggml(const float* q, const uint16_t* kc, const uint16_t* vc, int64_t p0, int64_t T,
                     int64_t n_head, int64_t n_kv, int64_t hd, float* out, int nthreads) {
  const bool one_kq = T == 1 || hd % GW, one_kqv = T == 1 || hd % 4;
  const int64_t nkv = n_kv * hd, group = n_head / n_kv, S = p0 + T;
  const float scale = 1.0f / std::sqrt((float)hd);
  const int nt = team_size(nthreads, T * S * nkv * 8 * group);
  return run_partitioned(nt, T * n_head, [&](int64_t a, int64_t b) -> int {
    std::vector<float> s(S), acc(64 * hd);
    std::vector<uint16_t> q16(hd), p16(S);
    for (int64_t job = a; job < b; ++job) {
      const int64_t i = job / n_head, h = job % n_head, n = p0 + i + 1;  // cells seen
      const int64_t off = h / group * hd;
      for (int64_t e = 0; e < hd; ++e) q16[e] = float_to_half(q[i * n_head * hd + h * hd + e]);
      int64_t t0 = 0;
#if PP_SIMD == 2
      if (hd == 64 || hd == 128) {  // the common head sizes: 16 cells at a time
        __m512 qv[8];
        for (int64_t e = 0; e < hd / 16; ++e) qv[e] = v_load_h(q16.data() + 16 * e);
        for (; t0 + 16 <= n; t0 += 16) {
          const uint16_t* k = kc + t0 * nkv + off;
          if (one_kq) {
            if (hd == 64) kq16_one<1>(k, nkv, qv, s.data() + t0);
            else kq16_one<2>(k, nkv, qv, s.data() + t0);
          } else if (hd == 64) {
            kq16<4>(k, nkv, qv, s.data() + t0);
          } else {
            kq16<8>(k, nkv, qv, s.data() + t0);
          }
        }
      }
#endif
      for (int64_t t = t0; t < n; ++t) s[t] = dot_f16(kc + t * nkv + off, q16.data(), hd, one_kq);
      softmax_f16(s.data(), n, scale, p16.data());
      // out[d] = dot over cells of v[., d] and p16, cell t in lane (t / 16) % 4 (one token) or
      // 0, and t % 16; the padding cells of llama.cpp's cache add zeros, which change no sum.
      float* o = out + i * n_head * hd + h * hd;
#if PP_SIMD == 2
      if (one_kqv && hd % 16 == 0) {  // one token: 4 x 16 lanes of 16 dims, 16 in registers
        for (int64_t t = 0; t < n; ++t) s[t] = half_to_float(p16[t]);
        for (int64_t dc = 0; dc < hd; dc += 16) {
          __m512 G[4][16];  // lane (g, l): cells t with (t / 16) % 4 == g and t % 16 == l
          const uint16_t* vr = vc + off + dc;
          for (int g = 0; g < 4; ++g) {
            __m512 A[16];
            for (int l = 0; l < 16; ++l) A[l] = _mm512_setzero_ps();
            for (int64_t t0 = 16 * g; t0 < n; t0 += 64) {
              const int64_t m = n - t0 < 16 ? n - t0 : 16;
              for (int l = 0; l < m; ++l)
                A[l] = _mm512_fmadd_ps(v_load_h(vr + (t0 + l) * nkv), _mm512_set1_ps(s[t0 + l]),
                                       A[l]);
            }
            for (int l = 0; l < 16; ++l) G[g][l] = A[l];
          }
          __m512 L[16];
          for (int l = 0; l < 16; ++l)
            L[l] = _mm512_add_ps(_mm512_add_ps(G[0][l], G[2][l]), _mm512_add_ps(G[1][l], G[3][l]));
          _mm512_storeu_ps(o + dc, tree16(L));
        }
        continue;
      }
      if (!one_kqv && hd % 16 == 0) {  // the 16 lanes of 16 dims in registers
        for (int64_t t = 0; t < n; ++t) s[t] = half_to_float(p16[t]);
        for (int64_t dc = 0; dc < hd; dc += 16) {
          __m512 A[16];
          for (int l = 0; l < 16; ++l) A[l] = _mm512_setzero_ps();
          const uint16_t* vr = vc + off + dc;
          const float* pf = s.data();  // the weights as f32 (exact: f16 values)
          int64_t t = 0;
          for (; t + 16 <= n; t += 16)
            for (int l = 0; l < 16; ++l)
              A[l] = _mm512_fmadd_ps(v_load_h(vr + (t + l) * nkv), _mm512_set1_ps(pf[t + l]), A[l]);
          for (int l = 0; t < n; ++t, ++l)
            A[l] = _mm512_fmadd_ps(v_load_h(vr + t * nkv), _mm512_set1_ps(pf[t]), A[l]);
          _mm512_storeu_ps(o + dc, tree16(A));  // reduce16 of the lanes, 16 dims at once
        }
        continue;
      }
#endif
      std::fill(acc.begin(), acc.end(), 0.0f);  // (4 GW lanes, hd): lane-major sums
      for (int64_t t = 0; t < n; ++t) {
        const vf p = v_set1(half_to_float(p16[t]));
        float* ac = acc.data() + ((one_kqv ? (t / GW) % 4 * GW : 0) + t % GW) * hd;
        const uint16_t* vr = vc + t * nkv + off;
        int64_t d = 0;
        for (; d + VL <= hd; d += VL) v_store(ac + d, v_fma(v_load_h(vr + d), p, v_load(ac + d)));
        for (; d < hd; ++d) ac[d] = std::fma(half_to_float(vr[d]), half_to_float(p16[t]), ac[d]);
      }
      // lane l: (accumulators 0 + 2) + (1 + 3) for one token; then the GW lanes reduced as
      // ggml_vec_dot_f16 (one token) or tinyBLAS (a batch) does, VL dims at a time
      int64_t d0 = 0;
      for (; d0 + VL <= hd; d0 += VL) {
        const float* c = acc.data() + d0;
        vf L[16];
        for (int l = 0; l < GW; ++l)
          L[l] = one_kqv ? v_add(v_add(v_load(c + l * hd), v_load(c + (2 * GW + l) * hd)),
                                 v_add(v_load(c + (GW + l) * hd), v_load(c + (3 * GW + l) * hd)))
                         : v_load(c + l * hd);
        v_store(o + d0, one_kqv ? vreduce_gw(L) : hsum_gw(L));
      }
      for (int64_t d = d0; d < hd; ++d) {
        const float* c = acc.data() + d;
        float lanes[16];
        for (int l = 0; l < GW; ++l)
          lanes[l] = one_kqv ? (c[l * hd] + c[(2 * GW + l) * hd]) + (c[(GW + l) * hd] + c[(3 * GW + l) * hd])
                             : c[l * hd];
        o[d] = one_kqv ? vreduce_gw(lanes) : hsum_gw(lanes);
      }
    }
    return 0;
  });
}

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
// updated in place. layers: n_layer records of 49 int64: attention mats q, k, v, output (20),
// FFN mats fc1, fc2, gate, up, down (25; fc1 and fc2 zero: dense), then attn_norm, ffn_norm,
// down_stored and the FFN's cut tau (zero: none). Layer l's keys and values are at
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
    const int64_t* rec = layers + 49 * l;
    if (rec[4] != d) {
      st = PP_ERR_ARG;
      break;
    }
    st = pp_attn_decode(rec, x, (const float*)rec[45], eps, rot, n_rot, n_head, n_kv, hd,
                        (char*)kc + l * layer_bytes, (char*)vc + l * layer_bytes, cdt, pos, y, act,
                        nthreads);
    if (st) break;
    const int64_t k = pp_ffn_decode(rec + 20, thr, (const float*)rec[48], y,
                                    (const float*)rec[46], eps, variant, (int)rec[47], x, act,
                                    nthreads);
    if (k < 0) st = (int)-k;
    else counts[l] = k;
  }
  std::free(y);
  return st;
}

// ggml's RoPE angles (NORM mode): for each position p = pos[i], theta = p and, pair by pair,
// (cosf, sinf) of theta, then theta *= base^(-2 / n_rot), all in f32. out (n, n_rot / 2, 2).
void pp_rope_table(const int64_t* pos, int64_t n, int64_t n_rot, float base, float* out) {
  const float theta_scale = powf(base, -2.0f / (float)n_rot);
  for (int64_t i = 0; i < n; ++i) {
    float theta = (float)pos[i];
    for (int64_t j = 0; j < n_rot / 2; ++j, theta *= theta_scale) {
      out[(i * (n_rot / 2) + j) * 2] = cosf(theta);
      out[(i * (n_rot / 2) + j) * 2 + 1] = sinf(theta);
    }
  }
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
int pp_abi_version(void) { return 10; }

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
