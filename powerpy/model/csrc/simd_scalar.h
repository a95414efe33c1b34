#pragma once
// Scalar "vectors" (1 lane) for builds without AVX2 + FMA + F16C: the same names as simd_avx2.h,
// with ggml's 16-lane reductions (llama.cpp's generic build sums as its AVX-512 one does).

#if defined(__AVX2__)  // AVX2 without FMA or F16C: AVX2's byte vectors, scalar floats
#include "bytes_avx2.h"
#else
#include "bytes_scalar.h"
#endif

#define PP_SIMD 0

namespace {

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

// ggml's vector width and reductions (see simd_avx512.h).
constexpr int GW = 16;
template <class T>
inline T hsum_gw(T* a) {
  return tree16(a);
}
template <class T>
inline T vreduce_gw(T* a) {
  return tree16(a);
}

// ---- 32-element block decoders: 32 elements -> NV = 32 floats (exact values) -------------------

PP_ALWAYS_INLINE void dec_f16(const uint8_t* p, vf* w) {
  for (int u = 0; u < 32; ++u) w[u] = half_to_float(load_u16(p + 2 * u));
}

PP_ALWAYS_INLINE void dec_bf16(const uint8_t* p, vf* w) {
  for (int u = 0; u < 32; ++u) w[u] = bf16_to_float(load_u16(p + 2 * u));
}

// Q8_0: int8 qs[32] times d.
PP_ALWAYS_INLINE void dec_q8_0(const uint8_t* qs, float d, vf* w) {
  for (int u = 0; u < 32; ++u) w[u] = (float)(int8_t)qs[u] * d;
}

// Q4_0: (nibble - 8) d.
PP_ALWAYS_INLINE void dec_q4_0(const uint8_t* qs, float d, vf* w) {
  for (int j = 0; j < 16; ++j) {
    w[j] = (float)((int)(qs[j] & 15) - 8) * d;
    w[j + 16] = (float)((int)(qs[j] >> 4) - 8) * d;
  }
}

// Unsigned bytes q through their affine maps: y = a_h q + b_h.
PP_ALWAYS_INLINE void dec_bytes(const U8x32& q, const Affine& f, vf* w) {
#if PP_ISIMD
  alignas(32) uint8_t b[32];
  _mm256_store_si256((__m256i*)b, q.v);
#else
  const uint8_t* b = q.b;
#endif
  for (int j = 0; j < 32; ++j)
    w[j] = j < 16 ? std::fma((float)b[j], f.a0, f.b0) : std::fma((float)b[j], f.a1, f.b1);
}

// No vector rounding of activations: quantize_act's loop does it.
inline bool quant_act_vec(int, const float*, QAct&) { return false; }

}  // namespace

inline int64_t swiglu_vec(const float*, const float*, int64_t a, int64_t, float*) { return a; }
