#pragma once
// MXFP4 (ggml type 39, GPT-OSS's experts): blocks of 32 values in 17 bytes, an E8M0 scale e and
// 16 bytes of 4-bit E2M1 codes (element j < 16 in byte j's low nibble, j + 16 in its high one);
// element = MX_VALUES[code] * 2^(e - 128) (the values are doubled, the scale halved, as ggml's).
// Products round the activations to Q8_0 (ggml's vec_dot_type for MXFP4) and sum in the order of
// ggml's AVX2 ggml_vec_dot_mxfp4_q8_0 (its x86 builds take that path): blocks alternate between
// two 8-lane f32 accumulators, lane l holding the integer sum of elements 4l .. 4l + 3 times
// d_x * d_w with one FMA; the two are added lane by lane and summed as hsum_float_8; an odd last
// block adds d * (its integer sum) after. These rows keep the file's layout, so a row gather, a
// GEMV and a prompt's GEMM have the same bits token by token; matrices and stacks of 8k rows,
// which llama.cpp repacks, take the interleaved layout and its GEMV's order instead
// (mxfp4_x8.h). With f32 activations (act 0) the values are exact and sum in f32.

#include "ops.h"

namespace {

constexpr int8_t MX_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int64_t MX_TS = 17;  // bytes per block

inline float e8m0_half(uint8_t e) {  // 2^(e - 128), subnormal for e < 2 (ggml's)
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX2__)
// The 8 lanes of mx_lanes (below) in a register.
inline __m256i mx_lanes8(const uint8_t* p, const QAct& a) {
  const __m128i tab = _mm_loadu_si128((const __m128i*)MX_VALUES), m4 = _mm_set1_epi8(0x0f);
  const __m128i bits = _mm_loadu_si128((const __m128i*)(p + 1));
  const __m256i w = _mm256_set_m128i(_mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(bits, 4), m4)),
                                     _mm_shuffle_epi8(tab, _mm_and_si128(bits, m4)));
  const __m256i y = _mm256_loadu_si256((const __m256i*)a.qs);
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}
#endif

// lane[l] = sum over elements 4l .. 4l + 3 of block p's values (doubled) times a's int8 values.
inline void mx_lanes(const uint8_t* p, const QAct& a, int32_t* lane) {
#if defined(__AVX2__)
  _mm256_storeu_si256((__m256i*)lane, mx_lanes8(p, a));
#else
  for (int l = 0; l < 8; ++l) {
    int32_t s = 0;
    for (int j = 4 * l; j < 4 * l + 4; ++j) {
      const int code = j < 16 ? p[1 + j] & 15 : p[1 + j - 16] >> 4;
      s += MX_VALUES[code] * a.qs[j];
    }
    lane[l] = s;
  }
#endif
}

// dot(row, x) for a row of nb blocks and x's Q8_0 chunks a, in ggml's order (above). The AVX2
// path keeps the two accumulators in registers: a vector FMA rounds each lane as std::fma does,
// so every path gives the same bits.
inline float mx_dot(const uint8_t* row, const QAct* a, int64_t nb) {
  float sum[8];
  int64_t b = 0;
#if defined(__AVX512BW__)
  // Two blocks a step in one 512-bit register: the low half is the first accumulator (blocks
  // b), the high half the second (blocks b + 1). |w| times y with y's sign flipped where w < 0
  // is the AVX2 path's sign trick without a 512-bit sign instruction.
  const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)MX_VALUES));
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const __m512i zero = _mm512_setzero_si512(), ones = _mm512_set1_epi16(1);
  __m512 acc = _mm512_setzero_ps();
  for (; b + 1 < nb; b += 2) {
    const uint8_t* p = row + b * MX_TS;
    const __m128i b0 = _mm_loadu_si128((const __m128i*)(p + 1));
    const __m128i b1 = _mm_loadu_si128((const __m128i*)(p + MX_TS + 1));
    const __m256i n0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b0, 4), m4), _mm_and_si128(b0, m4));
    const __m256i n1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b1, 4), m4), _mm_and_si128(b1, m4));
    const __m512i w = _mm512_shuffle_epi8(tab, _mm512_inserti64x4(_mm512_castsi256_si512(n0), n1, 1));
    const __m512i y = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a[b].qs)),
        _mm256_loadu_si256((const __m256i*)a[b + 1].qs), 1);
    const __m512i ys = _mm512_mask_sub_epi8(y, _mm512_movepi8_mask(w), zero, y);
    const __m512i lanes = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), ys), ones);
    const float d0 = a[b].d * e8m0_half(p[0]), d1 = a[b + 1].d * e8m0_half(p[MX_TS]);
    const __m512 d = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
    acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lanes), acc);
  }
  _mm256_storeu_ps(sum, _mm256_add_ps(_mm512_castps512_ps256(acc),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1))));
#elif defined(__AVX2__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; b + 1 < nb; b += 2) {
    const uint8_t* p = row + b * MX_TS;
    const float d0 = a[b].d * e8m0_half(p[0]), d1 = a[b + 1].d * e8m0_half(p[MX_TS]);
    acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(mx_lanes8(p, a[b])), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1), _mm256_cvtepi32_ps(mx_lanes8(p + MX_TS, a[b + 1])), acc1);
  }
  _mm256_storeu_ps(sum, _mm256_add_ps(acc0, acc1));
