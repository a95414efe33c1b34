// Q4_K's, Q5_K's and Q6_K's one-token dot products on AVX2, a 256-element super-block at a time in
// ggml's order (vec_dot_q4_K_q8_K and its Q5_K and Q6_K forms: the same float bits,
// tests/test_ggml_vec_dot.py): the sub-block scales multiply 16-bit integer sums (u8 x s8
// products in pairs), one 8-lane int32 sum per super-block is scaled by d_w d_x with one FMA,
// the mins take a sum of their own, and the lanes are summed as ggml sums them. The per-chunk
// path (vec.h's QChunks: an f32 sum per 32 elements, with two horizontal adds each) ran Q4_K_M
// decode at about a fifth of llama.cpp's speed. Prompts keep QChunks (their tiles share each
// decoded chunk among up to 8 tokens).

namespace {

#if defined(__AVX2__)

// sum over 8 lanes, as ggml's hsum_float_8
inline float hsum8_ps(__m256 x) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
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

// Q4_K row (nsb super-blocks of 144 bytes: f16 d, f16 dmin, scales[12], qs[128]) . Q8_K
// activations a (8 chunks per super-block); the row nx (may be null) is prefetched.
inline float dot_q4_K(const uint8_t* w, const QAct* a, const int16_t* bsums, int64_t nsb,
                      const uint8_t* nx) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  __m256 acc = _mm256_setzero_ps();
  __m128 acc_m = _mm_setzero_ps();
  for (int64_t i = 0; i < nsb; ++i, w += 144, a += 8, bsums += 16) {
    if (nx) {
      prefetch_l2(nx + 144 * i);
      prefetch_l2(nx + 144 * i + 64);
      prefetch_l2(nx + 144 * i + 128);
    }
    const float d = a[0].d * half_to_float(load_u16(w));
    const float dmin = -a[0].d * half_to_float(load_u16(w + 2));
    const __m256i sm = scales_mins_k4(w + 4);
    // the mins times the 32-element sums of the activations: 4 lanes of 2 sub-blocks
    const __m256i b16 = _mm256_loadu_si256((const __m256i*)bsums);
    const __m128i q8s =
        _mm_hadd_epi16(_mm256_castsi256_si128(b16), _mm256_extracti128_si256(b16, 1));
    const __m128i mq = _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), q8s);
    acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(mq), acc_m);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {  // 64 elements: the low nibbles, then the high ones
      const __m256i q4 = _mm256_loadu_si256((const __m256i*)(w + 16 + 32 * j));
      const __m256i lo = _mm256_and_si256(q4, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
      const __m256i yl = _mm256_loadu_si256((const __m256i*)a[2 * j].qs);
      const __m256i yh = _mm256_loadu_si256((const __m256i*)a[2 * j + 1].qs);
      // sub-block k's scale in every 16-bit lane: bytes 2 k, 2 k + 1 of each 128-bit half
      const __m256i sl =
          _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x404 * j)));
      const __m256i sh =
          _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0302 + 0x404 * j)));
      const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, yl));
      const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(hi, yh));
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
  }
  acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
  acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
  return hsum8_ps(acc) + _mm_cvtss_f32(acc_m);
}

// Q5_K row (176 bytes a super-block: f16 d, f16 dmin, scales[12], qh[32], qs[128]): Q4_K's
// nibbles plus bit 2 j (low nibbles) or 2 j + 1 (high) of qh as bit 4; the mins' term is a
// scalar sum per row here, as in ggml's kernel.
inline float dot_q5_K(const uint8_t* w, const QAct* a, const int16_t* bsums, int64_t nsb,
                      const uint8_t* nx) {
  const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps();
  float summs = 0.0f;
  for (int64_t i = 0; i < nsb; ++i, w += 176, a += 8, bsums += 16) {
    if (nx)
      for (int b = 0; b < 176; b += 64) prefetch_l2(nx + 176 * i + b);
    const float d = a[0].d * half_to_float(load_u16(w));
    const float dmin = -a[0].d * half_to_float(load_u16(w + 2));
    const __m256i sm = scales_mins_k4(w + 4);
    const __m256i b16 = _mm256_loadu_si256((const __m256i*)bsums);
    const __m128i q8s =
        _mm_hadd_epi16(_mm256_castsi256_si128(b16), _mm256_extracti128_si256(b16, 1));
    const __m128i prod = _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), q8s);
    const __m128i z = _mm_setzero_si128();
    summs = std::fma(dmin, (float)_mm_cvtsi128_si32(_mm_hadd_epi32(_mm_hadd_epi32(prod, z), z)),
                     summs);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
    const __m256i hbits = _mm256_loadu_si256((const __m256i*)(w + 16));
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i q5 = _mm256_loadu_si256((const __m256i*)(w + 48 + 32 * j));
      const __m256i h0 = _mm256_slli_epi16(
          _mm256_srli_epi16(_mm256_and_si256(hbits, _mm256_slli_epi16(one, 2 * j)), 2 * j), 4);
      const __m256i h1 = _mm256_slli_epi16(
          _mm256_srli_epi16(_mm256_and_si256(hbits, _mm256_slli_epi16(one, 2 * j + 1)), 2 * j + 1),
          4);
      const __m256i lo = _mm256_add_epi8(_mm256_and_si256(q5, m4), h0);
      const __m256i hi = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(q5, 4), m4), h1);
      const __m256i yl = _mm256_loadu_si256((const __m256i*)a[2 * j].qs);
      const __m256i yh = _mm256_loadu_si256((const __m256i*)a[2 * j + 1].qs);
      const __m256i sl =
          _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x404 * j)));
      const __m256i sh =
          _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0302 + 0x404 * j)));
      const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, yl));
      const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(hi, yh));
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
  }
  return hsum8_ps(acc) + summs;
}

