#pragma once
// The row kernels, written once: tile<K, R, NT, U> (R rows x NT tokens, tinyBLAS's gemm<RM, RN>)
// is the one loop over a row's chunks for every dot product, with the kernel K saying how a chunk
// is decoded, how a token's activations are read and how they meet: FDot (f32 activations), QDot
// (quantized activations: ggml's 8-lane block order, or K-quant chunk sums), and the AVX-512 ones
// (WideDot in wide_avx512.h). axpy_rows is the one loop of the row sums.
// token_tiles cuts a run of tokens into the tiles' sizes.

#include "quants.h"

namespace {

enum Prefetch { PF_BEFORE, PF_AFTER, PF_NONE };  // when a step prefetches the upcoming rows
struct NoSum {};  // a kernel without scalar sums beside its accumulators

// The tile's compile-time loops over its rows r and unrolled chunks u: folds over index
// sequences, so each row and chunk has its own variables from the start, as in hand-written code
// (no loop for the compiler to vectorize across rows, no closure to keep arrays in memory).
template <int N>
using Seq = std::make_integer_sequence<int, N>;

// wv[r][u] = chunk c + u of row w[r], rows first.
template <class K, int R, int U, int... I>
PP_ALWAYS_INLINE void decode_rows(const uint8_t* const* w, int64_t c, const typename K::X x,
                                  typename K::W (&wv)[R][U], std::integer_sequence<int, I...>) {
  (K::decode(w[I / U], c + I % U, x, wv[I / U][I % U]), ...);
}

// acc[r][t][u], sm[r][t][u] += row r's chunk (wv[r][uw]) . token t's chunk a, for every row r.
template <class K, int u, int uw, class Acc, class Sm, class W, int... r>
PP_ALWAYS_INLINE void add_rows(Acc& acc, Sm& sm, const W& wv, typename K::A a, int t,
                               std::integer_sequence<int, r...>) {
  (K::add(acc[r][t][u], sm[r][t][u], wv[r][uw], a), ...);
}

// The same for token t and the U chunks of a step c (chunk c + u into the accumulators u).
template <class K, int R, int U, class Acc, class Sm, class W, int... u>
PP_ALWAYS_INLINE void add_step(Acc& acc, Sm& sm, const W& wv, const typename K::X x, int t,
                               int64_t c, std::integer_sequence<int, u...>) {
  (add_rows<K, u, u>(acc, sm, wv, K::act(x, t, c + u), t, Seq<R>()), ...);
}

template <class K, int U, class Acc, class Sm, int... I>
PP_ALWAYS_INLINE void zero_all(Acc& acc, Sm& sm, int t, std::integer_sequence<int, I...>) {
  (K::zero(acc[I / U][t][I % U], sm[I / U][t][I % U]), ...);
}

// out[r][t * ldo] = row r's result for token t: its accumulators summed, then K's tail.
template <class K, int U, class Acc, class Sm, int... r>
PP_ALWAYS_INLINE void finish(Acc& acc, Sm& sm, int t, const uint8_t* const* w,
                             const typename K::X x, float* const* out, int64_t ldo,
                             std::integer_sequence<int, r...>) {
  float res[sizeof...(r)] = {K::template sum<U>(acc[r][t], sm[r][t])...};
  K::template tail<sizeof...(r)>(res, w, x, t);
  ((out[r][t * ldo] = res[r]), ...);
}

// out[r][t * ldo] = dot(row w[r], activations t) for R rows and NT tokens: the rows are read side
// by side, U chunks per step (U = 2: two sets of accumulators, a last odd chunk in the first);
// each chunk is decoded once for the NT tokens and each token's chunk read once for the R rows;
// the rows nx[r] (null: none) are prefetched in step. K::Acc are the vector accumulators, K::Sm
// scalar sums beside them (Q8_1's m s; NoSum: none). Rows and chunks are expanded at compile time
// and tokens are a loop, as in the hand-written kernels this replaces: GCC then makes the same
// unrolling, vectorization and FMA-contraction choices, and those set the bits of the scalar sums
// (tools/kernel_diff.sh compares two builds).
template <class K, int R, int NT, int U = 1>
inline void tile(const uint8_t* const* w, const uint8_t* const* nx, const typename K::X x,
                 float* const* out, int64_t ldo) {
  static_assert(U == 1 || U == 2, "one or two chunks per step");
  const int64_t n = K::steps(x);
  typename K::Acc acc[R][NT][U];
  typename K::Sm sm[R][NT][U];
  for (int t = 0; t < NT; ++t) zero_all<K, U>(acc, sm, t, Seq<R * U>());
  int64_t pf = 0, c = 0;
  for (; c + U <= n; c += U) {
    if constexpr (K::PF == PF_BEFORE) prefetch_rows<R>(nx, pf, (c + U) * K::STEP);
    typename K::W wv[R][U];
    decode_rows<K>(w, c, x, wv, Seq<R * U>());
    if constexpr (K::PF == PF_AFTER) prefetch_rows<R>(nx, pf, (c + U) * K::STEP);
    for (int t = 0; t < NT; ++t) add_step<K, R, U>(acc, sm, wv, x, t, c, Seq<U>());
  }
  if constexpr (U == 2)
    if (c < n) {
      typename K::W wv[R][1];
      decode_rows<K>(w, c, x, wv, Seq<R>());
      for (int t = 0; t < NT; ++t) add_rows<K, 0, 0>(acc, sm, wv, K::act(x, t, c), t, Seq<R>());
    }
  if constexpr (K::PF != PF_NONE) prefetch_rows<R>(nx, pf, K::bytes(x));
  for (int t = 0; t < NT; ++t) finish<K, U>(acc, sm, t, w, x, out, ldo, Seq<R>());
}

// The tile sizes of a run of tokens, largest first (the last one 1).
template <int... N>
struct TileSizes {};

template <int N, int... M, class F>
inline int64_t tile_at(int64_t n, int64_t t, F& f) {
  if constexpr (sizeof...(M) == 0) {
    static_assert(N == 1, "the last tile size is 1");
    f(std::integral_constant<int, N>(), t);
    return N;
  } else {
    if (n >= N) {
      f(std::integral_constant<int, N>(), t);
      return N;
    }
    return tile_at<M...>(n, t, f);
  }
}

// f(NT, t) over the tokens [t0, t1) in tiles of the largest size NT that still fits.
template <int... N, class F>
inline void token_tiles(TileSizes<N...>, int64_t t0, int64_t t1, F f) {
  for (int64_t t = t0; t < t1;) t += tile_at<N...>(t1 - t, t, f);
}

// ---- FDot: float-decoded weights . f32 activations ---------------------------------------------

template <int DT>
struct FDot {
  using D = Dec<DT>;
  struct X {  // NT vectors x + t * ldx of cols elements
    const float* x;
    int64_t ldx, cols;
  };
  struct W {
    vf v[NV];
  };
  struct Acc {
    vf v[NV];
  };
  using Sm = NoSum;
  using A = const float*;
  static constexpr Prefetch PF = PF_BEFORE;
  static constexpr int64_t STEP = D::BB;
  static PP_ALWAYS_INLINE int64_t steps(const X& x) { return x.cols / 32; }
  static PP_ALWAYS_INLINE int64_t bytes(const X& x) { return row_bytes<DT>(x.cols); }
  static PP_ALWAYS_INLINE void zero(Acc& a, Sm&) {
    for (int u = 0; u < NV; ++u) a.v[u] = v_zero();
  }
  static PP_ALWAYS_INLINE void decode(const uint8_t* w, int64_t c, const X&, W& o) {
    D::chunk(w, c, o.v);
  }
  static PP_ALWAYS_INLINE A act(const X& x, int t, int64_t c) { return x.x + t * x.ldx + c * 32; }
  static PP_ALWAYS_INLINE void add(Acc& a, Sm&, const W& w, A xb) {
    for (int u = 0; u < NV; ++u) a.v[u] = v_fma(w.v[u], v_load(xb + u * VL), a.v[u]);
  }
  // The U * NV vectors summed in order.
  template <int U>
  static PP_ALWAYS_INLINE float sum(const Acc* a, const Sm*) {
    vf s = a[0].v[0];
    for (int i = 1; i < U * NV; ++i) s = v_add(s, a[i / NV].v[i % NV]);
    return v_sum(s);
  }
  // Then the elements past the last whole chunk, the R rows in one loop.
  template <int R>
  static void tail(float* res, const uint8_t* const* w, const X& x, int t) {
    const float* xt = x.x + t * x.ldx;
    for (int64_t i = x.cols / 32 * 32; i < x.cols; ++i) tail_step(res, w, xt, i, Seq<R>());
  }
  template <int... r>
  static PP_ALWAYS_INLINE void tail_step(float* res, const uint8_t* const* w, const float* xt,
                                         int64_t i, std::integer_sequence<int, r...>) {
    // one FMA per element, spelled out: GCC's choice to contract would follow its inlining
    ((res[r] = std::fma(D::one(w[r], i), xt[i], res[r])), ...);
  }
};

// ---- QDot: byte-decoded weights . quantized activations -----------------------------------------

// 32-element block types: ggml's eight 4-product lanes (lanes8) plus, for Q8_1, the sum of m s.
template <int DT>
struct QBlocks {
  using U = UDec<DT>;
  struct X {  // NT vectors of nch chunks, xa + t * nch
    const QAct* p;
    int64_t nch;
  };
  struct W {
    U8x32 q;
    Affine f;
    Prep pw;
    F8 dw;  // f.a0 broadcast
  };
  using Acc = F8;
  using Sm = float;  // Q8_1: the sum of m s
  using A = const QAct&;
  static constexpr Prefetch PF = PF_BEFORE;
  static constexpr int64_t STEP = Dec<DT>::BB;
  static PP_ALWAYS_INLINE int64_t steps(const X& x) { return x.nch; }
  static PP_ALWAYS_INLINE int64_t bytes(const X& x) { return row_bytes<DT>(x.nch * 32); }
  static PP_ALWAYS_INLINE void zero(Acc& a, Sm& m) {
    a = f8_zero();
    m = 0.0f;
  }
  static PP_ALWAYS_INLINE void decode(const uint8_t* w, int64_t c, const X&, W& o) {
    U::chunk(w, c, o.q, o.f);
    o.pw = prep8(o.q, U::SIGNED, U::OFF);
    o.dw = f8_set(o.f.a0);
  }
  static PP_ALWAYS_INLINE A act(const X& x, int t, int64_t c) { return x.p[t * x.nch + c]; }
  static PP_ALWAYS_INLINE void add(Acc& acc, Sm& m, const W& w, A a) {
    lanes8(w.pw, a, acc, w.dw);
    if (act_kind<DT>() == ACT_Q8_1) m += w.f.b0 * a.s;
  }
  template <int NU>
  static PP_ALWAYS_INLINE float sum(const Acc* a, const Sm* m) {
    static_assert(NU == 1, "one accumulator: ggml's order");
    return f8_hsum(a[0]) + m[0];
  }
  template <int R>
  static void tail(float*, const uint8_t* const*, const X&, int) {}
};

// K-quants: each chunk's contribution (chunk_qdot) summed in f32.
template <int DT>
struct QChunks : QBlocks<DT> {
  using typename QBlocks<DT>::X;
  struct W {
    U8x32 q;
    Affine f;
  };
  using Acc = float;
  using Sm = NoSum;
  static PP_ALWAYS_INLINE void zero(Acc& a, Sm&) { a = 0.0f; }
  static PP_ALWAYS_INLINE void decode(const uint8_t* w, int64_t c, const X&, W& o) {
    UDec<DT>::chunk(w, c, o.q, o.f);
  }
  static PP_ALWAYS_INLINE void add(Acc& acc, Sm&, const W& w, const QAct& a) {
    acc += chunk_qdot<DT>(w.q, w.f, a);
  }
  template <int NU>
  static PP_ALWAYS_INLINE float sum(const Acc* a, const Sm*) {
    if constexpr (NU == 2) return a[0] + a[1];
    return a[0];
  }
};

template <int DT>
using QDot = std::conditional_t<UDec<DT>::QK == 32, QBlocks<DT>, QChunks<DT>>;

// Chunks per step of a one-token quantized dot: 1 for the block types (ggml's order), 2 (two
// running sums) for the K-quants.
template <int DT>
constexpr int QDOT_U = UDec<DT>::QK == 32 ? 1 : 2;

// ---- row sums: acc += sum_r h[r] * row w[r] ---------------------------------------------------

// How a row sum reads one 32-element chunk b of a row: load it (C), make a row's weight h into
// its scale (S), then acc (NV vectors) += h * chunk. Every row sum goes through it (a token's
// axpy_rows, a batch's rows_gemm), so a row's contribution to an element has the same bits
// however the rows and tokens around it are grouped. q4_0_avx512.h has Q4_0's own.
template <int DT>
struct RowSum {
  struct C {
    vf v[NV];
  };
  using S = vf;
  static PP_ALWAYS_INLINE void load(const uint8_t* w, int64_t b, C& c) { Dec<DT>::chunk(w, b, c.v); }
  static PP_ALWAYS_INLINE S scale(float h) { return v_set1(h); }
  static PP_ALWAYS_INLINE void madd(const C& c, S h, vf* a) {
    for (int u = 0; u < NV; ++u) a[u] = v_fma(c.v[u], h, a[u]);
  }
};

// One 32-element slice of acc plus R rows: the slice is loaded and stored once per R rows (one
// store per row would bound short quantized rows by the store port); row by row into it (each
// row's chunk is used at once: R rows decoded together would not fit the 16 AVX2 registers), so
// each element adds the rows in order.
template <int DT, int R>
struct AxpyBlock {
  using RS = RowSum<DT>;
  typename RS::S s[R];
  explicit AxpyBlock(const float* h) {
    for (int r = 0; r < R; ++r) s[r] = RS::scale(h[r]);
  }
  PP_ALWAYS_INLINE void add(const uint8_t* const* w, int64_t b, float* ab) const {
    vf a[NV];
    for (int u = 0; u < NV; ++u) a[u] = v_load(ab + u * VL);
    for (int r = 0; r < R; ++r) {
      typename RS::C c;
      RS::load(w[r], b, c);
      RS::madd(c, s[r], a);
    }
    for (int u = 0; u < NV; ++u) v_store(ab + u * VL, a[u]);
  }
};

// sum_r h[r] * w[r][c] for a column past the last whole block: the first product, then one FMA
// per row (spelled out, so that no inlining choice of GCC's changes the rounding).
template <int DT, size_t... I>
inline float axpy_tail(const uint8_t* const* w, const float* h, int64_t c,
                       std::index_sequence<I...>) {
  float s = Dec<DT>::one(w[0], c) * h[0];
  ((s = I ? std::fma(Dec<DT>::one(w[I], c), h[I], s) : s), ...);
  return s;
}

// acc += sum_r h[r] * row w[r] for R rows at once, over blocks b0..b1 (32 elements each) and,
// with `tail`, the columns past the last whole block; prefetches the same span of rows nx[r]
// (null: none). Each element adds the rows in order, whatever span the call covers.
template <int DT, int R>
inline void axpy_rows(const uint8_t* const* w, const float* h, float* acc, int64_t cols,
                      int64_t b0, int64_t b1, bool tail, const uint8_t* const* nx) {
  using D = Dec<DT>;
  int64_t pf = b0 * D::BB;  // bytes of the upcoming rows prefetched so far (all alike)
  const AxpyBlock<DT, R> blk(h);
  for (int64_t b = b0; b < b1; ++b) {
    prefetch_rows<R>(nx, pf, (b + 1) * D::BB);
    blk.add(w, b, acc + b * 32);
  }
  if (!tail) return;
  prefetch_rows<R>(nx, pf, row_bytes<DT>(cols));
  for (int64_t c = cols / 32 * 32; c < cols; ++c)
    acc[c] += axpy_tail<DT>(w, h, c, std::make_index_sequence<R>());
}

template <int DT>
inline void row_decode(const uint8_t* w, float* y, int64_t cols) {
  using D = Dec<DT>;
  const int64_t nb = cols / 32;
  for (int64_t b = 0; b < nb; ++b) {
    vf wv[NV];
    D::chunk(w, b, wv);
    for (int u = 0; u < NV; ++u) v_store(y + b * 32 + u * VL, wv[u]);
  }
  for (int64_t i = nb * 32; i < cols; ++i) y[i] = D::one(w, i);
}

}  // namespace