#else
  float acc[2][8] = {};
  for (; b + 1 < nb; b += 2)
    for (int i = 0; i < 2; ++i) {
      int32_t lane[8];
      mx_lanes(row + (b + i) * MX_TS, a[b + i], lane);
      const float d = a[b + i].d * e8m0_half(row[(b + i) * MX_TS]);
      for (int l = 0; l < 8; ++l) acc[i][l] = std::fma(d, (float)lane[l], acc[i][l]);
    }
  for (int l = 0; l < 8; ++l) sum[l] = acc[0][l] + acc[1][l];
#endif
  float s = hsum8(sum);
  if (b < nb) {
    int32_t lane[8];
    mx_lanes(row + b * MX_TS, a[b], lane);
    int32_t si = 0;
    for (int l = 0; l < 8; ++l) si += lane[l];
    s += (a[b].d * e8m0_half(row[b * MX_TS])) * (float)si;
  }
  return s;
}

// The 32 values of block p as f32 (exact).
inline void mx_block(const uint8_t* p, float* y) {
  const float d = e8m0_half(p[0]);
  for (int j = 0; j < 16; ++j) {
    y[j] = (float)MX_VALUES[p[1 + j] & 15] * d;
    y[j + 16] = (float)MX_VALUES[p[1 + j] >> 4] * d;
  }
}

// out[t * ldo + j] = row idx[j] (j < k; idx null: row j) · x_t for T tokens x_t = x + t * ldx.
static int mx_gemm(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
                   int64_t ldx, int64_t T, const int64_t* idx, int64_t k, float* out, int64_t ldo,
                   int act, int nt) {
  if (cols % 32 || T < 0 || k < 0) return PP_ERR_ARG;
  for (int64_t j = 0; idx && j < k; ++j)
    if (idx[j] < 0 || idx[j] >= nrows) return PP_ERR_INDEX;
  const int64_t nb = cols / 32;
  QAct* a = act ? (QAct*)std::malloc(sizeof(QAct) * (size_t)(nb * T + 1)) : nullptr;
  if (act && !a) return PP_ERR_ARG;
  for (int64_t t = 0; act && t < T; ++t) quantize_act(ACT_Q8_0, x + t * ldx, cols, a + t * nb);
  const int team = team_size(nt, k * nb * MX_TS);
  const int st = run_partitioned(team, k, [&](int64_t j0, int64_t j1) -> int {
    float y[32];
    for (int64_t j = j0; j < j1; ++j) {
      const uint8_t* row = W + (idx ? idx[j] : j) * ld;
      for (int64_t t = 0; t < T && act; ++t) out[t * ldo + j] = mx_dot(row, a + t * nb, nb);
      for (int64_t t = 0; t < T && !act; ++t) {
        float s = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          mx_block(row + b * MX_TS, y);
          for (int i = 0; i < 32; ++i) s = std::fma(y[i], x[t * ldx + 32 * b + i], s);
        }
        out[t * ldo + j] = s;
      }
    }
    return 0;
  });
  std::free(a);
  return st;
}

// out[t * cols + c] (+)= sum_j h[t * hs + j] * row idx[j] (idx null: row j), j < k, for T
// tokens; the zero h are skipped; with tau (per row) a |h| below it too, and kept counts the
// rows added. Threads take ranges of whole blocks of columns.
static int mx_axpy(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* h,
                   int64_t hs, int64_t T, const int64_t* idx, int64_t k, float* out, int accumulate,
                   int nt, const float* tau = nullptr, int64_t* kept = nullptr) {
  if (cols % 32 || T < 0 || k < 0) return PP_ERR_ARG;
  for (int64_t j = 0; idx && j < k; ++j)
    if (idx[j] < 0 || idx[j] >= nrows) return PP_ERR_INDEX;
  const int64_t nb = cols / 32;
  if (!accumulate) std::memset(out, 0, sizeof(float) * (size_t)(T * cols));
  if (kept) {
    *kept = 0;
    for (int64_t j = 0; j < k; ++j)
      *kept += h[j] != 0.0f && !(tau && std::fabs(h[j]) < tau[idx ? idx[j] : j]);
  }
  const int team = team_size(nt, T * k * nb * MX_TS);
  return run_partitioned(team, nb, [&](int64_t b0, int64_t b1) -> int {
    float y[32];
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const float v = h[t * hs + j];
        const int64_t r = idx ? idx[j] : j;
        if (v == 0.0f || (tau && std::fabs(v) < tau[r])) continue;
        for (int64_t b = b0; b < b1; ++b) {
          mx_block(W + r * ld + b * MX_TS, y);
          float* o = out + t * cols + 32 * b;
          for (int i = 0; i < 32; ++i) o[i] = std::fma(v, y[i], o[i]);
        }
      }
    return 0;
  });
}

// out[j, :] = row idx[j] (idx null: row j) as f32, j < k.
static int mx_dequant(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols,
                      const int64_t* idx, int64_t k, float* out) {
  if (cols % 32) return PP_ERR_ARG;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t r = idx ? idx[j] : j;
    if (r < 0 || r >= nrows) return PP_ERR_INDEX;
    for (int64_t b = 0; b < cols / 32; ++b) mx_block(W + r * ld + b * MX_TS, out + j * cols + 32 * b);
  }
  return 0;
}

}  // namespace