// Q6_K row (210 bytes a super-block: ql[128], qh[64], int8 scales[16], f16 d) . Q8_K a. The
// offset 32 of the 6-bit values comes off the super-block's int32 lanes at the end, as
// 32 sc_b (sums of the 16-element groups 2 l, 2 l + 1 in lane l): ggml's lanes, so its rounding.
inline float dot_q6_K(const uint8_t* w, const QAct* a, const int16_t* bsums, int64_t nsb,
                      const uint8_t* nx) {
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < nsb; ++i, w += 210, a += 8, bsums += 16) {
    if (nx)
      for (int b = 0; b < 210; b += 64) prefetch_l2(nx + 210 * i + b);
    const float d = a[0].d * half_to_float(load_u16(w + 208));
    const int8_t* sc = (const int8_t*)(w + 192);
    const __m256i sums16 = _mm256_loadu_si256((const __m256i*)bsums);
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sc));
    const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sums16, scales16), 5);
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 2; ++j) {  // 128 elements
      const uint8_t* ql = w + 64 * j;
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(w + 128 + 32 * j));
      const __m256i l1 = _mm256_loadu_si256((const __m256i*)ql);
      const __m256i l2 = _mm256_loadu_si256((const __m256i*)(ql + 32));
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                             _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(l2, m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
      __m256i p[4];
      for (int k = 0; k < 4; ++k) {  // q y in 16-bit pairs, times the two 16-element scales
        const __m256i q8 = _mm256_loadu_si256((const __m256i*)a[4 * j + k].qs);
        const int s0 = sc[8 * j + 2 * k], s1 = sc[8 * j + 2 * k + 1];
        const __m256i scale =
            _mm256_set_m128i(_mm_set1_epi16((short)s1), _mm_set1_epi16((short)s0));
        p[k] = _mm256_madd_epi16(scale, _mm256_maddubs_epi16(q[k], q8));
      }
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
    }
    sumi = _mm256_sub_epi32(sumi, offset);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
  }
  return hsum8_ps(acc);
}

// The row engines of Q4_K, Q5_K and Q6_K: their one-token dots with Q8_K activations are the
// super-block kernels above, which read each token's 16-element sums (ggml's bsums) packed
// beside the activations; f32 activations and prompts keep RowsBase's.
template <int DT, float (*DOT)(const uint8_t*, const QAct*, const int16_t*, int64_t,
                               const uint8_t*)>
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
  static float dot(const uint8_t* w, const float* x, const ActBuf<DT>& xa, int64_t cols,
                   const uint8_t* nx) {
    if (!xa.p) return Base::dot(w, x, xa, cols, nx);
    return DOT(w, xa.p, (const int16_t*)xa.g, cols / 256, nx);
  }
  static void dot_gu(const uint8_t* const* rows, const uint8_t* const* next, const float* x,
                     const ActBuf<DT>& xa, int64_t cols, float* g, float* u) {
    if (!xa.p) return Base::dot_gu(rows, next, x, xa, cols, g, u);
    *g = DOT(rows[0], xa.p, (const int16_t*)xa.g, cols / 256, next[0]);
    *u = DOT(rows[1], xa.p, (const int16_t*)xa.g, cols / 256, next[1]);
  }
};

template <>
struct Rows<DT_Q4_K> : RowsK<DT_Q4_K, dot_q4_K> {};
template <>
struct Rows<DT_Q5_K> : RowsK<DT_Q5_K, dot_q5_K> {};
template <>
struct Rows<DT_Q6_K> : RowsK<DT_Q6_K, dot_q6_K> {};

#endif

}  // namespace
