#pragma once
// The kernels over (gathered) rows, written once for every dtype: GEMV, gate/up GLU, row sums
// (axpy), GEMM and dequantization. They read rows through the dtype's row engine Rows<DT>:
// RowsBase below for every type (a specialization may give an ISA a kernel of its own).

#include "vec.h"

namespace {

template <int DT>
struct Rows;

// AVX-512 VNNI prompt batches of the 32-element block types (wide_avx512.h; PP_WIDE builds).
template <int DT>
int qgemm_wide(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const QAct* xa,
               int64_t T, float* out, int64_t ldo, int nt);

// Quantized activations for the kernels (act != 0 and a quantized DT): T vectors x + t * ldx,
// as QAct chunks (p), plus the row engine's own layout of them (g) where it has one (PACKED).
template <int DT>
struct ActBuf {
  QAct* p = nullptr;
  void* g = nullptr;
  int64_t nch = 0;
  ActBuf(int act, const float* x, int64_t ldx, int64_t T, int64_t cols, int nthreads = 1) {
    using E = Rows<DT>;
    if (!act || act_kind<DT>() == ACT_F32) return;
    nch = cols / 32;
    p = (QAct*)std::malloc(sizeof(QAct) * (size_t)(nch * T > 0 ? nch * T : 1));
    if (!p) return;
    if constexpr (E::PACKED) {
      g = std::aligned_alloc(64, E::packed_bytes(nch, T));
      if (!g) {
        std::free(p);
        p = nullptr;
        return;
      }
    }
    const int nt = T >= 16 ? nthreads : 1;  // a prompt's tokens are rounded in parallel
    run_partitioned(nt, T, [&](int64_t a, int64_t b) -> int {
      for (int64_t t = a; t < b; ++t) {
        quantize_act(act_kind<DT>(), x + t * ldx, cols, p + t * nch);
        if constexpr (E::PACKED) E::pack(p + t * nch, nch, g, t, T);
      }
      return 0;
    });
  }
  ~ActBuf() {
    std::free(p);
    std::free(g);
  }
  bool failed(int act) const { return act && act_kind<DT>() != ACT_F32 && !p; }
};

// The row engine of every dtype: one row at a time in GEMV, tiles of up to 8 tokens in GEMM.
template <int DT>
struct RowsBase {
  static constexpr bool PACKED = false;  // no layout of its own for the activations
  static size_t packed_bytes(int64_t, int64_t) { return 0; }
  static void pack(const QAct*, int64_t, void*, int64_t, int64_t) {}

  // dot(row w, x), with the quantized activations of xa when it has them (else f32 x);
  // prefetches row nx (may be null).
  static float dot(const uint8_t* w, const float* x, const ActBuf<DT>& xa, int64_t cols,
                   const uint8_t* nx) {
    float r, *o = &r;
    if constexpr (act_kind<DT>() != ACT_F32)
      if (xa.p) {
        tile<QDot<DT>, 1, 1, QDOT_U<DT>>(&w, &nx, {xa.p, cols / 32}, &o, 0);
        return r;
      }
    tile<FDot<DT>, 1, 1, 2>(&w, &nx, {x, 0, cols}, &o, 0);
    return r;
  }

  // *g, *u = dot(rows[0], x), dot(rows[1], x) for a gate and an up row (same dtype and cols);
  // prefetches next[0], next[1].
  static void dot_gu(const uint8_t* const* rows, const uint8_t* const* next, const float* x,
                     const ActBuf<DT>& xa, int64_t cols, float* g, float* u) {
    if (xa.p) {
      *g = dot(rows[0], x, xa, cols, next[0]);
      *u = dot(rows[1], x, xa, cols, next[1]);
    } else {  // two dots sharing x
      float* const o[2] = {g, u};
      tile<FDot<DT>, 2, 1>(rows, next, {x, 0, cols}, o, 0);
    }
  }

