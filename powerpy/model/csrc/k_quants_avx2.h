#pragma once
// Q4_K's, Q5_K's and Q6_K's dot products on AVX2, a 256-element super-block at a time in
// ggml's order (vec_dot_q4_K_q8_K and its Q5_K and Q6_K forms: the same float bits,
// tests/test_ggml_vec_dot.py): the sub-block scales multiply 16-bit integer sums (u8 x s8
// products in pairs), one 8-lane int32 sum per super-block is scaled by d_w d_x with one FMA,
// the mins take a sum of their own, and the lanes are summed as ggml sums them (f8_hsum, its
// hsum_float_8). The per-chunk
// path (vec.h's QChunks: an f32 sum per 32 elements, with two horizontal adds each) ran Q4_K_M
// decode at about a fifth of llama.cpp's speed.

#include "ops.h"

namespace {

#if defined(__AVX2__)

// The sum of an int32 vector's lanes (exact: integers, so any order).
inline int32_t i4_hsum(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1)));
}
inline int32_t i8_hsum(__m256i v) {
  return i4_hsum(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

// The 6-bit scales and mins of a Q4_K/Q5_K super-block's 8 sub-blocks (its 12 bytes at p), as
// 16-bit lanes 0..7 and 8..15 (ggml's bit shuffle).
inline __m256i scales_mins_k4(const uint8_t* p) {
  uint32_t u[4];
  std::memcpy(u, p, 12);
  u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
  const uint32_t u1 = u[1] & 0x3f3f3f3f;
  u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
  u[2] = u1;
  u[0] &= 0x3f3f3f3f;
  return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)u));
}

// The kernels take N tokens at once (prompts: 4, one token in decode): a super-block's weights
// are decoded once for the N, and each token's sums run the one-token order, so a prompt's
// results have the same bits as decode's. Token t reads its chunks a[t] and 16-element sums
// bs[t], and writes out[t * ldo]; the row nx (may be null) is prefetched.

// Q4_K rows (144 bytes a super-block: f16 d, f16 dmin, scales[12], qs[128]) and Q5_K rows
// (Q5 = true; 176 bytes: the same and qh[32] before qs): the low nibbles of 32 bytes are one
// sub-block's values, the high nibbles the next one's; Q5_K adds bit 2 j (low) or 2 j + 1 (high)
// of qh as bit 4. The mins' term is a 4-lane sum (Q4_K) or a scalar sum per row (Q5_K), as in
// ggml's two kernels.
template <bool Q5>
struct DotQ45K {
  static constexpr int TS = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;
  template <int N, bool TILED>
  static void run(const uint8_t* w, const QAct* const* a0, const int16_t* const* b0, int64_t nsb,
                  const uint8_t* nx, float* out, int64_t ldo) {
    const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const QAct* a[N];
    const int16_t* bs[N];
    __m256 acc[N];
    __m128 acc_m[N];  // Q4_K
    float summs[N];   // Q5_K
    float tiled[N];   // TILED
    int32_t mins_i[N];
    for (int t = 0; t < N; ++t) {
      a[t] = a0[t], bs[t] = b0[t];
      acc[t] = _mm256_setzero_ps(), acc_m[t] = _mm_setzero_ps(), summs[t] = tiled[t] = 0.0f;
    }
    for (int64_t i = 0; i < nsb; ++i, w += TS) {
      if (nx)
        for (int b = 0; b < TS; b += 64) prefetch_l2(nx + TS * i + b);
      const float wd = half_to_float(load_u16(w)), wm = half_to_float(load_u16(w + 2));
      const __m256i sm = scales_mins_k4(w + 4);
      for (int t = 0; t < N; ++t) {  // the mins times the 32-element sums of the activations
        const __m256i b16 = _mm256_loadu_si256((const __m256i*)bs[t]);
        const __m128i q8s =
            _mm_hadd_epi16(_mm256_castsi256_si128(b16), _mm256_extracti128_si256(b16, 1));
        const __m128i mq = _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), q8s);
        if constexpr (TILED) {
          mins_i[t] = i4_hsum(mq);
        } else if constexpr (Q5) {
          summs[t] = std::fma(-a[t][0].d * wm, (float)i4_hsum(mq), summs[t]);
        } else {
          acc_m[t] = _mm_fmadd_ps(_mm_set1_ps(-a[t][0].d * wm), _mm_cvtepi32_ps(mq), acc_m[t]);
        }
      }
      const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
      const __m256i hbits = Q5 ? _mm256_loadu_si256((const __m256i*)(w + 16)) : m4;
      __m256i sumi[N];
      for (int t = 0; t < N; ++t) sumi[t] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {  // 64 elements: the low nibbles, then the high ones
        const __m256i q = _mm256_loadu_si256((const __m256i*)(w + QS + 32 * j));
        __m256i lo = _mm256_and_si256(q, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if constexpr (Q5) {
          const int k0 = 2 * j, k1 = 2 * j + 1;
          const __m256i b0 = _mm256_and_si256(hbits, _mm256_slli_epi16(one, k0));
          const __m256i b1 = _mm256_and_si256(hbits, _mm256_slli_epi16(one, k1));
          lo = _mm256_add_epi8(lo, _mm256_slli_epi16(_mm256_srli_epi16(b0, k0), 4));
          hi = _mm256_add_epi8(hi, _mm256_slli_epi16(_mm256_srli_epi16(b1, k1), 4));
        }
        // sub-block k's scale in every 16-bit lane: bytes 2 k, 2 k + 1 of each 128-bit half
        const __m256i sl =
            _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x404 * j)));
        const __m256i sh =
            _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0302 + 0x404 * j)));
        for (int t = 0; t < N; ++t) {
          const __m256i yl = _mm256_loadu_si256((const __m256i*)a[t][2 * j].qs);
          const __m256i yh = _mm256_loadu_si256((const __m256i*)a[t][2 * j + 1].qs);
          const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, yl));
          const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(hi, yh));
          sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(pl, ph));
        }
      }
      for (int t = 0; t < N; ++t) {
        if constexpr (TILED) {
          const float res = std::fma(-wm, (float)mins_i[t], wd * (float)i8_hsum(sumi[t]));
          tiled[t] = std::fma(res, a[t][0].d, tiled[t]);
        } else {
          acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(a[t][0].d * wd), _mm256_cvtepi32_ps(sumi[t]),
                                   acc[t]);
        }
        a[t] += 8, bs[t] += 16;
      }
    }
    for (int t = 0; t < N; ++t) {
      if constexpr (TILED) {
        out[t * ldo] = tiled[t];
        continue;
      }
      float mins = summs[t];
      if constexpr (!Q5) {
        __m128 m = _mm_add_ps(acc_m[t], _mm_movehl_ps(acc_m[t], acc_m[t]));
        mins = _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
      }
      out[t * ldo] = f8_hsum(acc[t]) + mins;
    }
  }
};

