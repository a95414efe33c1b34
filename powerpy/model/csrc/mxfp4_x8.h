#pragma once
// MXFP4 matrices with their rows interleaved 8 at a time (DT_MXFP4X8): the layout an MXFP4
// stack of experts (or matrix) of 8k rows takes at load (pp_repack_x8), multiplied in the order
// of llama.cpp's repacked MXFP4 kernels (its CPU backend repacks such tensors on AVX2 hosts,
// and its MUL_MAT_ID multiplies every (token, expert) pair by that GEMV): the same float bits
// (tests/test_ggml_vec_dot.py). The row layout's products (mxfp4.h) keep ggml's vec_dot order,
// which is llama.cpp's for MXFP4 tensors it does not repack.
//
// One group (8 rows) holds, per block of 32 columns, 136 bytes:
//   [0, 8)      the 8 rows' E8M0 exponents
//   [8, 136)    4 runs of 32 bytes; run e holds bytes 4 e .. 4 e + 3 of each row's 16 code
//               bytes, rows 0..7: elements 4 e .. 4 e + 3 in the low nibbles, 16 + 4 e ..
//               16 + 4 e + 3 in the high ones
// A code becomes its doubled E2M1 value plus 12 (0 .. 24, unsigned) by one byte shuffle; u8 x
// s8 products against 4 activation bytes repeated give each row's partial dot in its own 32-bit
// lane (at most 32 * 24 * 127 in a block: exact), and subtracting 12 times the block's sum of
// activations leaves the integer I = sum w y of each row.
//
// Float steps (the GEMV's and the GEMM's alike): per row, token and block, acc += I (d_w d_x)
// as one FMA, d_w = 2^(e - 128) (mxfp4.h e8m0_half), block after block from acc = 0; that is
// the row's result.

#include "q4_k_x8.h"  // X8_KERNELS
#include "mxfp4.h"    // MX_TS, and the row layout's products (x8.h's f32 path, dequant)

namespace {

constexpr int64_t X8MX_B = 136;  // bytes of a group's block (8 x 17)

// The doubled E2M1 values plus 12: each code's unsigned byte.
constexpr uint8_t MX_U8[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// The MXFP4 layout (X for x8.h's drivers).
struct X8MX {
  static constexpr int ROW = DT_MXFP4, ACT = DT_Q8_0, CODE = DT_MXFP4X8;
  static constexpr int64_t QK = 32, RB = MX_TS, GB = X8MX_B;

  // Group g: 8 MXFP4 rows (ld bytes apart, nb blocks each) -> the interleaved layout.
  static void pack(const uint8_t* W, int64_t ld, int64_t nb, uint8_t* g) {
    for (int64_t i = 0; i < nb; ++i, g += X8MX_B)
      for (int r = 0; r < 8; ++r) {
        const uint8_t* b = W + r * ld + MX_TS * i;
        g[r] = b[0];
        for (int e = 0; e < 4; ++e) std::memcpy(g + 8 + 32 * e + 4 * r, b + 1 + 4 * e, 4);
      }
  }

  // The inverse: a group's 8 rows as MXFP4 rows of nb * 17 bytes each, at rows.
  static void unpack(const uint8_t* g, int64_t nb, uint8_t* rows) {
    const int64_t rb = nb * MX_TS;
    for (int64_t i = 0; i < nb; ++i, g += X8MX_B)
      for (int r = 0; r < 8; ++r) {
        uint8_t* b = rows + r * rb + MX_TS * i;
        b[0] = g[r];
        for (int e = 0; e < 4; ++e) std::memcpy(b + 1 + 4 * e, g + 8 + 32 * e + 4 * r, 4);
      }
  }

#if defined(__AVX2__)
  // 2^(e - 128) of 8 exponents (e8m0_half's bits): (e - 1) << 23, or 0x00200000 << e below 2.
  static PP_ALWAYS_INLINE __m256 scales(const uint8_t* e) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)e));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
    const __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), v);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, low));
  }

  // acc[t] += block i's products for N tokens (a[t]: their Q8_0 blocks); g at the block.
  template <int N>
  static PP_ALWAYS_INLINE void add(const uint8_t* g, const QAct* const* a, int64_t i,
                                   __m256* acc) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)MX_U8));
    const __m256 dw = scales(g);
    __m256i w[8];  // the 4 runs' low and high nibbles as unsigned values
    for (int e = 0; e < 4; ++e) {
      const __m256i run = _mm256_loadu_si256((const __m256i*)(g + 8 + 32 * e));
      w[2 * e] = _mm256_shuffle_epi8(lut, _mm256_and_si256(run, m4));
      w[2 * e + 1] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(run, 4), m4));
    }
    for (int t = 0; t < N; ++t) {
      const QAct& c = a[t][i];
      __m256i y[8];
      for (int e = 0; e < 4; ++e) {
        int32_t yl, yh;
        std::memcpy(&yl, c.qs + 4 * e, 4);
        std::memcpy(&yh, c.qs + 16 + 4 * e, 4);
        y[2 * e] = _mm256_set1_epi32(yl);
        y[2 * e + 1] = _mm256_set1_epi32(yh);
      }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      __m256i s = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) s = _mm256_dpbusd_epi32(s, w[j], y[j]);