  // Quantized-activation GEMM: tokens in tiles of QT (their int8 rows stay in cache), rows handed
  // to the threads in chunks (run_dynamic), each weight chunk decoded once per tile of up to 8
  // tokens.
  static int qgemm(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols,
                   const ActBuf<DT>& xa, int64_t T, float* out, int64_t ldo, const uint8_t*,
                   int nt) {
    constexpr int64_t QT = 32;
    const int64_t nch = cols / 32, dist = prefetch_dist(row_bytes<DT>(cols));
    if constexpr (PP_WIDE && UDec<DT>::QK == 32)
      if (T >= 8 && nch % 2 == 0) return qgemm_wide<DT>(W, ld, nrows, cols, xa.p, T, out, ldo, nt);
    return run_dynamic(nt, nrows, 16, [&](int64_t a, int64_t b) -> int {
      for (int64_t t0 = 0; t0 < T; t0 += QT) {
        const int64_t t1 = t0 + QT < T ? t0 + QT : T;
        int64_t r = a;
        // two rows side by side for the block types (vector accumulators; the K-quants' scalar
        // chunk sums keep the one-row tile, whose code generation sets their bits)
        if constexpr (UDec<DT>::QK == 32) {
          for (; r + 2 <= b; r += 2) {
            const uint8_t* w[2] = {W + r * ld, W + (r + 1) * ld};
            const uint8_t* nx[2] = {r + 1 + dist < b ? W + (r + dist) * ld : nullptr,
                                    r + 1 + dist < b ? W + (r + 1 + dist) * ld : nullptr};
            token_tiles(TileSizes<4, 3, 2, 1>(), t0, t1, [&](auto NT, int64_t t) {
              const uint8_t* const none[2] = {nullptr, nullptr};
              float* o[2] = {out + t * ldo + r, out + t * ldo + r + 1};
              tile<QDot<DT>, 2, decltype(NT)::value>(w, t == t0 ? nx : none,
                                                     {xa.p + t * nch, nch}, o, ldo);
            });
          }
        }
        for (; r < b; ++r) {
          const uint8_t* w = W + r * ld;
          const uint8_t* nx = r + dist < b ? W + (r + dist) * ld : nullptr;
          token_tiles(TileSizes<8, 6, 4, 3, 2, 1>(), t0, t1, [&](auto NT, int64_t t) {
            const uint8_t* p = t == t0 ? nx : nullptr;
            float* o = out + t * ldo + r;
            tile<QDot<DT>, 1, decltype(NT)::value>(&w, &p, {xa.p + t * nch, nch}, &o, ldo);
          });
        }
      }
      return 0;
    });
  }
};

template <int DT>
struct Rows : RowsBase<DT> {};

// ---- kernels ----------------------------------------------------------------------------------

// The GEMV's loop over list positions [0, k): row(j) is position j's weight row (null: an index
// out of range, whose result is NaN), dst(j) where its result goes. Rows go to the threads in
// chunks as each finishes its last (on a shared host one thread may run slower), two side by
// side where the kernels have a pair form; each row prefetches the one dist positions ahead.
template <int DT, class RowF, class DstF>
int gemv_rows(int nt, int64_t k, int64_t dist, const float* x, const ActBuf<DT>& xa, int64_t cols,
              RowF row_of, DstF dst) {
  using E = Rows<DT>;
  // the pair form of the 32-element block types with quantized activations: two FMA chains side
  // by side, each row's own order
  constexpr bool PAIRED = DT >= DT_Q8_0 && DT <= DT_Q5_1;
  const bool paired = PAIRED && xa.p != nullptr;
  return run_dynamic(nt, k, 2, [&](int64_t a, int64_t b) -> int {
    int err = 0;
    auto row = [&](int64_t j) -> const uint8_t* { return j < b ? row_of(j) : nullptr; };
    for (int64_t j = a; j < b; ++j) {
      const uint8_t* w[2] = {row(j), paired ? row(j + 1) : nullptr};
      if (w[0] && w[1]) {
        const uint8_t* nx[2] = {row(j + dist), row(j + 1 + dist)};
        float* o[2] = {dst(j), dst(j + 1)};
        if constexpr (PAIRED) {
          tile<QDot<DT>, 2, 1>(w, nx, {xa.p, cols / 32}, o, 0);
          ++j;
          continue;
        }
      }
      if (!w[0]) {
        *dst(j) = NAN;
        err = 1;
        continue;
      }
      *dst(j) = E::dot(w[0], x, xa, cols, row(j + dist));
    }
    return err;
  });
}

template <int DT>
int gemv_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
              const int64_t* idx, int64_t k, float* out, int act, int nthreads) {
  const int64_t rb = row_bytes<DT>(cols);
  ActBuf<DT> xa(act, x, cols, 1, cols);
  if (xa.failed(act)) return PP_ERR_ARG;
  auto row = [&](int64_t j) -> const uint8_t* {
    const int64_t r = row_at(idx, j, nrows);
    return r >= 0 ? W + r * ld : nullptr;
  };
  return gemv_rows<DT>(team_size(nthreads, k * rb), k, prefetch_dist(rb), x, xa, cols, row,
                       [&](int64_t j) { return out + j; });
}