// Q6_K row (210 bytes a super-block: ql[128], qh[64], int8 scales[16], f16 d). The offset 32 of
// the 6-bit values comes off the super-block's int32 lanes at the end, as 32 sc_b (sums of the
// 16-element groups 2 l, 2 l + 1 in lane l): ggml's lanes, so its rounding.
struct DotQ6K {
  template <int N, bool TILED>
  static void run(const uint8_t* w, const QAct* const* a0, const int16_t* const* b0, int64_t nsb,
                  const uint8_t* nx, float* out, int64_t ldo) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
    const QAct* a[N];
    const int16_t* bs[N];
    __m256 acc[N];
    float tiled[N];  // TILED
    for (int t = 0; t < N; ++t)
      a[t] = a0[t], bs[t] = b0[t], acc[t] = _mm256_setzero_ps(), tiled[t] = 0.0f;
    for (int64_t i = 0; i < nsb; ++i, w += 210) {
      if (nx)
        for (int b = 0; b < 210; b += 64) prefetch_l2(nx + 210 * i + b);
      const float wd = half_to_float(load_u16(w + 208));
      const int8_t* sc = (const int8_t*)(w + 192);
      const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sc));
      __m256i sumi[N];
      for (int t = 0; t < N; ++t) sumi[t] = _mm256_setzero_si256();
      for (int j = 0; j < 2; ++j) {  // 128 elements
        const uint8_t* ql = w + 64 * j;
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(w + 128 + 32 * j));
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)ql);
        const __m256i l2 = _mm256_loadu_si256((const __m256i*)(ql + 32));
        __m256i q[4], scale[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                               _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
        // bits 2 k, 2 k + 1 of qh as bits 4, 5 of the values of q[k]
        const __m256i h1 = _mm256_srli_epi16(qh, 2), h2 = _mm256_srli_epi16(qh, 4);
        const __m256i h3 = _mm256_srli_epi16(qh, 6);
        q[1] = _mm256_or_si256(_mm256_and_si256(l2, m4),
                               _mm256_slli_epi16(_mm256_and_si256(h1, m2), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(h2, m2), 4));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(h3, m2), 4));
        for (int k = 0; k < 4; ++k) {  // the two 16-element scales of 32 elements
          const int s0 = sc[8 * j + 2 * k], s1 = sc[8 * j + 2 * k + 1];
          scale[k] = _mm256_set_m128i(_mm_set1_epi16((short)s1), _mm_set1_epi16((short)s0));
        }
        for (int t = 0; t < N; ++t) {
          __m256i p[4];
          for (int k = 0; k < 4; ++k) {  // q y in 16-bit pairs, times the scales
            const __m256i q8 = _mm256_loadu_si256((const __m256i*)a[t][4 * j + k].qs);
            p[k] = _mm256_madd_epi16(scale[k], _mm256_maddubs_epi16(q[k], q8));
          }
          sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p[0], p[1]));
          sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p[2], p[3]));
        }
      }
      for (int t = 0; t < N; ++t) {
        const __m256i sums16 = _mm256_loadu_si256((const __m256i*)bs[t]);
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sums16, scales16), 5);
        const __m256i s = _mm256_sub_epi32(sumi[t], offset);
        if constexpr (TILED)
          tiled[t] = std::fma(wd * (float)i8_hsum(s), a[t][0].d, tiled[t]);
        else
          acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(a[t][0].d * wd), _mm256_cvtepi32_ps(s), acc[t]);
        a[t] += 8, bs[t] += 16;
      }
    }
    for (int t = 0; t < N; ++t) out[t * ldo] = TILED ? tiled[t] : f8_hsum(acc[t]);
  }
};

