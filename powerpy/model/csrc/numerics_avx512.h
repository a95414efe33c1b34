#pragma once
// The 16-lane (AVX-512) pieces of llama.cpp's float numerics (numerics.h): ggml's exp on 16 lanes,
// SwiGLU, the softmax's scale, exp and f16 rounding, and f16-cache attention with 16 cells or 16
// dims in registers. Each hook does its part and returns where it stopped (or true when it did
// all); simd_no16.h has the same hooks for the other builds.

#if !(defined(__AVX512F__))
#error "numerics_avx512.h is for builds with AVX-512F (simd.h chooses the arch headers)"
#endif

#include "simd_avx512.h"

// ggml_expf on 16 lanes at once: the same operations (scalef is j * 2^n with one rounding).
inline __m512 ggml_expf16(__m512 x) {
  const __m512 r = _mm512_set1_ps(0x1.8p23f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r), r);
  const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
  const __m512 u = _mm512_mul_ps(b, b);
  const __m512 j = _mm512_fmadd_ps(
      _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)),
                      u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
      u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
  const __m512 res = _mm512_scalef_ps(j, n);
  const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
  if (!big) return res;
  const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ),
                                          _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
  return _mm512_mask_blend_ps(big, res, alt);
}

// out[i] = silu(g[i]) * u[i] for i in [a, b), 16 at a time; returns where it stopped.
inline int64_t swiglu_vec(const float* g, const float* u, int64_t a, int64_t b, float* out) {
  int64_t i = a;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= b; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = ggml_expf16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)),
                                            _mm512_loadu_ps(u + i)));
  }
  return i;
}

// The softmax's s[t] *= scale, 16 scores at a time, their maximum into mx; returns where it
// stopped.
inline int64_t scale_max16(float* s, int64_t S, float scale, float& mx) {
  int64_t t1 = 0;
  __m512 m16 = _mm512_set1_ps(-INFINITY);
  for (; t1 + 16 <= S; t1 += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + t1), _mm512_set1_ps(scale));
    _mm512_storeu_ps(s + t1, v);
    m16 = _mm512_max_ps(m16, v);
  }
  mx = _mm512_reduce_max_ps(m16);  // a maximum is exact in any order
  return t1;
}

// e[t] = ggml_expf(s[t] - mx) for the m <= 16 scores, e[m..16) = 0.
inline bool exp16(const float* s, int64_t m, float mx, float* e) {
  const __mmask16 k = (__mmask16)((1u << m) - 1);
  const __m512 v = _mm512_maskz_loadu_ps(k, s);
  _mm512_storeu_ps(e, _mm512_maskz_mov_ps(k, ggml_expf16(_mm512_sub_ps(v, _mm512_set1_ps(mx)))));
  return true;
}

// p16[t] = f16(s[t] * inv), 16 at a time; returns where it stopped.
inline int64_t store_f16x16(const float* s, int64_t S, float inv, uint16_t* p16) {
  int64_t t = 0;
  for (; t + 16 <= S; t += 16)
    _mm256_storeu_si256((__m256i*)(p16 + t),
                        _mm512_cvtps_ph(_mm512_mul_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(inv)),
                                        _MM_FROUND_TO_NEAREST_INT));
  return t;
}

