#pragma once
// Prompt batches of the 32-element block types with AVX-512 VNNI (PP_WIDE builds): two blocks per
// 512-bit integer dot, activations as separate int8 rows (qs: T x cols), scales d and Q8_1 sums s
// (T x nch). The block terms then join one 8-lane accumulator block by block, in the one-token
// order (QBlocks in vec.h), so a token's result is bit for bit the one-token result (and
// llama.cpp's). Chosen by RowsBase::qgemm (ops.h) for 8 tokens or more.

#include "ops.h"

#if PP_WIDE
namespace {

// tile's kernel: a step is two blocks (chunks 2 c and 2 c + 1).
template <int DT>
struct WideDot {
  using U = UDec<DT>;
  static constexpr bool SGN = U::SIGNED || U::OFF != 0;
  struct X {  // token t: qs + t * cols, dx + t * nch, sx + t * nch
    const int8_t* qs;
    const float* dx;
    const float* sx;
    int64_t cols, nch;
  };
  struct W {
    __m512i wu;     // |q - OFF| as unsigned bytes
    __mmask64 neg;  // where q - OFF < 0
    Affine f0, f1;
  };
  using Acc = __m256;
  using Sm = float;  // Q8_1: the sum of m s
  struct A {
    const int8_t* y;
    const float* d;
    const float* s;
  };
  static constexpr Prefetch PF = PF_NONE;
  static constexpr int64_t STEP = 2 * U::TS;
  static PP_ALWAYS_INLINE int64_t steps(const X& x) { return x.nch / 2; }
  static PP_ALWAYS_INLINE int64_t bytes(const X& x) { return x.nch * U::TS; }
  static PP_ALWAYS_INLINE void zero(Acc& a, Sm& m) {
    a = _mm256_setzero_ps();
    m = 0.0f;
  }
  static PP_ALWAYS_INLINE void decode(const uint8_t* w, int64_t c, const X&, W& o) {
    U8x32 q0, q1;
    U::chunk(w, 2 * c, q0, o.f0);
    U::chunk(w, 2 * c + 1, q1, o.f1);
    __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(q0.v), q1.v, 1);
    if (U::OFF) wq = _mm512_sub_epi8(wq, _mm512_set1_epi8((char)U::OFF));
    o.wu = SGN ? _mm512_abs_epi8(wq) : wq;
    o.neg = SGN ? _mm512_movepi8_mask(wq) : 0;
  }
  static PP_ALWAYS_INLINE A act(const X& x, int t, int64_t c) {
    return {x.qs + t * x.cols + 64 * c, x.dx + t * x.nch + 2 * c, x.sx + t * x.nch + 2 * c};
  }
  static PP_ALWAYS_INLINE void add(Acc& acc, Sm& m, const W& w, const A& a) {
    __m512i y = _mm512_loadu_si512(a.y);
    if (SGN) y = _mm512_mask_sub_epi8(y, w.neg, _mm512_setzero_si512(), y);  // sign(w) * y
    const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w.wu, y));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(w.f0.a0 * a.d[0]), _mm512_castps512_ps256(p), acc);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(w.f1.a0 * a.d[1]), _mm512_extractf32x8_ps(p, 1), acc);
    if (act_kind<DT>() == ACT_Q8_1) {
      m += w.f0.b0 * a.s[0];
      m += w.f1.b0 * a.s[1];
    }
  }
  template <int R>
  static void tail(float*, const uint8_t* const*, const X&, int) {}
  template <int NU>
  static PP_ALWAYS_INLINE float sum(const Acc* a, const Sm* m) {
    return f8_hsum(a[0]) + m[0];
  }
};

template <int DT>
int qgemm_wide(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const QAct* xa,
               int64_t T, float* out, int64_t ldo, int nt) {
  constexpr int64_t QT = 32;
  const int64_t nch = cols / 32;
  int8_t* qs = (int8_t*)std::malloc((size_t)(T * cols) + sizeof(float) * 2 * T * nch);
  if (!qs) return PP_ERR_ARG;
  float* dx = (float*)(qs + T * cols);  // T * cols is a multiple of 64: aligned enough
  float* sx = dx + T * nch;
  for (int64_t i = 0; i < T * nch; ++i) {
    std::memcpy(qs + 32 * i, xa[i].qs, 32);
    dx[i] = xa[i].d;
    sx[i] = xa[i].s;
  }
  const int64_t dist = prefetch_dist(row_bytes<DT>(cols));
  int st = run_dynamic(nt, nrows, 16, [&](int64_t a, int64_t b) -> int {
    for (int64_t t0 = 0; t0 < T; t0 += QT) {
      const int64_t t1 = t0 + QT < T ? t0 + QT : T;
      for (int64_t r = a; r < b; ++r) {
        const uint8_t* w = W + r * ld;
        if (r + dist < b) prefetch_l2(W + (r + dist) * ld);
        token_tiles(TileSizes<8, 1>(), t0, t1, [&](auto NT, int64_t t) {
          float* o = out + t * ldo + r;
          tile<WideDot<DT>, 1, decltype(NT)::value>(
              &w, nullptr, {qs + t * cols, dx + t * nch, sx + t * nch, cols, nch}, &o, ldo);
        });
      }
    }
    return 0;
  });
  std::free(qs);
  return st;
}

}  // namespace
#endif
