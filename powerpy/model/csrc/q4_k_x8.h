#pragma once
// Q4_K matrices with their rows interleaved 8 at a time (DT_Q4_KX8), the layout a dense Q4_K
// matrix of 8k rows takes at load (pp_repack_x8), and its GEMV and GEMM in the order of
// llama.cpp's own repacked Q4_K kernels: the same float bits (tests/test_ggml_vec_dot.py).
//
// One group (8 rows) holds, per super-block of 256 columns, X8_SB bytes:
//   [0, 16)      the 8 rows' d (f16)          [16, 32)   their dmin (f16)
//   [32, 96)     sub-block k's 6-bit scales, one byte per row, at 32 + 8 k
//   [96, 160)    the mins of sub-blocks 2 p and 2 p + 1, row by row in pairs, at 96 + 16 p
//   [160, 1184)  the quants: sub-blocks 2 j and 2 j + 1 (low, high nibbles) at 160 + 256 j, in
//                8 runs of 32 bytes (elements 4 e .. 4 e + 3 of rows 0..7) at + 32 e
// A run's bytes are one 4-element group of 8 rows, so one u8 x s8 product of 32 bytes against
// 4 activation bytes repeated gives each row's partial dot in its own 32-bit lane: per row and
// sub-block the 16-bit lanes sum 16 products (at most 16 * 15 * 127, no overflow), and one
// multiply by the scales per sub-block and 8 rows turns them into 32-bit lanes.
//
// Float steps (ggml's): per row and token, I = sum_k scale_k q_k . y_k and M = sum_k min_k
// sum(y_k) over the sub-blocks k are integers; the GEMM (4 tokens) takes them per 64 elements,
// the GEMV (1 token, and a prompt's last T % 4 tokens) per super-block, and each is scaled by
// one FMA: acc += I (d_w d_x), acc_m += M (dmin_w d_x); the result is acc - acc_m.

#include "ops.h"