// out[i] = W_i x for nm (at most 4) matrices of one type and width, as one GEMV over their
// concatenated rows: x is rounded once and one thread team splits all the rows (attention's
// q, k and v; k and v alone are too small to pay for a team of their own).
template <int DT>
int gemv_multi_impl(const uint8_t* const* W, const int64_t* ld, const int64_t* nrows, int nm,
                    int64_t cols, const float* x, float* const* out, int act, int nthreads) {
  int64_t start[5] = {0, 0, 0, 0, 0};
  for (int i = 0; i < nm; ++i) start[i + 1] = start[i] + nrows[i];
  const int64_t rb = row_bytes<DT>(cols);
  ActBuf<DT> xa(act, x, cols, 1, cols);
  if (xa.failed(act)) return PP_ERR_ARG;
  auto which = [&](int64_t j) {  // the matrix of concatenated row j
    int i = 0;
    while (i + 1 < nm && j >= start[i + 1]) ++i;
    return i;
  };
  auto row = [&](int64_t j) -> const uint8_t* {
    const int i = which(j);
    return W[i] + (j - start[i]) * ld[i];
  };
  auto dst = [&](int64_t j) {
    const int i = which(j);
    return out[i] + (j - start[i]);
  };
  return gemv_rows<DT>(team_size(nthreads, start[nm] * rb), start[nm], prefetch_dist(rb), x, xa,
                       cols, row, dst);
}

// gt: the GELU table of GEGLU under llama.cpp's numerics (gelu_lut; null: the tanh form).
PP_ALWAYS_INLINE float activate(int variant, float g, float u, const uint16_t* gt) {
  switch (variant) {
    case V_REGLU:
      return (g > 0.0f ? g : 0.0f) * u;
    case V_DRELU:
      return (g > 0.0f ? g : 0.0f) * (u > 0.0f ? u : 0.0f);
    case V_GEGLU:
      return geglu(g, u, gt);
    default:  // V_SWIGLU
      return ggml_silu(g) * u;
  }
}

template <int DT>
int glu_impl(const uint8_t* G, int64_t ldg, const uint8_t* U, int64_t ldu, int64_t nrows,
             int64_t cols, const float* x, const int64_t* idx, int64_t k, int variant, float* out,
             int act, int nthreads) {
  const int64_t rb = row_bytes<DT>(cols), dist = prefetch_dist(rb);
  const int nt = team_size(nthreads, k * rb * 2);
  ActBuf<DT> xa(act, x, cols, 1, cols);
  if (xa.failed(act)) return PP_ERR_ARG;
  const uint16_t* gt = variant == V_GEGLU ? gelu_lut(act) : nullptr;
  return run_partitioned(nt, k, [&](int64_t a, int64_t b) -> int {
    int err = 0;
    for (int64_t j = a; j < b; ++j) {
      const int64_t r = row_at(idx, j, nrows);
      if (r < 0) {
        out[j] = NAN;
        err = 1;
        continue;
      }
      const int64_t rn = j + dist < b ? row_at(idx, j + dist, nrows) : -1;
      const uint8_t* rows[2] = {G + r * ldg, U + r * ldu};
      const uint8_t* next[2] = {rn >= 0 ? G + rn * ldg : nullptr, rn >= 0 ? U + rn * ldu : nullptr};
      float g, u;
      Rows<DT>::dot_gu(rows, next, x, xa, cols, &g, &u);
      out[j] = activate(variant, g, u, gt);
    }
    return err;
  });
}

