#pragma once
// AVX-512F float vectors (16 lanes): the vector operations, the 32-element block decoders of the
// float and byte types, ggml's 16-lane reductions and the vector rounding of Q8_0/Q8_1
// activations (AVX-512BW/VL). simd_avx2.h and simd_scalar.h have the same names.

#if !(defined(__AVX512F__))
#error "simd_avx512.h is for builds with AVX-512F (simd.h chooses the arch headers)"
#endif

#include "bytes_avx2.h"  // (AVX-512 builds have AVX2)

#define PP_SIMD 2

namespace {

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

// ggml's vector width on this CPU (llama.cpp is built for the same one): its dot products and
// softmax sum in GW-lane vectors. With AVX-512 both of its reductions, tinyBLAS's hsum and
// GGML_F16_VEC_REDUCE, are _mm512_reduce_add_ps (tree16).
constexpr int GW = 16;
template <class T>
inline T hsum_gw(T* a) {
  return tree16(a);
}
template <class T>
inline T vreduce_gw(T* a) {
  return tree16(a);
}
// The same for GW lanes held in GW / VL vectors.
inline float lanes_hsum(const vf* acc) { return _mm512_reduce_add_ps(acc[0]); }
inline float lanes_vreduce(const vf* acc) { return _mm512_reduce_add_ps(acc[0]); }

// ---- 32-element block decoders: 32 elements -> NV = 2 vectors (exact values) -------------------

PP_ALWAYS_INLINE void dec_f16(const uint8_t* p, vf* w) {
  for (int u = 0; u < 2; ++u) w[u] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 32 * u)));
}

PP_ALWAYS_INLINE void dec_bf16(const uint8_t* p, vf* w) {
  for (int u = 0; u < 2; ++u) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + 32 * u)));
    w[u] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
}

// Q8_0: int8 qs[32] times d.
PP_ALWAYS_INLINE void dec_q8_0(const uint8_t* qs, float d, vf* w) {
  const vf vd = v_set1(d);
  for (int u = 0; u < 2; ++u) {
    __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qs + 16 * u)));
    w[u] = v_mul(_mm512_cvtepi32_ps(q), vd);
  }
}

// Q4_0: (nibble - 8) d. A table lookup instead of int->float conversion: vpermps reads only the
// low 4 bits of each index lane, so the zero-extended byte selects its low nibble directly.
PP_ALWAYS_INLINE void dec_q4_0(const uint8_t* qs, float d, vf* w) {
  const __m512 lut = _mm512_mul_ps(
      _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), v_set1(d));
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
  w[0] = _mm512_permutexvar_ps(q, lut);                         // elements 0..15
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);  // elements 16..31
}

// Unsigned bytes q through their affine maps: y = a_h q + b_h.
PP_ALWAYS_INLINE void dec_bytes(const U8x32& q, const Affine& f, vf* w) {
  const __m128i lo = _mm256_castsi256_si128(q.v), hi = _mm256_extracti128_si256(q.v, 1);
  w[0] = v_fma(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), v_set1(f.a0), v_set1(f.b0));
  w[1] = v_fma(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), v_set1(f.a1), v_set1(f.b1));
}

// One 32-element chunk x rounded to Q8_0 / Q8_1 (quantize_act's scalar loop, 16 lanes at a time);
// false where the build lacks AVX-512BW/VL (the caller's loop then runs; simd_avx2.h has the
// 8-lane one).
inline bool quant_act_vec(int kind, const float* xb, QAct& a) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
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
  return true;
#else
  (void)kind, (void)xb, (void)a;
  return false;
#endif
}

}  // namespace
