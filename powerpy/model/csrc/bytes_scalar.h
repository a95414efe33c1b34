#pragma once
// Byte vectors without AVX2: the same names as bytes_avx2.h (U8x32, the nibble and high-bit
// assembly, idot32, ggml's eight 4-product lanes F8) as plain loops with the same integers and the
// same f32 operations in the same order.

#include "common.h"

#define PP_ISIMD 0

namespace {

struct U8x32 {
  uint8_t b[32];
};

// 32 bytes as they are (Q8_0).
inline void u8_load(const uint8_t* p, U8x32& q) { std::memcpy(q.b, p, 32); }

// 16 bytes -> 32 nibbles: low nibbles are elements 0..15, high nibbles 16..31 (Q4_0/Q4_1/Q5_x).
inline void nibbles_split(const uint8_t* qs, U8x32& q) {
  for (int j = 0; j < 16; ++j) {
    q.b[j] = qs[j] & 15;
    q.b[j + 16] = qs[j] >> 4;
  }
}

// 32 bytes -> their low (hi == false) or high nibbles, in order (K-quants).
inline void nibbles_32(const uint8_t* qs, bool hi, U8x32& q) {
  for (int j = 0; j < 32; ++j) q.b[j] = hi ? qs[j] >> 4 : qs[j] & 15;
}

// q[j] |= 16 where bit j of `bits` is set (Q5_0/Q5_1 high bits).
inline void or_bits16(uint32_t bits, U8x32& q) {
  for (int j = 0; j < 32; ++j) q.b[j] |= ((bits >> j) & 1u) << 4;
}

// q[j] |= ((hb[j] >> shift) & mask) << 4 for the 32 bytes hb (Q5_K: mask 1, Q6_K: mask 3).
inline void or_high(const uint8_t* hb, int shift, int mask, U8x32& q) {
  for (int j = 0; j < 32; ++j) q.b[j] |= ((hb[j] >> shift) & mask) << 4;
}

// Integer dot of the 32 weight bytes with the chunk's int8 values, per half.
template <bool SIGNED>
inline void idot32(const U8x32& q, const int8_t* x, int32_t& i0, int32_t& i1) {
  int32_t a = 0, b = 0;
  for (int j = 0; j < 16; ++j) {
    a += (SIGNED ? (int)(int8_t)q.b[j] : (int)q.b[j]) * x[j];
    b += (SIGNED ? (int)(int8_t)q.b[j + 16] : (int)q.b[j + 16]) * x[j + 16];
  }
  i0 = a;
  i1 = b;
}

// ggml's eight lanes of four products (see bytes_avx2.h).
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
inline F8 f8_set(float d) { return F8{{d, d, d, d, d, d, d, d}}; }
inline void lanes8(const Prep& w, const QAct& a, F8& acc, const F8& dw) {
  const float d = dw.v[0] * a.d;
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

}  // namespace
