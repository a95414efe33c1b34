#pragma once
// Shared by every kernel file: the codes Python mirrors (dtypes, variants, statuses; the decode
// layer record: layer_record.h), the tuning knobs, scalar conversions, fixed summation orders,
// prefetching and the thread partitioning.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <type_traits>
#include <utility>

#include "layer_record.h"  // the decode blocks' layer record and its LF_* flags

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

// Bumped whenever an export or its meaning changes; kernels.py refuses a library with another.
#define PP_ABI_VERSION 29

// Code that is part of its caller (compile-time loops, the arch headers' block decoders).
#define PP_ALWAYS_INLINE inline __attribute__((always_inline))

namespace {

// Python: powerpy.model.kernels.DTYPE_CODES (checked at load through pp_dtype_code).
enum DType {
  DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2, DT_Q8_0 = 3, DT_Q4_0 = 4,
  DT_Q4_1 = 5, DT_Q5_0 = 6, DT_Q5_1 = 7, DT_Q4_K = 8, DT_Q5_K = 9, DT_Q6_K = 10,
  DT_Q4_KX8 = 11, DT_Q4_KX8V = 12, DT_Q4_0X8 = 13, DT_MXFP4 = 14, DT_MXFP4X8 = 15,
  DT_COUNT = 16
};  // Q4_KX8: Q4_K rows interleaved 8 at a time (q4_k_x8.h); V: every token in its GEMV's order;
// Q4_0X8: Q4_0 rows interleaved 8 at a time (q4_0_x8.h); MXFP4: mxfp4.h's own kernels;
// MXFP4X8: MXFP4 rows interleaved 8 at a time (mxfp4_x8.h)
// ggml's type id of each DType (powerpy.formats.constants.GGMLType), by DType code.
constexpr int GGML_TYPE_OF[DT_COUNT] = {0, 1, 30, 8, 2, 3, 6, 7, 12, 13, 14, -1, -1, -1, 39, -1};
inline bool is_x8(int dtype) {
  return dtype == DT_Q4_KX8 || dtype == DT_Q4_KX8V || dtype == DT_Q4_0X8 || dtype == DT_MXFP4X8;
}
// FFN activations: the gated ones h = act(gate·x, up·x), then the ungated h = act(up·x).
enum Variant {
  V_REGLU = 0, V_DRELU = 1, V_SWIGLU = 2, V_GEGLU = 3, V_RELU = 4, V_GELU = 5, V_COUNT = 6
};
enum Status { PP_OK = 0, PP_ERR_INDEX = 1, PP_ERR_ARG = 2 };

// How far ahead (at least) the next-row prefetch reaches, in bytes: a build constant (-D), as
// the threads' floor below; it changes only speed. Before ABI 27 pp_set_tuning set it at run time,
// a process-wide variable that every call read.
#ifndef PP_PREFETCH_BYTES
#define PP_PREFETCH_BYTES 8192
#endif
constexpr int64_t PREFETCH_BYTES = PP_PREFETCH_BYTES;
// Below this much work per thread, a kernel starts fewer threads. It changes only speed: no
// kernel's bits depend on how many threads run it. Tests build a library with 1 (-D) so that
// tiny inputs take several threads.
#ifndef PP_MIN_BYTES_PER_THREAD
#define PP_MIN_BYTES_PER_THREAD 32768
#endif
constexpr int64_t MIN_BYTES_PER_THREAD = PP_MIN_BYTES_PER_THREAD;

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

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float round_f16(float f) { return half_to_float(float_to_half(f)); }

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
// rope_at: the pair (p[0], p[off]) (NEOX mode: off = n_rot / 2).
inline void rope_at(float* p, int64_t off, float c, float s) {
  const float a = p[0], b = p[off];
  p[0] = std::fma(a, c, -(b * s));
  p[off] = std::fma(a, s, b * c);
}
inline void rope_pair(float* p, float c, float s) { rope_at(p, 1, c, s); }

// v as its own rounded value: a following add is not fused with the product that made v (an
// FMA). ggml computes such steps as separate operations (its norm, then mul, then add).
inline float no_contract(float v) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+x"(v));
#else
  volatile float t = v;
  v = t;
#endif
  return v;
}