// acc += sum_{j in [a, b), h[j] != 0} h[j] * W[idx[j]]: the nonzero rows four at a time (the
// last 0-3 alone), prefetching the rows `dist` (at least 4) positions ahead. With tau, a row r
// also needs |h[j]| >= tau[r] (the cut); *kept (if given) receives the number of rows added.
// The rows a row sum adds, in list order: row W[idx[j]] scaled by h[j] for each j in [0, k)
// whose h[j] is nonzero (and, with a cut tau, |h[j]| >= tau[row]). Built once per call, before
// the threads split the columns, so every thread adds the same rows in the same order.
struct AxpyList {
  const uint8_t** rows = nullptr;
  float* hs = nullptr;
  int64_t n = 0;
  int err = 0;  // a row id out of range (its entry is skipped)

  AxpyList(const uint8_t* W, int64_t ld, int64_t nrows, const float* h, const int64_t* idx,
           int64_t k, const float* tau) {
    const int64_t m = k > 0 ? k : 1;
    rows = (const uint8_t**)std::malloc(sizeof(void*) * m);
    hs = (float*)std::malloc(sizeof(float) * m);
    if (!rows || !hs) {
      err = PP_ERR_ARG;
      return;
    }
    for (int64_t j = 0; j < k; ++j) {
      if (h[j] == 0.0f) continue;
      const int64_t r = row_at(idx, j, nrows);
      if (r < 0) {
        err = 1;
        continue;
      }
      if (tau && !(std::fabs(h[j]) >= tau[r])) continue;  // as torch: NaN is cut
      rows[n] = W + r * ld;
      hs[n++] = h[j];
    }
  }
  ~AxpyList() {
    std::free(rows);
    std::free(hs);
  }
  bool failed() const { return err == PP_ERR_ARG; }
};

// acc[32 b0 .. 32 b1) += sum_i hs[i] * rows[i] over the list, in list order, four rows at a
// time; `tail` adds the columns past the last whole block too. Each element's sum is the same
// whatever range of blocks the call covers, so a column split leaves the bits as they are.
template <int DT>
void axpy_blocks(const AxpyList& L, int64_t cols, int64_t b0, int64_t b1, bool tail,
                 int64_t dist, float* acc) {
  const int64_t n = L.n;
  if (dist < 4) dist = 4;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint8_t* nx[4];
    for (int u = 0; u < 4; ++u) nx[u] = i + dist + u < n ? L.rows[i + dist + u] : nullptr;
    axpy_rows<DT, 4>(L.rows + i, L.hs + i, acc, cols, b0, b1, tail, nx);
  }
  for (; i < n; ++i) {
    const uint8_t* nx = i + dist < n ? L.rows[i + dist] : nullptr;
    axpy_rows<DT, 1>(L.rows + i, L.hs + i, acc, cols, b0, b1, tail, &nx);
  }
}

// Threads of a row sum over `cols` columns: each takes whole 32-element blocks, at least
// AXPY_MIN_BLOCKS of them, and MIN_BYTES_PER_THREAD of rows in all.
constexpr int64_t AXPY_MIN_BLOCKS = 4;

template <int DT>
int axpy_team(int nthreads, int64_t n, int64_t cols) {
  const int64_t nb = cols / 32;
  int nt = team_size(nthreads, n * row_bytes<DT>(cols));
  if (nt > nb / AXPY_MIN_BLOCKS) nt = (int)(nb / AXPY_MIN_BLOCKS > 1 ? nb / AXPY_MIN_BLOCKS : 1);
  return nt;
}

// out (+)= sum_{j: h[j] != 0} h[j] * W[idx[j]] (idx null: row j). The threads split the
// columns, not the rows: each adds every listed row's slice in list order, so the result has
// the bits of the one-thread sum at any thread count. tau/kept: the cut, and the rows added.
template <int DT>
int axpy_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* h,
              const int64_t* idx, int64_t k, float* out, int accumulate, int nthreads,
              const float* tau = nullptr, int64_t* kept = nullptr) {
  const int64_t rb = row_bytes<DT>(cols), dist = prefetch_dist(rb), nb = cols / 32;
  if (!accumulate) std::memset(out, 0, sizeof(float) * cols);
  const AxpyList L(W, ld, nrows, h, idx, k, tau);
  if (L.failed()) return PP_ERR_ARG;
  if (kept) *kept = L.n;
  const int nt = axpy_team<DT>(nthreads, L.n, cols);
  run_partitioned(nt, nb, [&](int64_t b0, int64_t b1) -> int {
    axpy_blocks<DT>(L, cols, b0, b1, b1 == nb, dist, out);
    return 0;
  });
  return L.err;
}

