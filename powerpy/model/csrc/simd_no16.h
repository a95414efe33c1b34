#pragma once
// Builds without AVX-512: no 16-lane pieces. Each hook says it did nothing (returns its start, or
// false), and its caller's portable loop does the work (numerics_avx512.h has the real ones).

// The float vectors of the build that takes these hooks (simd.h's choice).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#else
#include "simd_scalar.h"
#endif

// ggml's GW lanes held in GW / VL vectors, reduced as hsum_gw and vreduce_gw do (AVX-512 holds
// them in one vector: simd_avx512.h).
inline float lanes_hsum(const vf* acc) {
  float lanes[16];
  for (int u = 0; u < GW / VL; ++u) v_store(lanes + u * VL, acc[u]);
  return hsum_gw(lanes);
}
inline float lanes_vreduce(const vf* acc) {
  float lanes[16];
  for (int u = 0; u < GW / VL; ++u) v_store(lanes + u * VL, acc[u]);
  return vreduce_gw(lanes);
}

inline int64_t scale_max16(float*, int64_t, float, float&) { return 0; }
inline bool exp16(const float*, int64_t, float, float*) { return false; }
inline int64_t store_f16x16(const float*, int64_t, float, uint16_t*) { return 0; }
inline int64_t kq_cells16(const uint16_t*, int64_t, int64_t, int64_t, bool, const uint16_t*,
                          int64_t, float*) {
  return 0;
}
inline bool kqv16(const uint16_t*, int64_t, int64_t, int64_t, int64_t, bool, const uint16_t*,
                  float*, float*) {
  return false;
}
