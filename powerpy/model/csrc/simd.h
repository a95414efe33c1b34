#pragma once
// The ISA, chosen here at compile time: byte vectors for the integer dot
// products (bytes_avx2.h or bytes_scalar.h), float vectors with their block decoders and
// reductions (simd_avx512.h: 16 lanes, simd_avx2.h: 8, simd_scalar.h: 1), and the 16-lane
// pieces of llama.cpp's numerics (numerics_avx512.h, or simd_no16.h: none). Each arch header
// provides the same names; the rest of the kernels are written once against them. PP_SIMD
// (2 / 1 / 0) is what pp_simd_level reports; PP_WIDE (0 / 1) switches on the AVX-512 VNNI
// prompt tiles (wide_avx512.h).

#include "common.h"

// Each float vector header includes its byte vectors (AVX2's, or simd_scalar.h's choice).
#if defined(__AVX512F__)
#include "simd_avx512.h"
#include "numerics_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#include "simd_no16.h"
#else
#include "simd_scalar.h"
#include "simd_no16.h"
#endif

#if PP_SIMD == 2 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PP_WIDE 1
#else
#define PP_WIDE 0
#endif

namespace {

constexpr int NV = 32 / VL;  // vectors per 32-element block

// ggml's vectorized expf, lane by lane: n = round(x / ln 2) by the 1.5 * 2^23 trick, b = x - n ln 2
// in two parts, a degree-5 polynomial, then times 2^n. llama.cpp built for this CPU runs its
// AVX-512 form (j(b) then j * 2^n, saturating beyond |n| > 192) or, with AVX2 (GW == 8), its AVX2
// form (the polynomial without its 1, then k + k * j with k = 2^n, rescaled in two steps beyond
// |n| > 126).
inline float ggml_expf(float x) {
  const float r = 0x1.8p23f;
  const float z = std::fma(x, 0x1.715476p+0f, r);
  const float n = z - r;
  if constexpr (GW == 8) {
    const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
    uint32_t zb, one_b;
    const float one = 1.0f;
    std::memcpy(&zb, &z, 4);
    std::memcpy(&one_b, &one, 4);
    const uint32_t e = zb << 23;
    const uint32_t kb = e + one_b;
    float k;
    std::memcpy(&k, &kb, 4);
    const float u = b * b;
    const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                      std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                             u, 0x1.ffffecp-1f * b);
    if (!(std::fabs(n) > 126.0f)) return std::fma(k, j, k);
    const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
    const uint32_t s1b = g + 0x7f000000u, s2b = e - g;
    float s1, s2;
    std::memcpy(&s1, &s1b, 4);
    std::memcpy(&s2, &s2b, 4);
    if (std::fabs(n) > 192.0f) return s1 * s1;
    return std::fma(s2, j, s2) * s1;
  } else {
    if (n != n) return n;
    if (std::fabs(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
    const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
    const float u = b * b;
    const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                      std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                             u, std::fma(0x1.ffffecp-1f, b, 1.0f));
    const int e = (int)n, e1 = e / 2, e2 = e - e1;  // two exact powers: one rounding, as scalef
    uint32_t b1 = (uint32_t)(e1 + 127) << 23, b2 = (uint32_t)(e2 + 127) << 23;
    float p1, p2;
    std::memcpy(&p1, &b1, 4);
    std::memcpy(&p2, &b2, 4);
    return (j * p1) * p2;
  }
}

inline float ggml_silu(float x) { return x / (1.0f + ggml_expf(0.0f - x)); }

}  // namespace