// The row engines of Q4_K, Q5_K and Q6_K with Q8_K activations: the kernels above, one token
// (GEMV, GLU) or 4 at a time (prompts: tokens in tiles of 32, rows handed to the threads in
// chunks), each token's 16-element sums (ggml's bsums) packed beside the activations; f32
// activations keep RowsBase's.
template <int DT, class K>
struct RowsK : RowsBase<DT> {
  using Base = RowsBase<DT>;
  static constexpr bool PACKED = true;
  static size_t packed_bytes(int64_t nch, int64_t T) {
    return (sizeof(int16_t) * 2 * (size_t)(nch * T > 0 ? nch * T : 1) + 63) / 64 * 64;
  }
  // token t's sums: s0, s1 of each chunk, the chunks in order (T tokens one after another)
  static void pack(const QAct* p, int64_t nch, void* g, int64_t t, int64_t) {
    int16_t* b = (int16_t*)g + 2 * nch * t;
    for (int64_t c = 0; c < nch; ++c) {
      b[2 * c] = (int16_t)p[c].s0;
      b[2 * c + 1] = (int16_t)p[c].s1;
    }
  }
  static float one(const uint8_t* w, const ActBuf<DT>& xa, int64_t cols, const uint8_t* nx) {
    const QAct* a = xa.p;
    const int16_t* b = (const int16_t*)xa.g;
    float r;
    K::template run<1, false>(w, &a, &b, cols / 256, nx, &r, 0);
    return r;
  }
  static float dot(const uint8_t* w, const float* x, const ActBuf<DT>& xa, int64_t cols,
                   const uint8_t* nx) {
    return xa.p ? one(w, xa, cols, nx) : Base::dot(w, x, xa, cols, nx);
  }
  static void dot_gu(const uint8_t* const* rows, const uint8_t* const* next, const float* x,
                     const ActBuf<DT>& xa, int64_t cols, float* g, float* u) {
    if (!xa.p) return Base::dot_gu(rows, next, x, xa, cols, g, u);
    *g = one(rows[0], xa, cols, next[0]);
    *u = one(rows[1], xa, cols, next[1]);
  }
  static int qgemm(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols,
                   const ActBuf<DT>& xa, int64_t T, float* out, int64_t ldo, const uint8_t*,
                   int nt) {
    constexpr int64_t QT = 32;
    const int64_t nch = cols / 32, dist = prefetch_dist(row_bytes<DT>(cols));
    const int16_t* bs = (const int16_t*)xa.g;
    return run_dynamic(nt, nrows, 16, [&](int64_t a, int64_t b) -> int {
      for (int64_t t0 = 0; t0 < T; t0 += QT) {
        const int64_t t1 = t0 + QT < T ? t0 + QT : T;
        for (int64_t r = a; r < b; ++r) {
          const uint8_t* w = W + r * ld;
          const uint8_t* nx = t0 == 0 && r + dist < b ? W + (r + dist) * ld : nullptr;
          token_tiles(TileSizes<4, 3, 2, 1>(), t0, t1, [&](auto NT, int64_t t) {
            constexpr int N = decltype(NT)::value;
            const QAct* ap[N];
            const int16_t* bp[N];
            for (int i = 0; i < N; ++i) {
              ap[i] = xa.p + (t + i) * nch;
              bp[i] = bs + 2 * nch * (t + i);
            }
            const uint8_t* p = t == t0 ? nx : nullptr;
            if (T >= 8)  // llama.cpp's tiled K-quant GEMM (batches of 8 tokens or more)
              K::template run<N, true>(w, ap, bp, cols / 256, p, out + t * ldo + r, ldo);
            else
              K::template run<N, false>(w, ap, bp, cols / 256, p, out + t * ldo + r, ldo);
          });
        }
      }
      return 0;
    });
  }
};

template <>
struct Rows<DT_Q4_K> : RowsK<DT_Q4_K, DotQ45K<false>> {};
template <>
struct Rows<DT_Q5_K> : RowsK<DT_Q5_K, DotQ45K<true>> {};
template <>
struct Rows<DT_Q6_K> : RowsK<DT_Q6_K, DotQ6K> {};

#endif

}  // namespace
