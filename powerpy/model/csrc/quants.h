#pragma once
// The weight types' block layouts and decoders, and llama.cpp's rounding of the activations.
//
// Dec<DT> decodes a row's 32-element chunk c to NV f32 vectors (the float path: exact values, f32
// accumulation). UDec<DT> decodes it to 32 bytes q plus one affine map per half (elements 0..15
// and 16..31): y = a_h * q + b_h. Every value is exact in f32 (a_h * q needs at most 25 bits and
// one rounding, as in ggml), so the f32 decode equals ggml's dequantization; the same bytes feed
// the integer dot products against quantized activations (QAct). q is unsigned except for Q8_0
// (SIGNED: the bytes are int8 values).

#include "simd.h"

namespace {

// ---- float decoders: 32 elements -> NV f32 vectors --------------------------------------------
// BB = bytes per 32-element block; one(row, i) decodes element i (float types only, for tails).

template <int DT>
struct Dec;

template <>
struct Dec<DT_F32> {
  static constexpr int64_t BB = 128;
  static constexpr bool QUANT = false;
  static constexpr int64_t QK = 32, TS = BB;
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, vf* w) { block(row + c * BB, w); }
  static PP_ALWAYS_INLINE void block(const uint8_t* p, vf* w) {
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
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, vf* w) { block(row + c * BB, w); }
  static PP_ALWAYS_INLINE void block(const uint8_t* p, vf* w) { dec_f16(p, w); }
  static inline float one(const uint8_t* row, int64_t i) { return half_to_float(load_u16(row + 2 * i)); }
};

template <>
struct Dec<DT_BF16> {
  static constexpr int64_t BB = 64;
  static constexpr bool QUANT = false;
  static constexpr int64_t QK = 32, TS = BB;
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, vf* w) { block(row + c * BB, w); }
  static PP_ALWAYS_INLINE void block(const uint8_t* p, vf* w) { dec_bf16(p, w); }
  static inline float one(const uint8_t* row, int64_t i) { return bf16_to_float(load_u16(row + 2 * i)); }
};

// Q8_0 (34 B): f16 d, int8 qs[32]; y[j] = qs[j] * d.
template <>
struct Dec<DT_Q8_0> {
  static constexpr int64_t BB = 34;
  static constexpr bool QUANT = true;
  static constexpr int64_t QK = 32, TS = BB;
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, vf* w) { block(row + c * BB, w); }
  static PP_ALWAYS_INLINE void block(const uint8_t* p, vf* w) { dec_q8_0(p + 2, half_to_float(load_u16(p)), w); }
  static inline float one(const uint8_t*, int64_t) { return 0.0f; }  // never called (QUANT)
};

// Q4_0 (18 B): f16 d, u8 qs[16]; y[j] = ((qs[j] & 15) - 8) d, y[j+16] = ((qs[j] >> 4) - 8) d.
template <>
struct Dec<DT_Q4_0> {
  static constexpr int64_t BB = 18;
  static constexpr bool QUANT = true;
  static constexpr int64_t QK = 32, TS = BB;
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, vf* w) { block(row + c * BB, w); }
  static PP_ALWAYS_INLINE void block(const uint8_t* p, vf* w) { dec_q4_0(p + 2, half_to_float(load_u16(p)), w); }
  static inline float one(const uint8_t*, int64_t) { return 0.0f; }  // never called (QUANT)
};

// ---- byte decoders ------------------------------------------------------------------------------

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
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + c * TS;
    const float d = half_to_float(load_u16(p));
    f = {d, d, 0.0f, 0.0f};
    u8_load(p + 2, q);
  }
};

// Q4_0 (18 B / 32): f16 d, qs[16]; y = (q - 8) d.
template <>
struct UDec<DT_Q4_0> : Layout<32, 18, false, 8> {
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + c * TS;
    const float d = half_to_float(load_u16(p));
    f = {d, d, -8.0f * d, -8.0f * d};
    nibbles_split(p + 2, q);
  }
};

// Q4_1 (20 B / 32): f16 d, f16 m, qs[16]; y = q d + m.
template <>
struct UDec<DT_Q4_1> : Layout<32, 20, false, 0> {
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + c * TS;
    const float d = half_to_float(load_u16(p)), m = half_to_float(load_u16(p + 2));
    f = {d, d, m, m};
    nibbles_split(p + 4, q);
  }
};

// Q5_0 (22 B / 32): f16 d, u32 qh, qs[16]; q = nibble | bit << 4, y = (q - 16) d.
template <>
struct UDec<DT_Q5_0> : Layout<32, 22, false, 16> {
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
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
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
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
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
    const uint8_t* p = row + (c >> 3) * TS;
    const int s = (int)(c & 7);
    f = affine_k4(p, s);
    nibbles_32(p + 16 + 32 * (s >> 1), s & 1, q);
  }
};

// Q5_K (176 B / 256): f16 d, f16 dmin, scales[12], qh[32], qs[128]; as Q4_K plus bit s of qh.
template <>
struct UDec<DT_Q5_K> : Layout<256, 176, false, 0> {
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
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
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, U8x32& q, Affine& f) {
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
  static PP_ALWAYS_INLINE void chunk(const uint8_t* row, int64_t c, vf* w) {
    U8x32 q;
    Affine f;
    U::chunk(row, c, q, f);
    dec_bytes(q, f, w);
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

template <int DT>
constexpr int act_kind() {
  return DT == DT_Q4_1 || DT == DT_Q5_1                    ? ACT_Q8_1
         : DT == DT_Q4_K || DT == DT_Q5_K || DT == DT_Q6_K ? ACT_Q8_K
         : DT == DT_Q8_0 || DT == DT_Q4_0 || DT == DT_Q5_0 ? ACT_Q8_0
                                                           : ACT_F32;
}

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
    if (quant_act_vec(kind, xb, a)) continue;  // the same operations in vectors
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

// One chunk's contribution with K-quant weights: d_x (a0 I0 + a1 I1) + bias (see above).
template <int DT>
inline float chunk_qdot(const U8x32& q, const Affine& f, const QAct& a) {
  int32_t i0, i1;
  idot32<UDec<DT>::SIGNED>(q, a.qs, i0, i1);
  const float dot = f.a0 == f.a1 ? (f.a0 * a.d) * (float)(i0 + i1)
                                 : a.d * (f.a0 * (float)i0 + f.a1 * (float)i1);
  if (f.b0 == f.b1) return dot + f.b0 * a.s;  // Q8_1: llama.cpp's m * s
  return dot + a.d * (f.b0 * (float)a.s0 + f.b1 * (float)a.s1);
}

}  // namespace
