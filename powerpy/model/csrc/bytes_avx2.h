#pragma once
// Byte vectors with AVX2 (also under AVX-512): the 32 weight bytes of a chunk (U8x32), the nibble
// and high-bit assembly of the quant types, and the u8 x s8 integer dot products in ggml's orders
// (idot32 per half; lanes8: ggml's eight 4-product lanes, F8). VNNI and AVX-512BW/VL forms where
// the build has them. bytes_scalar.h has the same names.

#if !(defined(__AVX2__))
#error "bytes_avx2.h is for builds with AVX2 (simd.h chooses the arch headers)"
#endif

#include "common.h"

#define PP_ISIMD 1

namespace {

struct U8x32 {
  __m256i v;
};

// 32 bytes as they are (Q8_0).
inline void u8_load(const uint8_t* p, U8x32& q) { q.v = _mm256_loadu_si256((const __m256i*)p); }

// 16 bytes -> 32 nibbles: low nibbles are elements 0..15, high nibbles 16..31 (Q4_0/Q4_1/Q5_x).
inline void nibbles_split(const uint8_t* qs, U8x32& q) {
  const __m128i v = _mm_loadu_si128((const __m128i*)qs);
  const __m128i m4 = _mm_set1_epi8(15);
  q.v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}

// 32 bytes -> their low (hi == false) or high nibbles, in order (K-quants).
inline void nibbles_32(const uint8_t* qs, bool hi, U8x32& q) {
  __m256i v = _mm256_loadu_si256((const __m256i*)qs);
  if (hi) v = _mm256_srli_epi16(v, 4);
  q.v = _mm256_and_si256(v, _mm256_set1_epi8(15));
}

// q[j] |= 16 where bit j of `bits` is set (Q5_0/Q5_1 high bits).
inline void or_bits16(uint32_t bits, U8x32& q) {
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
}

// q[j] |= ((hb[j] >> shift) & mask) << 4 for the 32 bytes hb (Q5_K: mask 1, Q6_K: mask 3).
inline void or_high(const uint8_t* hb, int shift, int mask, U8x32& q) {
  __m256i h = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)hb), _mm_cvtsi32_si128(shift));
  h = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8((char)mask)), 4);
  q.v = _mm256_or_si256(q.v, h);
}

// Integer dot of the 32 weight bytes with the chunk's int8 values, per half.
template <bool SIGNED>
inline void idot32(const U8x32& q, const int8_t* x, int32_t& i0, int32_t& i1) {
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
}

// ggml's order for the 32-element block types (vec_dot_q4_0_q8_0 and friends on AVX2): eight
// lanes, each the integer sum of four products (q - OFF) y, scaled by d_w d_x and accumulated
// with one FMA per block; then a fixed horizontal sum, plus (Q8_1) the sequential sum of m s.
// Following it exactly keeps powerpy's matmuls within rounding noise of llama.cpp's.
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
// acc += (d_w d_x) * lanes, the weight's scale dw already broadcast: d_w d_x is one vector
// product per token (the f32 product ggml forms as a scalar, so the same bits).
inline F8 f8_set(float d) { return _mm256_set1_ps(d); }
inline void lanes8(const Prep& w, const QAct& a, F8& acc, F8 dw) {
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
  acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(&a.d)), _mm256_cvtepi32_ps(p), acc);
}
inline float f8_hsum(F8 x) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

}  // namespace