namespace {

constexpr int64_t X8_SB = 1184;  // bytes of a group's super-block (8 x 144 + 32 of unpacked scales)

inline int64_t x8_group_bytes(int64_t cols) { return cols / 256 * X8_SB; }

// The 6-bit scales and mins of a Q4_K super-block's 12 bytes (ggml's get_scale_min_k4).
inline void k4_scales(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    m[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 0xF) | ((q[j] >> 6) << 4);
    m[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}

// The inverse: the 12 bytes of 8 scales and 8 mins.
inline void k4_pack_scales(const uint8_t* sc, const uint8_t* m, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    q[j + 4] = (uint8_t)((m[j] & 63) | ((m[j + 4] >> 4) << 6));
    q[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
  }
}

#if defined(__AVX2__)
constexpr bool X8_KERNELS = true;  // the interleaved layouts' products (x8.h) need AVX2
#else
constexpr bool X8_KERNELS = false;
#endif

// The Q4_K layout (X for x8.h's drivers).
struct X8K4 {
  static constexpr int ROW = DT_Q4_K, ACT = DT_Q4_K, CODE = DT_Q4_KX8;  // rows, activations, code
  static constexpr int64_t QK = 256, RB = 144, GB = X8_SB;  // columns, row bytes, group bytes

  // Group g: 8 Q4_K rows (ld bytes apart, nsb super-blocks each) -> the interleaved layout.
  static void pack(const uint8_t* W, int64_t ld, int64_t nsb, uint8_t* g) {
    for (int64_t i = 0; i < nsb; ++i, g += X8_SB) {
      for (int r = 0; r < 8; ++r) {
        const uint8_t* b = W + r * ld + 144 * i;
        uint8_t sc[8], m[8];
        std::memcpy(g + 2 * r, b, 2);
        std::memcpy(g + 16 + 2 * r, b + 2, 2);
        k4_scales(b + 4, sc, m);
        for (int k = 0; k < 8; ++k) g[32 + 8 * k + r] = sc[k];
        for (int p = 0; p < 4; ++p) {
          g[96 + 16 * p + 2 * r] = m[2 * p];
          g[96 + 16 * p + 2 * r + 1] = m[2 * p + 1];
        }
        for (int j = 0; j < 4; ++j)
          for (int e = 0; e < 8; ++e)
            std::memcpy(g + 160 + 256 * j + 32 * e + 4 * r, b + 16 + 32 * j + 4 * e, 4);
      }
    }
  }

  // The inverse of pack: a group's 8 rows as Q4_K rows of nsb * 144 bytes each, at rows.
  static void unpack(const uint8_t* g, int64_t nsb, uint8_t* rows) {
    const int64_t rb = nsb * 144;
    for (int64_t i = 0; i < nsb; ++i, g += X8_SB) {
      for (int r = 0; r < 8; ++r) {
        uint8_t* b = rows + r * rb + 144 * i;
        uint8_t sc[8], m[8];
        std::memcpy(b, g + 2 * r, 2);
        std::memcpy(b + 2, g + 16 + 2 * r, 2);
        for (int k = 0; k < 8; ++k) sc[k] = g[32 + 8 * k + r];
        for (int p = 0; p < 4; ++p) {
          m[2 * p] = g[96 + 16 * p + 2 * r];
          m[2 * p + 1] = g[96 + 16 * p + 2 * r + 1];
        }
        k4_pack_scales(sc, m, b + 4);
        for (int j = 0; j < 4; ++j)
          for (int e = 0; e < 8; ++e)
            std::memcpy(b + 16 + 32 * j + 4 * e, g + 160 + 256 * j + 32 * e + 4 * r, 4);
      }
    }
  }

#if defined(__AVX2__)
  // out[t * ldo + r] = row r . x_t for a group's 8 rows and N tokens (a[t]: their Q8_K chunks);
  // N == 4 in the GEMM's order, else each token in the GEMV's.
  template <int N>
  static void dot(const uint8_t* g, const QAct* const* a0, int64_t nsb, float* out, int64_t ldo) {
    constexpr bool GEMM = N == 4;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const QAct* a[N];
    __m256 acc[N], acc_m[N];
    for (int t = 0; t < N; ++t) a[t] = a0[t], acc[t] = acc_m[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; ++i, g += X8_SB) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
      const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(g + 16)));
      __m256i isum[N], msum[N];
      for (int t = 0; t < N; ++t) isum[t] = msum[t] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        __m256i plo[N], phi[N];
        for (int t = 0; t < N; ++t) plo[t] = phi[t] = _mm256_setzero_si256();
        for (int e = 0; e < 8; ++e) {
          const __m256i q = _mm256_loadu_si256((const __m256i*)(g + 160 + 256 * j + 32 * e));
          const __m256i lo = _mm256_and_si256(q, m4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
          for (int t = 0; t < N; ++t) {
            int32_t yl, yh;
            std::memcpy(&yl, a[t][2 * j].qs + 4 * e, 4);
            std::memcpy(&yh, a[t][2 * j + 1].qs + 4 * e, 4);
            plo[t] = _mm256_add_epi16(plo[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(yl)));
            phi[t] = _mm256_add_epi16(phi[t], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(yh)));
          }
        }
        const __m128i s0 = _mm_loadl_epi64((const __m128i*)(g + 32 + 16 * j));
        const __m128i s1 = _mm_loadl_epi64((const __m128i*)(g + 40 + 16 * j));
        const __m256i slo = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s0, s0));  // each row's twice
        const __m256i shi = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s1, s1));
        const __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(g + 96 + 16 * j)));
        for (int t = 0; t < N; ++t) {
          const __m256i I =
              _mm256_add_epi32(_mm256_madd_epi16(plo[t], slo), _mm256_madd_epi16(phi[t], shi));
          const QAct &c0 = a[t][2 * j], &c1 = a[t][2 * j + 1];
          const uint32_t b0 = (uint32_t)(c0.s0 + c0.s1) & 0xFFFF, b1 = (uint32_t)(c1.s0 + c1.s1);
          const __m256i M = _mm256_madd_epi16(mn, _mm256_set1_epi32((int32_t)(b0 | (b1 << 16))));
          if constexpr (GEMM) {
            const __m256 dx = _mm256_set1_ps(a[t][0].d);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(dw, dx), acc[t]);
            acc_m[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_mul_ps(dm, dx), acc_m[t]);
          } else {
            isum[t] = _mm256_add_epi32(isum[t], I);
            msum[t] = _mm256_add_epi32(msum[t], M);
          }
        }
      }
      for (int t = 0; t < N; ++t) {
        if constexpr (!GEMM) {
          const __m256 dx = _mm256_set1_ps(a[t][0].d);
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(dw, dx), acc[t]);
          acc_m[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum[t]), _mm256_mul_ps(dm, dx), acc_m[t]);
        }
        a[t] += 8;
      }
    }
    for (int t = 0; t < N; ++t) _mm256_storeu_ps(out + t * ldo, _mm256_sub_ps(acc[t], acc_m[t]));
  }
#endif
};

}  // namespace