// ggml_gelu_f32: GELU's tanh form in f32, written as ggml writes it (the compiler fuses the same
// multiply-add, 1 + a·x·x).
inline float gelu_tanh(float x) {
  const float a = 0.044715f, s = 0.79788456080286535587989211986876f;
  return 0.5f * x * (1.0f + tanhf(s * x * (1.0f + a * x * x)));
}

// ggml's GELU table (GGML_GELU_FP16): gelu_tanh of every f16 value, rounded to f16; built once.
inline const uint16_t* gelu_table() {
  static const std::vector<uint16_t> t = [] {
    std::vector<uint16_t> v(65536);
    for (uint32_t i = 0; i < 65536; ++i) v[i] = float_to_half(gelu_tanh(half_to_float((uint16_t)i)));
    return v;
  }();
  return t.data();
}

// GELU of x: under llama.cpp's numerics ggml's, x's f16 value looked up in the table t (0 at or
// below -10, x at or above 10); t null: the erf form (HF's nn.GELU). Callers fetch t once
// (gelu_lut) outside their loops.
inline const uint16_t* gelu_lut(int act) { return act ? gelu_table() : nullptr; }
inline float gelu(float x, const uint16_t* t) {
  if (!t) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440084436210484f));
  if (x <= -10.0f) return 0.0f;
  if (x >= 10.0f) return x;
  return half_to_float(t[float_to_half(x)]);
}

// GEGLU's gate activation times u: ggml's table t under llama.cpp's numerics, else (t null) the
// tanh form.
inline float geglu(float g, float u, const uint16_t* t) {
  if (!t) return gelu_tanh(g) * u;
  if (g <= -10.0f) return 0.0f;
  if (g >= 10.0f) return g * u;
  return half_to_float(t[float_to_half(g)]) * u;
}

// ---- prefetching --------------------------------------------------------------------------------

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

// R upcoming rows (prefetch_spans; one row: prefetch_span).
template <int R>
inline void prefetch_rows(const uint8_t* const* nx, int64_t& pf, int64_t end) {
  if constexpr (R == 1) {
    if (nx[0]) prefetch_span(nx[0], pf, end);
  } else {
    prefetch_spans(nx, R, pf, end);
  }
}

// ---- data shared by the decoders and the dot products -------------------------------------------

// A 32-element chunk's affine map per half (elements 0..15 and 16..31): y = a_h * q + b_h.
struct Affine {
  float a0, a1, b0, b1;
};

// ggml's vec_dot_type of a weight type: the rounding of the activations x (quants.h).
enum ActKind { ACT_F32 = 0, ACT_Q8_0 = 1, ACT_Q8_1 = 2, ACT_Q8_K = 3 };

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

// ---- threading helpers ------------------------------------------------------------------------

// Threads worth starting for `work_bytes` of memory traffic (an OpenMP region costs ~2 us).
inline int team_size(int nthreads, int64_t work_bytes) {
  int64_t t = work_bytes / MIN_BYTES_PER_THREAD;
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

// Rows to prefetch ahead: at least 2, enough to cover PREFETCH_BYTES.
inline int64_t prefetch_dist(int64_t rb) {
  int64_t d = rb > 0 ? (PREFETCH_BYTES + rb - 1) / rb : 2;
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

// Run fn(a, b) over [0, k) in chunks (about eight per thread, a multiple of `grain`) handed out
// to up to nt threads as each finishes its last (a prompt's GEMM: on a shared host one thread
// may run slower, and a fixed partition leaves the other waiting at the end); returns the OR of
// the fn results.
template <class Fn>
inline int run_dynamic(int nt, int64_t k, int64_t grain, Fn fn) {
  if (nt > 1) {  // about eight chunks per thread, a multiple of grain
    const int64_t g = (k + 8 * nt - 1) / (8 * nt);
    grain = (g + grain - 1) / grain * grain;
  }
  if (nt <= 1 || k <= grain) return fn((int64_t)0, k);
  const int64_t n = (k + grain - 1) / grain;
  int err = 0;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) reduction(| : err)
  for (int64_t i = 0; i < n; ++i) err |= fn(i * grain, i + 1 < n ? (i + 1) * grain : k);
#else
  err = fn((int64_t)0, k);
#endif
  return err;
}

}  // namespace