// s[c] = reduce16(A[c]) for 16 cells, by shuffles that pair lanes as reduce16 does (halves 8 + 8,
// 4 + 4, then (0 + 2) + (1 + 3)).
inline void reduce16_cells(const __m512* A, float* s) {
  __m512 H[8], Q[4];
  for (int p = 0; p < 8; ++p)  // H[p] = (h of cell 2p, h of cell 2p + 1), 8 lanes each
    H[p] = _mm512_add_ps(_mm512_shuffle_f32x4(A[2 * p], A[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(A[2 * p], A[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k4 = 0; k4 < 4; ++k4)  // Q[k4] = q of cells 4 k4 .. 4 k4 + 3, 4 lanes each
    Q[k4] = _mm512_add_ps(_mm512_shuffle_f32x4(H[2 * k4], H[2 * k4 + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(H[2 * k4], H[2 * k4 + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 R[2];  // 128-bit lane j of R[m]: (r0, r1) of cell 8 m + j, then of cell 8 m + 4 + j
  for (int m = 0; m < 2; ++m)
    R[m] = _mm512_add_ps(_mm512_shuffle_ps(Q[2 * m], Q[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(Q[2 * m], Q[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // element 4 j + k: the sum of cell 4 k + j
  const __m512 Z = _mm512_add_ps(_mm512_shuffle_ps(R[0], R[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(R[0], R[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  _mm512_storeu_ps(s, _mm512_permutexvar_ps(idx, Z));
}

// The batched (tinyBLAS) q·k of 16 cells k + c * stride at once, q (nq vectors of 16) preloaded:
// one accumulator per cell, then reduce16_cells, so each result is bit for bit
// dot_f16(..., one = false). s[c] = the score of cell c.
template <int NQ>
inline void kq16(const uint16_t* k, int64_t stride, const __m512* qv, float* s) {
  __m512 A[16];
  for (int c = 0; c < 16; ++c) A[c] = _mm512_setzero_ps();
  for (int e = 0; e < NQ; ++e)  // NQ known: the 16 accumulators stay in registers
    for (int c = 0; c < 16; ++c)
      A[c] = _mm512_fmadd_ps(v_load_h(k + c * stride + 16 * e), qv[e], A[c]);
  reduce16_cells(A, s);
}

// The one-token q·k (ggml_vec_dot_f16's order) of 16 cells at once, head_dim 64 NS: per cell
// four 16-lane accumulators over 64-element steps, summed (0 + 2) + (1 + 3), then reduced as
// kq16 does; bit for bit dot_f16(..., one = true).
template <int NS>
inline void kq16_one(const uint16_t* k, int64_t stride, const __m512* qv, float* s) {
  __m512 A[16];
  for (int c = 0; c < 16; ++c) {
    __m512 a[4];
    for (int j = 0; j < 4; ++j) a[j] = _mm512_setzero_ps();
    for (int st = 0; st < NS; ++st)
      for (int j = 0; j < 4; ++j)
        a[j] = _mm512_fmadd_ps(v_load_h(k + c * stride + 64 * st + 16 * j), qv[4 * st + j], a[j]);
    A[c] = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
  }
  reduce16_cells(A, s);
}

// Scores s[t] of query q16 against the cached keys (rows of stride nkv from kc + off) for the
// cells t < n, 16 at a time, for the common head sizes (64, 128); returns where it stopped.
inline int64_t kq_cells16(const uint16_t* kc, int64_t nkv, int64_t off, int64_t hd, bool one_kq,
                          const uint16_t* q16, int64_t n, float* s) {
  int64_t t0 = 0;
  if (hd == 64 || hd == 128) {
    __m512 qv[8];
    for (int64_t e = 0; e < hd / 16; ++e) qv[e] = v_load_h(q16 + 16 * e);
    for (; t0 + 16 <= n; t0 += 16) {
      const uint16_t* k = kc + t0 * nkv + off;
      if (one_kq) {
        if (hd == 64) kq16_one<1>(k, nkv, qv, s + t0);
        else kq16_one<2>(k, nkv, qv, s + t0);
      } else if (hd == 64) {
        kq16<4>(k, nkv, qv, s + t0);
      } else {
        kq16<8>(k, nkv, qv, s + t0);
      }
    }
  }
  return t0;
}

// o[d] = the weighted sum over the cells t < n of v[t, d] (rows of stride nkv from vc + off) and
// the f16 weights p16, 16 dims at a time with their 16 lanes in registers (s receives the weights
// as f32); false where hd % 16 != 0. Cell t sits in lane (t / 16) % 4 (one token) or 0, and
// t % 16; the padding cells of llama.cpp's cache add zeros, which change no sum.
inline bool kqv16(const uint16_t* vc, int64_t nkv, int64_t off, int64_t hd, int64_t n,
                  bool one_kqv, const uint16_t* p16, float* s, float* o) {
  if (hd % 16) return false;
  if (one_kqv) {  // one token: 4 x 16 lanes of 16 dims, 16 in registers
    for (int64_t t = 0; t < n; ++t) s[t] = half_to_float(p16[t]);
    for (int64_t dc = 0; dc < hd; dc += 16) {
      __m512 G[4][16];  // lane (g, l): cells t with (t / 16) % 4 == g and t % 16 == l
      const uint16_t* vr = vc + off + dc;
      for (int g = 0; g < 4; ++g) {
        __m512 A[16];
        for (int l = 0; l < 16; ++l) A[l] = _mm512_setzero_ps();
        for (int64_t t0 = 16 * g; t0 < n; t0 += 64) {
          const int64_t m = n - t0 < 16 ? n - t0 : 16;
          for (int l = 0; l < m; ++l)
            A[l] = _mm512_fmadd_ps(v_load_h(vr + (t0 + l) * nkv), _mm512_set1_ps(s[t0 + l]),
                                   A[l]);
        }
        for (int l = 0; l < 16; ++l) G[g][l] = A[l];
      }
      __m512 L[16];
      for (int l = 0; l < 16; ++l)
        L[l] = _mm512_add_ps(_mm512_add_ps(G[0][l], G[2][l]), _mm512_add_ps(G[1][l], G[3][l]));
      _mm512_storeu_ps(o + dc, tree16(L));
    }
    return true;
  }
  // a batch (tinyBLAS): the 16 lanes of 16 dims in registers
  for (int64_t t = 0; t < n; ++t) s[t] = half_to_float(p16[t]);
  for (int64_t dc = 0; dc < hd; dc += 16) {
    __m512 A[16];
    for (int l = 0; l < 16; ++l) A[l] = _mm512_setzero_ps();
    const uint16_t* vr = vc + off + dc;
    const float* pf = s;  // the weights as f32 (exact: f16 values)
    int64_t t = 0;
    for (; t + 16 <= n; t += 16)
      for (int l = 0; l < 16; ++l)
        A[l] = _mm512_fmadd_ps(v_load_h(vr + (t + l) * nkv), _mm512_set1_ps(pf[t + l]), A[l]);
    for (int l = 0; t < n; ++t, ++l)
      A[l] = _mm512_fmadd_ps(v_load_h(vr + t * nkv), _mm512_set1_ps(pf[t]), A[l]);
    _mm512_storeu_ps(o + dc, tree16(A));  // reduce16 of the lanes, 16 dims at once
  }
  return true;
}