#else
      // two halves of 16-bit lanes, each lane 8 products of at most 24 * 127 (24384 < 2^15),
      // then 32-bit pairs
      const __m256i ones = _mm256_set1_epi16(1);
      __m256i s = _mm256_setzero_si256();
      for (int h = 0; h < 8; h += 4) {
        __m256i p = _mm256_maddubs_epi16(w[h], y[h]);
        for (int j = h + 1; j < h + 4; ++j)
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[j], y[j]));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
      }
#endif
      const __m256i I = _mm256_sub_epi32(s, _mm256_set1_epi32(12 * (c.s0 + c.s1)));
      const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(c.d));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), d, acc[t]);
    }
  }

  // out[t * ldo + r] = row r . x_t for a group's 8 rows and N tokens (a[t]: their Q8_0 blocks).
  template <int N>
  static void dot(const uint8_t* g, const QAct* const* a, int64_t nb, float* out, int64_t ldo) {
    __m256 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
    const int64_t pf = PREFETCH_BYTES;  // the stream ahead, into L2 (a group's blocks follow on)
    for (int64_t i = 0; i < nb; ++i, g += X8MX_B) {
      prefetch_l2(g + pf);
      prefetch_l2(g + pf + 64);
      prefetch_l2(g + pf + 128);
      add<N>(g, a, i, acc);
    }
    for (int t = 0; t < N; ++t) _mm256_storeu_ps(out + t * ldo, acc[t]);
  }
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  // Two groups side by side (x8.h pairs them where a layout has dot2): 16 rows in the lanes of
  // one 512-bit register, group g0's in the low half; each lane's integers and FMAs are dot's.
  static constexpr bool PAIRS = true;

  // dot for the 16 rows of groups g0 and g1: out[t * ldo + r], r < 16 (g1's rows from 8).
  template <int N>
  static void dot2(const uint8_t* g0, const uint8_t* g1, const QAct* const* a, int64_t nb,
                   float* out, int64_t ldo) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)MX_U8));
    const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2);
    const __m512i sub_base = _mm512_set1_epi32(0x00200000);
    __m512 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
    const int64_t pf = PREFETCH_BYTES;
    for (int64_t i = 0; i < nb; ++i, g0 += X8MX_B, g1 += X8MX_B) {
      for (int c = 0; c < 3; ++c) prefetch_l2(g0 + pf + 64 * c), prefetch_l2(g1 + pf + 64 * c);
      // the 16 exponents' 2^(e - 128), as scales() does for 8
      const __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
          _mm_loadl_epi64((const __m128i*)g0), _mm_loadl_epi64((const __m128i*)g1)));
      const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(v, one), 23);
      const __m512i low = _mm512_sllv_epi32(sub_base, v);
      const __mmask16 lt2 = _mm512_cmplt_epu32_mask(v, two);
      const __m512 dw = _mm512_castsi512_ps(_mm512_mask_blend_epi32(lt2, normal, low));
      __m512i w[8];
      for (int e = 0; e < 4; ++e) {
        const __m512i run = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(g0 + 8 + 32 * e))),
            _mm256_loadu_si256((const __m256i*)(g1 + 8 + 32 * e)), 1);
        w[2 * e] = _mm512_shuffle_epi8(lut, _mm512_and_si512(run, m4));
        w[2 * e + 1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(run, 4), m4));
      }
      for (int t = 0; t < N; ++t) {
        const QAct& c = a[t][i];
        __m512i s = _mm512_setzero_si512();
        for (int e = 0; e < 4; ++e) {
          int32_t yl, yh;
          std::memcpy(&yl, c.qs + 4 * e, 4);
          std::memcpy(&yh, c.qs + 16 + 4 * e, 4);
          s = _mm512_dpbusd_epi32(s, w[2 * e], _mm512_set1_epi32(yl));
          s = _mm512_dpbusd_epi32(s, w[2 * e + 1], _mm512_set1_epi32(yh));
        }
        const __m512i I = _mm512_sub_epi32(s, _mm512_set1_epi32(12 * (c.s0 + c.s1)));
        const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(c.d));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), d, acc[t]);
      }
    }
    for (int t = 0; t < N; ++t) _mm512_storeu_ps(out + t * ldo, acc[t]);
  }
#endif
};

}  // namespace
