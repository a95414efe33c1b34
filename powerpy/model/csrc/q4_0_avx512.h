// Q4_0's own kernels on AVX-512, chosen here and nowhere else (specializations of vec.h's
// AxpyBlock and ops.h's Rows): row sums through a 16-entry table (AVX-512F), and dot products
// four blocks at a time (AVX-512 VBMI + VNNI, PP_Q4W builds).
//
// Four blocks at a time: a group of 4 Q4_0 blocks (128 elements, 72 bytes) is read with two loads:
// one two-register byte permute gathers its 64 nibble bytes, one word permute its 4 scales (the
// f16 d of block b is word 9 b). The low nibbles (elements 0..15 of each block) and the high ones
// (16..31), as unsigned bytes 0..15, each take one 512-bit u8 x s8 dot against the int8
// activations, stored in the same order (QGroup), so a 32-bit lane sums 8 products of one block.
// The lane starts at -8 * (its 8 activations), stored with them, which leaves sum (q - 8) y; it is
// then scaled by d_w d_x with one FMA. The integers equal ggml's; only the f32 summation order of
// the block terms differs from the one-block path (16 lanes instead of 8). A tile of R rows and
// NT tokens shares each weight decode among the tokens and each activation load among the rows.

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

#if PP_Q4W
struct alignas(64) QGroup {  // 4 Q8_0 activation blocks in the Q4_0 group order
  int8_t lo[64];     // elements 0..15 of blocks 0..3
  int8_t hi[64];     // elements 16..31 of blocks 0..3
  float dx[16];      // lane 4 b + l: d_x of block b
  int32_t minus8[16];  // lane i: -8 * (lo[4 i .. 4 i + 3] + hi[4 i .. 4 i + 3])
};

// One vector's QAct chunks (nch of them) -> (nch + 3) / 4 groups g[0], g[T], g[2 T], ... (the
// groups of T vectors are interleaved, so a GEMM reads its tokens' groups from one span);
// missing blocks of the last group are zeros (with d_x 0).
inline void pack_groups(const QAct* xa, int64_t nch, QGroup* g, int64_t T) {
  const int64_t ng = (nch + 3) / 4;
  for (int64_t i = 0; i < ng; ++i) std::memset((void*)(g + i * T), 0, sizeof(QGroup));
  for (int64_t c = 0; c < nch; ++c) {
    QGroup& q = g[c / 4 * T];
    const int b = (int)(c % 4);
    for (int j = 0; j < 16; ++j) {
      q.lo[16 * b + j] = xa[c].qs[j];
      q.hi[16 * b + j] = xa[c].qs[16 + j];
    }
    for (int l = 0; l < 4; ++l) {  // lane l: qs[4 l ..] (lo) and qs[16 + 4 l ..] (hi)
      q.dx[4 * b + l] = xa[c].d;
      q.minus8[4 * b + l] = -8 * (xa[c].ls[l] + xa[c].ls[4 + l]);
    }
  }
}

struct Q4Group {   // one row's group, decoded
  __m512i lo, hi;  // q as bytes 0..15, in the QGroup order
  __m512 dw;       // per lane: d_w of its block
};

// Decode group g of Q4_0 row w (nch blocks: the last group may be partial).
inline Q4Group q40_group(const uint8_t* w, int64_t g, int64_t nch) {
  alignas(64) static const uint8_t nib_at[64] = {
      2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17,   // block 0: bytes 2..17
      20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35,   // block 1: 20..35
      38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53,   // block 2: 38..53
      56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71};  // block 3: 56..71
  const __m512i d_idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 27, 27,
                                         27, 27, 18, 18, 18, 18, 9, 9, 9, 9, 0, 0, 0, 0);
  const uint8_t* p = w + 72 * g;
  __m512i v0, v1;
  if (4 * g + 4 <= nch) {
    v0 = _mm512_loadu_si512(p);
    v1 = _mm512_maskz_loadu_epi8(0xFF, p + 64);
  } else {  // the last, partial group: only its blocks' bytes are read (the rest decode as 0)
    const int64_t n = 18 * (nch - 4 * g);
    v0 = _mm512_maskz_loadu_epi8(n >= 64 ? ~0ULL : (1ULL << n) - 1, p);
    v1 = _mm512_setzero_si512();
  }
  const __m512i m4 = _mm512_set1_epi8(15);
  const __m512i nib = _mm512_permutex2var_epi8(v0, _mm512_load_si512(nib_at), v1);
  Q4Group q;
  q.lo = _mm512_and_si512(nib, m4);
  q.hi = _mm512_and_si512(_mm512_srli_epi16(nib, 4), m4);
  q.dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(d_idx, v0)));
  return q;
}

// tile's kernel: a step is one group; token t's group g at x.g[g * T + t].
struct Q40Dot {
  struct X {
    const QGroup* g;
    int64_t T, nch;
  };
  using W = Q4Group;
  using Acc = __m512;
  using Sm = NoSum;
  struct A {
    __m512i lo, hi, m8;
    __m512 dx;
  };
  static constexpr Prefetch PF = PF_AFTER;
  static constexpr int64_t STEP = 72;
  static PP_ALWAYS_INLINE int64_t steps(const X& x) { return (x.nch + 3) / 4; }
  static PP_ALWAYS_INLINE int64_t bytes(const X& x) { return 18 * x.nch; }
  static PP_ALWAYS_INLINE void zero(Acc& a, Sm&) { a = _mm512_setzero_ps(); }
  static PP_ALWAYS_INLINE void decode(const uint8_t* w, int64_t g, const X& x, W& o) {
    o = q40_group(w, g, x.nch);
  }
  static PP_ALWAYS_INLINE A act(const X& x, int t, int64_t g) {
    const QGroup& a = x.g[g * x.T + t];
    return {_mm512_load_si512(a.lo), _mm512_load_si512(a.hi), _mm512_load_si512(a.minus8),
            _mm512_load_ps(a.dx)};
  }
  static PP_ALWAYS_INLINE void add(Acc& acc, Sm&, const W& q, const A& a) {
    __m512i s = _mm512_dpbusd_epi32(a.m8, q.lo, a.lo);
    s = _mm512_dpbusd_epi32(s, q.hi, a.hi);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(q.dw, a.dx), acc);
  }
  template <int R>
  static void tail(float*, const uint8_t* const*, const X&, int) {}
  template <int NU>
  static PP_ALWAYS_INLINE float sum(const Acc* a, const Sm*) {
    return _mm512_reduce_add_ps(a[0]);
  }
};

