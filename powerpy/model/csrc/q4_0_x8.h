#pragma once
// Q4_0 matrices with their rows interleaved 8 at a time (DT_Q4_0X8), the layout a dense Q4_0
// matrix of 8k rows takes at load (pp_repack_x8), multiplied in the order of llama.cpp's own
// repacked Q4_0 kernels (its CPU backend repacks every such matrix on AVX2 hosts): the same
// float bits (tests/test_ggml_vec_dot.py).
//
// One group (8 rows) holds, per block of 32 columns, 144 bytes:
//   [0, 16)     the 8 rows' d (f16)
//   [16, 144)   4 runs of 32 bytes; run e holds bytes 4 e .. 4 e + 3 of each row's qs, rows 0..7:
//               elements 4 e .. 4 e + 3 in the low nibbles, 16 + 4 e .. 16 + 4 e + 3 in the high
// One u8 x s8 product of a run's low (high) nibbles against 4 activation bytes repeated gives
// each row's partial dot in its own 32-bit lane; the 16-bit lanes of a block sum 16 products (at
// most 16 * 15 * 127, no overflow) and one multiply-add by ones makes 32-bit lanes.
//
// Float steps (ggml's GEMV and GEMM alike): per row, token and block, I = sum (q - 8) y is an
// integer (sum q y - 8 sum y), and acc += I (d_w d_x) is one FMA, block after block; that is the
// row's result.

#include "q4_k_x8.h"  // X8_KERNELS

namespace {

constexpr int64_t X8Q40_B = 144;  // bytes of a group's block (8 x 18)

// The Q4_0 layout (X for x8.h's drivers).
struct X8Q40 {
  static constexpr int ROW = DT_Q4_0, ACT = DT_Q8_0, CODE = DT_Q4_0X8;
  static constexpr int64_t QK = 32, RB = 18, GB = X8Q40_B;

  // Group g: 8 Q4_0 rows (ld bytes apart, nb blocks each) -> the interleaved layout.
  static void pack(const uint8_t* W, int64_t ld, int64_t nb, uint8_t* g) {
    for (int64_t i = 0; i < nb; ++i, g += X8Q40_B)
      for (int r = 0; r < 8; ++r) {
        const uint8_t* b = W + r * ld + 18 * i;
        std::memcpy(g + 2 * r, b, 2);
        for (int e = 0; e < 4; ++e) std::memcpy(g + 16 + 32 * e + 4 * r, b + 2 + 4 * e, 4);
      }
  }

  // The inverse: a group's 8 rows as Q4_0 rows of nb * 18 bytes each, at rows.
  static void unpack(const uint8_t* g, int64_t nb, uint8_t* rows) {
    const int64_t rb = nb * 18;
    for (int64_t i = 0; i < nb; ++i, g += X8Q40_B)
      for (int r = 0; r < 8; ++r) {
        uint8_t* b = rows + r * rb + 18 * i;
        std::memcpy(b, g + 2 * r, 2);
        for (int e = 0; e < 4; ++e) std::memcpy(b + 2 + 4 * e, g + 16 + 32 * e + 4 * r, 4);
      }
  }

#if defined(__AVX2__)
  // Block i of a group (g at it): the 8 rows' d as f32 and the 4 runs.
  static PP_ALWAYS_INLINE void load(const uint8_t* g, __m256& dw, __m256i* run) {
    dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
    for (int e = 0; e < 4; ++e) run[e] = _mm256_loadu_si256((const __m256i*)(g + 16 + 32 * e));
  }

