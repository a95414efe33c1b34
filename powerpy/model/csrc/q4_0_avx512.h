// Q4_0's own kernel on AVX-512F, a specialization of vec.h's AxpyBlock: row sums through a
// 16-entry table. (Its dot products take the one-block kernels of every AVX2 build, and WideDot
// in prompts: llama.cpp's AVX-512 build keeps ggml_vec_dot_q4_0_q8_0's 8 lanes, block after
// block, and so do they. A four-block kernel summed 16 lanes, about 1.5x (GEMV) to 2.4x (64-token
// GEMM) faster on a Zen 4 host, but not in llama.cpp's order: tests/test_ggml_vec_dot.py.)

namespace {

#if PP_SIMD == 2
// Four rows' h_r d folded into one scalar per row and block: the table stays constant.
template <>
struct AxpyBlock<DT_Q4_0, 4> {
  const float* h;
  __m512 lut;
  explicit AxpyBlock(const float* h_)
      : h(h_), lut(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)) {}
  inline void add(const uint8_t* const* w, int64_t b, float* ab) const {
    vf a0 = v_load(ab), a1 = v_load(ab + 16);
    for (int r = 0; r < 4; ++r) {
      const uint8_t* p = w[r] + b * Dec<DT_Q4_0>::BB;
      const vf sr = v_set1(half_to_float(load_u16(p)) * h[r]);
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 2)));
      a0 = v_fma(_mm512_permutexvar_ps(q, lut), sr, a0);  // vpermps reads the low 4 bits
      a1 = v_fma(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut), sr, a1);
    }
    v_store(ab, a0);
    v_store(ab + 16, a1);
  }
};
#endif

}  // namespace