// A batch's row sums, tiled: NT tokens x CB 32-element blocks of columns, NT * CB * NV
// accumulators in registers, over every row in order. Each chunk of a row is loaded once for the
// tile's tokens; a row that no token of the tile needs (all h == 0) is not read, and a token
// whose h is 0 adds 0 * chunk, which leaves its sum as it is (finite weights). So each token's
// row has the bits of its own one-token row sum (axpy_impl), whatever the batch.
template <int DT, int NT, int CB>
void rows_gemm_tile(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* h,
                    int64_t t0, int64_t b, float* out) {
  using RS = RowSum<DT>;
  vf acc[NT][CB][NV];
  for (int t = 0; t < NT; ++t)
    for (int cb = 0; cb < CB; ++cb)
      for (int u = 0; u < NV; ++u) acc[t][cb][u] = v_zero();
  const float* ht[NT];
  for (int t = 0; t < NT; ++t) ht[t] = h + (t0 + t) * nrows;
  const int64_t span = CB * Dec<DT>::BB, off = b * Dec<DT>::BB;
  for (int64_t j = 0; j < nrows; ++j) {
    bool any = false;
    for (int t = 0; t < NT; ++t) any |= ht[t][j] != 0.0f;
    if (!any) continue;
    const uint8_t* w = W + j * ld;
    if (j + 8 < nrows)
      for (int64_t p = 0; p < span; p += 64) prefetch_l2(w + 8 * ld + off + p);
    typename RS::C c[CB];
    for (int cb = 0; cb < CB; ++cb) RS::load(w, b + cb, c[cb]);
    for (int t = 0; t < NT; ++t) {
      const typename RS::S s = RS::scale(ht[t][j]);
      for (int cb = 0; cb < CB; ++cb) RS::madd(c[cb], s, acc[t][cb]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int cb = 0; cb < CB; ++cb)
      for (int u = 0; u < NV; ++u)
        v_store(out + (t0 + t) * cols + (b + cb) * 32 + u * VL, acc[t][cb][u]);
}

// Tiles of rows_gemm: tokens (the largest that fits first) and blocks per tile (registers: 16
// accumulators of the 32 AVX-512 ones, 8 of the 16 AVX2 ones).
using RowsGemmTokens = std::conditional_t<VL == 16, TileSizes<4, 3, 2, 1>,
                                          std::conditional_t<VL == 8, TileSizes<2, 1>, TileSizes<1>>>;
constexpr int ROWS_GEMM_CB = VL == 16 ? 2 : 1;

// out[t] = sum_{j: h[t][j] != 0} h[t][j] * W[j] for T tokens (h: T x nrows, out: T x cols): a
// prompt's down pass over a neuron-major matrix. The threads take groups of columns, each group
// every token, so each token's row has the bits of the one-token row sum at any thread count and
// in any batch. Columns past the last whole block (float types) are each token's row-sum tail.
template <int DT>
int rows_gemm_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* h,
                   int64_t T, float* out, int nthreads) {
  const int64_t nb = cols / 32, rb = row_bytes<DT>(cols);
  constexpr int CB = ROWS_GEMM_CB;
  const int64_t groups = (nb + CB - 1) / CB;
  const int nt = team_size(nthreads, (T + 3) / 4 * nrows * rb);  // W read once per 4 tokens
  int err = run_dynamic(nt, groups, 1, [&](int64_t g0, int64_t g1) -> int {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * CB;
      token_tiles(RowsGemmTokens(), 0, T, [&](auto NT, int64_t t0) {
        if (b + CB <= nb)
          rows_gemm_tile<DT, decltype(NT)::value, CB>(W, ld, nrows, cols, h, t0, b, out);
        else
          rows_gemm_tile<DT, decltype(NT)::value, 1>(W, ld, nrows, cols, h, t0, b, out);
      });
    }
    return 0;
  });
  if (cols % 32)
    for (int64_t t = 0; t < T && !err; ++t) {
      float* o = out + t * cols;
      for (int64_t c = nb * 32; c < cols; ++c) o[c] = 0.0f;
      const AxpyList L(W, ld, nrows, h + t * nrows, nullptr, nrows, nullptr);
      if (L.failed()) return PP_ERR_ARG;
      axpy_blocks<DT>(L, cols, nb, nb, true, prefetch_dist(rb), o);
    }
  return err;
}

