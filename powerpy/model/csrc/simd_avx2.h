#pragma once
// AVX2 + FMA + F16C float vectors (8 lanes): the vector operations, the 32-element block decoders
// of the float and byte types and ggml's 8-lane reductions. simd_avx512.h and simd_scalar.h have
// the same names.

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "simd_avx2.h is for builds with AVX2, FMA and F16C (simd.h chooses the arch headers)"
#endif

#include "bytes_avx2.h"

#define PP_SIMD 1

namespace {

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

// ggml's vector width on this CPU (llama.cpp is built for the same one): its dot products and
// softmax sum in GW-lane vectors, reduced as tinyBLAS and the softmax do (hsum) or as
// ggml_vec_dot_f16's GGML_F16_VEC_REDUCE does (vreduce).
constexpr int GW = 8;
template <class T>
inline T hsum_gw(T* a) {
  return hsum8(a);
}
template <class T>
inline T vreduce_gw(T* a) {
  return hadd8(a);
}

// ---- 32-element block decoders: 32 elements -> NV = 4 vectors (exact values) -------------------

PP_ALWAYS_INLINE void dec_f16(const uint8_t* p, vf* w) {
  for (int u = 0; u < 4; ++u) w[u] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * u)));
}

PP_ALWAYS_INLINE void dec_bf16(const uint8_t* p, vf* w) {
  for (int u = 0; u < 4; ++u) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * u)));
    w[u] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
}

// Q8_0: int8 qs[32] times d.
PP_ALWAYS_INLINE void dec_q8_0(const uint8_t* qs, float d, vf* w) {
  const vf vd = v_set1(d);
  for (int u = 0; u < 4; ++u) {
    __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qs + 8 * u)));
    w[u] = v_mul(_mm256_cvtepi32_ps(q), vd);
  }
}

// Q4_0: (nibble - 8) d, as nibble·d - 8d in one FMA: both products are exact (4 and 11
// significant bits), and so is the difference, so these are the bits of (nibble - 8)·d. Each
// byte zero-extended to its own lane gives its low nibble by a mask and its high one by a shift.
PP_ALWAYS_INLINE void dec_q4_0(const uint8_t* qs, float d, vf* w) {
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)qs));  // bytes 0..7
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qs + 8)));
  const __m256i m4 = _mm256_set1_epi32(15);
  const vf vd = v_set1(d), off = v_set1(-8.0f * d);
  w[0] = v_fma(_mm256_cvtepi32_ps(_mm256_and_si256(b0, m4)), vd, off);  // elements 0..7
  w[1] = v_fma(_mm256_cvtepi32_ps(_mm256_and_si256(b1, m4)), vd, off);  // 8..15
  w[2] = v_fma(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), vd, off);  // 16..23
  w[3] = v_fma(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), vd, off);  // 24..31
}

// Unsigned bytes q through their affine maps: y = a_h q + b_h.
PP_ALWAYS_INLINE void dec_bytes(const U8x32& q, const Affine& f, vf* w) {
  const __m128i lo = _mm256_castsi256_si128(q.v), hi = _mm256_extracti128_si256(q.v, 1);
  const vf a0 = v_set1(f.a0), b0 = v_set1(f.b0), a1 = v_set1(f.a1), b1 = v_set1(f.b1);
  w[0] = v_fma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), a0, b0);
  w[1] = v_fma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo))), a0, b0);
  w[2] = v_fma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), a1, b1);
  w[3] = v_fma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi))), a1, b1);
}

// One 32-element chunk x rounded to Q8_0 / Q8_1: quantize_act's scalar loop, 8 lanes at a time
// (the same max, scale, round-to-nearest-even and sums, so the same bytes); the lane sums ls come
// from the bytes by a u8 x s8 dot with ones.
inline bool quant_act_vec(int kind, const float* xb, QAct& a) {
  const __m256 nz = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int u = 0; u < 4; ++u) {
    v[u] = _mm256_loadu_ps(xb + 8 * u);
    m = _mm256_max_ps(m, _mm256_andnot_ps(nz, v[u]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i q[4];
  for (int u = 0; u < 4; ++u)
    q[u] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(v[u], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it
  const __m256i b = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)a.qs, b);
  const __m256i ls =
      _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), b), _mm256_set1_epi16(1));
  _mm256_storeu_si256((__m256i*)a.ls, ls);
  a.s0 = a.ls[0] + a.ls[1] + a.ls[2] + a.ls[3];
  a.s1 = a.ls[4] + a.ls[5] + a.ls[6] + a.ls[7];
  a.d = round_f16(d);
  a.s = kind == ACT_Q8_1 ? round_f16(d * (float)(a.s0 + a.s1)) : a.d * (float)(a.s0 + a.s1);
  return true;
}

// ggml's AVX2 expf (simd.h's ggml_expf is its lane-by-lane form: the same operations, so the same
// bits), and swiglu 8 at a time with it; returns where it stopped.
inline __m256 ggml_expf8(__m256 x) {
  const __m256 r = _mm256_set1_ps(0x1.8p23f);
  const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
  const __m256 n = _mm256_sub_ps(z, r);
  const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
  const __m256 k =
      _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1.0f))));
  const __m256 an = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), n);
  const __m256 c = _mm256_cmp_ps(an, _mm256_set1_ps(126.0f), _CMP_GT_OQ);
  const __m256 u = _mm256_mul_ps(b, b);
  const __m256 j3 =
      _mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f));
  const __m256 j1 =
      _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f));
  const __m256 j1b = _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b);
  const __m256 j = _mm256_fmadd_ps(_mm256_fmadd_ps(j3, u, j1), u, j1b);
  const __m256 kj = _mm256_fmadd_ps(k, j, k);
  if (!_mm256_movemask_ps(c)) return kj;
  const __m256 le0 = _mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ);
  const __m256i g =
      _mm256_and_si256(_mm256_castps_si256(le0), _mm256_set1_epi32((int)0x82000000u));
  const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
  const __m256 d = _mm256_cmp_ps(an, _mm256_set1_ps(192.0f), _CMP_GT_OQ);
  const __m256 mid = _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1);
  const __m256 big = _mm256_blendv_ps(mid, _mm256_mul_ps(s1, s1), d);
  return _mm256_blendv_ps(kj, big, c);
}

inline int64_t swiglu_vec(const float* g, const float* u, int64_t a, int64_t b, float* out) {
  int64_t i = a;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= b; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = ggml_expf8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
  return i;
}

}  // namespace