// Prompt batches: tokens in tiles of 32 (their groups stay in L2), rows split over the threads in
// pairs, each weight group decoded once per 8 tokens. Row pairs and 8-token tiles no token needs
// (need, see pp_gemm) are skipped (zeros).
inline int qgemm_q40(const uint8_t* W, int64_t ld, int64_t nrows, const QGroup* xg, int64_t nch,
                     int64_t T, float* out, int64_t ldo, const uint8_t* need, int nt) {
  constexpr int64_t QT = 32;
  const int64_t dist = prefetch_dist(18 * nch) * 2;
  return run_dynamic(nt, (nrows + 1) / 2, 8, [&](int64_t a, int64_t b) -> int {
    a *= 2;
    b = 2 * b < nrows ? 2 * b : nrows;
    for (int64_t t0 = 0; t0 < T; t0 += QT) {
      const int64_t t1 = t0 + QT < T ? t0 + QT : T;
      for (int64_t r = a; r < b; r += 2) {
        const uint8_t* w[2] = {W + r * ld, W + (r + 1) * ld};
        const uint8_t* nx[2] = {nullptr, nullptr};
        if (r + dist + 1 < b) {
          nx[0] = W + (r + dist) * ld;
          nx[1] = nx[0] + ld;
        }
        const uint8_t* none[2] = {nullptr, nullptr};
        float* o = out + r;
        if (r + 2 > b) {  // an odd last row
          for (int64_t t = t0; t < t1; ++t) {
            float* ot = o + t * ldo;
            tile<Q40Dot, 1, 1>(w, none, {xg + t, T, nch}, &ot, ldo);
          }
          continue;
        }
        // no token of the tile t .. t + n - 1 needs these rows: zeros instead
        auto skip = [&](int64_t t, int n) -> bool {
          if (!need || any_needed(need, nrows, r, 2, t, n)) return false;
          for (int64_t u = t; u < t + n; ++u) o[u * ldo] = o[u * ldo + 1] = 0.0f;
          return true;
        };
        token_tiles(TileSizes<8, 4, 1>(), t0, t1, [&](auto NT, int64_t t) {
          constexpr int N = decltype(NT)::value;
          float* const ot[2] = {o + t * ldo, o + t * ldo + 1};
          if (!skip(t, N)) tile<Q40Dot, 2, N>(w, t == t0 ? nx : none, {xg + t, T, nch}, ot, ldo);
        });
      }
    }
    return 0;
  });
}

// The Q4_0 row engine: with quantized activations, its group layout and four-block tiles (two
// rows side by side in GEMV, gate and up as one 2-row tile); otherwise RowsBase's.
template <>
struct Rows<DT_Q4_0> : RowsBase<DT_Q4_0> {
  using Base = RowsBase<DT_Q4_0>;
  using Act = ActBuf<DT_Q4_0>;
  static constexpr bool PACKED = true, PAIRS = true;
  static size_t packed_bytes(int64_t nch, int64_t T) {
    const int64_t ng = (nch + 3) / 4;
    return sizeof(QGroup) * (size_t)(ng * T > 0 ? ng * T : 1);
  }
  static void pack(const QAct* p, int64_t nch, void* g, int64_t t, int64_t T) {
    pack_groups(p, nch, (QGroup*)g + t, T);
  }
  static float dot(const uint8_t* w, const float* x, const Act& xa, int64_t cols,
                   const uint8_t* nx) {
    if (xa.g) {
      float r, *o = &r;
      tile<Q40Dot, 1, 1>(&w, &nx, {(const QGroup*)xa.g, 1, xa.nch}, &o, 0);
      return r;
    }
    return Base::dot(w, x, xa, cols, nx);
  }
  // GEMV's two rows side by side (xa.g set): out[0], out[1].
  static void dot_pair(const uint8_t* const* w, const uint8_t* const* nx, const Act& xa,
                       float* out) {
    float* const o[2] = {out, out + 1};
    tile<Q40Dot, 2, 1>(w, nx, {(const QGroup*)xa.g, 1, xa.nch}, o, 0);
  }
  static void dot_gu(const uint8_t* const* rows, const uint8_t* const* next, const float* x,
                     const Act& xa, int64_t cols, float* g, float* u) {
    if (xa.g) {  // gate and up rows as one 2-row tile: two streams at once
      float* const o[2] = {g, u};
      tile<Q40Dot, 2, 1>(rows, next, {(const QGroup*)xa.g, 1, xa.nch}, o, 0);
      return;
    }
    Base::dot_gu(rows, next, x, xa, cols, g, u);
  }
  static int qgemm(const uint8_t* W, int64_t ld, int64_t nrows, int64_t, const Act& xa, int64_t T,
                   float* out, int64_t ldo, const uint8_t* need, int nt) {
    return qgemm_q40(W, ld, nrows, (const QGroup*)xa.g, xa.nch, T, out, ldo, need, nt);
  }
};
#endif

}  // namespace
