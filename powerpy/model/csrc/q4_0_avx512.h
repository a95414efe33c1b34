#pragma once
// Q4_0's own kernel on AVX-512F, a specialization of vec.h's RowSum: row sums through a
// 16-entry table. (Its dot products take the one-block kernels of every AVX2 build, and WideDot
// in prompts: llama.cpp's AVX-512 build keeps ggml_vec_dot_q4_0_q8_0's 8 lanes, block after
// block, and so do they. A four-block kernel summed 16 lanes, about 1.5x (GEMV) to 2.4x (64-token
// GEMM) faster on a Zen 4 host, but not in llama.cpp's order: tests/test_ggml_vec_dot.py.)

#include "ops.h"

namespace {

#if PP_SIMD == 2
// A chunk as its 32 values q - 8 (exact) and d; acc += q * f32(d h): the per-row scale d h is
// one rounded product, and the 16-entry table stays in a register.
template <>
struct RowSum<DT_Q4_0> {
  struct C {
    vf q0, q1;
    float d;
  };
  using S = float;
  static PP_ALWAYS_INLINE void load(const uint8_t* w, int64_t b, C& c) {
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const uint8_t* p = w + b * Dec<DT_Q4_0>::BB;
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 2)));
    c.q0 = _mm512_permutexvar_ps(q, lut);  // vpermps reads the low 4 bits
    c.q1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
    c.d = half_to_float(load_u16(p));
  }
  static PP_ALWAYS_INLINE S scale(float h) { return h; }
  static PP_ALWAYS_INLINE void madd(const C& c, S h, vf* a) {
    const vf sr = v_set1(c.d * h);
    a[0] = v_fma(c.q0, sr, a[0]);
    a[1] = v_fma(c.q1, sr, a[1]);
  }
};
#endif

}  // namespace