  // The same block built in registers from 8 Q4_0 rows (rows[r]: row r's start): each row's 16
  // bytes of qs, rows r and r + 4 in one register, then a 4x4 transpose of 32-bit words per
  // 128-bit lane puts word e of rows 0..7 in run e, as pack lays them out.
  static PP_ALWAYS_INLINE void gather(const uint8_t* const* rows, int64_t i, __m256& dw,
                                      __m256i* run) {
    __m256i v[4];
    for (int r = 0; r < 4; ++r)
      v[r] = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(rows[r] + 18 * i + 2))),
          _mm_loadu_si128((const __m128i*)(rows[r + 4] + 18 * i + 2)), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    run[0] = _mm256_unpacklo_epi64(t0, t2);
    run[1] = _mm256_unpackhi_epi64(t0, t2);
    run[2] = _mm256_unpacklo_epi64(t1, t3);
    run[3] = _mm256_unpackhi_epi64(t1, t3);
    __m128i d[8];  // each row's d in its low 16 bits, then interleaved down to one register
    for (int r = 0; r < 8; ++r) d[r] = _mm_loadu_si16(rows[r] + 18 * i);
    for (int r = 0; r < 8; r += 2) d[r] = _mm_unpacklo_epi16(d[r], d[r + 1]);
    d[0] = _mm_unpacklo_epi32(d[0], d[2]);
    d[4] = _mm_unpacklo_epi32(d[4], d[6]);
    dw = _mm256_cvtph_ps(_mm_unpacklo_epi64(d[0], d[4]));
  }

  // acc[t] += block i's products for N tokens (a[t]: their Q8_0 blocks).
  template <int N>
  static PP_ALWAYS_INLINE void add(__m256 dw, const __m256i* run, const QAct* const* a, int64_t i,
                                   __m256* acc) {
    const __m256i m4 = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
    __m256i p[N];
    for (int t = 0; t < N; ++t) p[t] = _mm256_setzero_si256();
    for (int e = 0; e < 4; ++e) {
      const __m256i lo = _mm256_and_si256(run[e], m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(run[e], 4), m4);
      for (int t = 0; t < N; ++t) {
        int32_t yl, yh;
        std::memcpy(&yl, a[t][i].qs + 4 * e, 4);
        std::memcpy(&yh, a[t][i].qs + 16 + 4 * e, 4);
        p[t] = _mm256_add_epi16(p[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(yl)));
        p[t] = _mm256_add_epi16(p[t], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(yh)));
      }
    }
    for (int t = 0; t < N; ++t) {
      const QAct& c = a[t][i];
      const __m256i I = _mm256_sub_epi32(_mm256_madd_epi16(p[t], ones),
                                         _mm256_set1_epi32(8 * (c.s0 + c.s1)));
      const __m256 dx = _mm256_set1_ps(c.d);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(dw, dx), acc[t]);
    }
  }

  // out[t * ldo + r] = row r . x_t for a group's 8 rows and N tokens (a[t]: their Q8_0 blocks).
  template <int N>
  static void dot(const uint8_t* g, const QAct* const* a, int64_t nb, float* out, int64_t ldo) {
    __m256 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
    const int64_t pf = PREFETCH_BYTES;  // the stream ahead, into L2 (a group's blocks follow on)
    for (int64_t i = 0; i < nb; ++i, g += X8Q40_B) {
      prefetch_l2(g + pf);
      prefetch_l2(g + pf + 64);
      prefetch_l2(g + pf + 128);
      __m256 dw;
      __m256i run[4];
      load(g, dw, run);
      add<N>(dw, run, a, i, acc);
    }
    for (int t = 0; t < N; ++t) _mm256_storeu_ps(out + t * ldo, acc[t]);
  }

  // dot for 8 rows in the file's layout (rows[r]: row r's start), the group built in registers
  // block by block: the same bits as dot on their packed group. next (null entries: none): the
  // rows to prefetch meanwhile.
  template <int N>
  static void gdot(const uint8_t* const* rows, const uint8_t* const* next, const QAct* const* a,
                   int64_t nb, float* out, int64_t ldo) {
    __m256 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
      if (i % 4 == 0)  // the next rows' blocks i .. i + 3 (72 bytes, at most 2 cache lines)
        for (int r = 0; r < 8; ++r)
          if (next[r]) prefetch_l2(next[r] + 18 * i), prefetch_l2(next[r] + 18 * i + 64);
      __m256 dw;
      __m256i run[4];
      gather(rows, i, dw, run);
      add<N>(dw, run, a, i, acc);
    }
    for (int t = 0; t < N; ++t) _mm256_storeu_ps(out + t * ldo, acc[t]);
  }
#endif
};

}  // namespace