// Whether any of tokens t0..t0+n-1 needs any of rows r0..r0+nr-1: need is (T, nrows) bytes,
// laid out like the output, nonzero where the caller uses it.
inline bool any_needed(const uint8_t* need, int64_t nrows, int64_t r0, int nr, int64_t t0, int n) {
  for (int t = 0; t < n; ++t)
    for (int r = 0; r < nr; ++r)
      if (need[(t0 + t) * nrows + r0 + r]) return true;
  return false;
}

template <int DT>
int gemm_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
              int64_t ldx, int64_t T, float* out, int64_t ldo, const uint8_t* need, int act,
              int nthreads) {
  // f32 activations: tiles of up to G tokens (the register budget)
  using Tiles = std::conditional_t<VL == 16, TileSizes<4, 3, 2, 1>, TileSizes<2, 1>>;
  if (T == 1) return gemv_impl<DT>(W, ld, nrows, cols, x, nullptr, nrows, out, act, nthreads);
  const int64_t rb = row_bytes<DT>(cols), dist = prefetch_dist(rb);
  const int nt = team_size(nthreads, nrows * (rb + T * 64));
  if constexpr (act_kind<DT>() != ACT_F32)
    if (act) {
      ActBuf<DT> xa(1, x, ldx, T, cols, nt);
      if (!xa.p) return PP_ERR_ARG;
      return Rows<DT>::qgemm(W, ld, nrows, cols, xa, T, out, ldo, need, nt);
    }
  return run_dynamic(nt, nrows, 16, [&](int64_t a, int64_t b) -> int {
    for (int64_t r = a; r < b; ++r) {
      const uint8_t* w = W + r * ld;
      const uint8_t* nx = r + dist < b ? W + (r + dist) * ld : nullptr;
      token_tiles(Tiles(), 0, T, [&](auto NT, int64_t t0) {
        const uint8_t* p = t0 == 0 ? nx : nullptr;
        float* o = out + t0 * ldo + r;
        tile<FDot<DT>, 1, decltype(NT)::value>(&w, &p, {x + t0 * ldx, ldx, cols}, &o, ldo);
      });
    }
    return 0;
  });
}

template <int DT>
int dequant_impl(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const int64_t* idx,
                 int64_t k, float* out, int nthreads) {
  const int nt = team_size(nthreads, k * (row_bytes<DT>(cols) + 4 * cols));
  return run_partitioned(nt, k, [&](int64_t a, int64_t b) -> int {
    int err = 0;
    for (int64_t j = a; j < b; ++j) {
      const int64_t r = row_at(idx, j, nrows);
      if (r < 0) {
        for (int64_t i = 0; i < cols; ++i) out[j * cols + i] = NAN;
        err = 1;
        continue;
      }
      row_decode<DT>(W + r * ld, out + j * cols, cols);
    }
    return err;
  });
}

inline bool valid_shape(int dtype, int64_t cols) {
  if (cols < 0) return false;
  if (dtype >= DT_Q4_K && dtype <= DT_Q6_K) return cols % 256 == 0;
  if (dtype >= DT_Q8_0 && dtype <= DT_Q5_1) return cols % 32 == 0;
  return dtype >= DT_F32 && dtype <= DT_BF16;
}

}  // namespace

// The ISA's own kernels for this engine: qgemm_wide (declared above) and the Rows and RowSum
// specializations. Included here so that every file that sees the templates above sees them too
// (a file without them would instantiate the portable kernels instead).
#include "wide_avx512.h"     // AVX-512 VNNI prompt tiles
#include "q4_0_avx512.h"     // Q4_0's AVX-512 row sums
#include "k_quants_avx2.h"   // Q4_K, Q5_K and Q6_K dots in ggml's order
