#pragma once
// Matrices with their rows interleaved 8 at a time: the products over the layouts of q4_k_x8.h
// (DT_Q4_KX8, and DT_Q4_KX8V whose every token takes the GEMV's order), q4_0_x8.h (DT_Q4_0X8)
// and mxfp4_x8.h (DT_MXFP4X8). A layout X describes itself: its row type (ROW), activation type
// (ACT), code, columns per block (QK), a row's bytes per block (RB), a group's bytes per block
// (GB), pack and unpack, and dot<N>(group, N tokens' activations, blocks, out, ldo).

#include "q4_k_x8.h"
#include "q4_0_x8.h"
#include "mxfp4_x8.h"

namespace {

// return f(X()) for an interleaved dtype's layout (PP_ERR_ARG for any other dtype).
template <class F>
inline int x8_layout(int dtype, F f) {
  if (dtype == DT_Q4_KX8 || dtype == DT_Q4_KX8V) return f(X8K4());
  if (dtype == DT_Q4_0X8) return f(X8Q40());
  if (dtype == DT_MXFP4X8) return f(X8MX());
  return PP_ERR_ARG;
}

template <class X>
inline int64_t x8_bytes(int64_t cols) {  // a group's bytes
  return cols / X::QK * X::GB;
}

template <class X>
inline bool x8_shape(int64_t nrows, int64_t cols) {
  return nrows % 8 == 0 && cols % X::QK == 0 && cols > 0;
}

// A layout that multiplies two groups side by side (X::dot2, 16 rows in the lanes of a wider
// register, each row's bits dot's) where its ISA allows: X::PAIRS. A prompt's products take
// them (compute-bound: each group's bytes serve every token of a tile), its drivers handing out
// groups in pairs (x8_grain); one token's GEMV streams the groups one by one (reading two
// streams side by side was slower from memory).
template <class X, class = void>
struct x8_pairs : std::false_type {};
template <class X>
struct x8_pairs<X, std::void_t<decltype(X::PAIRS)>> : std::bool_constant<X::PAIRS> {};
template <class X>
constexpr int64_t x8_grain() {
  return x8_pairs<X>::value ? 2 : 1;
}

// The groups [a, b) of G times T tokens of quantized activations (xa, nch chunks each): 4 tokens
// at a time, the last T % 4 together in the GEMV's order (every token there with gemv: a
// mixture's experts, as llama.cpp's MUL_MAT_ID runs them), in tiles of 32 tokens (their int8 rows
// stay in cache); two groups at a time where the layout pairs them.
template <class X>
inline void x8_groups(const uint8_t* G, int64_t gb, int64_t nb, int64_t a, int64_t b,
                      const QAct* xa, int64_t nch, int64_t T, float* out, int64_t ldo, bool gemv) {
  if constexpr (X8_KERNELS)
    for (int64_t t0 = 0; t0 < T; t0 += 32) {
      const int64_t t1 = t0 + 32 < T ? t0 + 32 : T;
      for (int64_t g = a; g < b; ++g) {
        const bool pair = x8_pairs<X>::value && g + 1 < b && T > 1;
        auto tile = [&](auto NT, int64_t t) {
          constexpr int N = decltype(NT)::value;
          const QAct* ap[N];
          for (int i = 0; i < N; ++i) ap[i] = xa + (t + i) * nch;
          if constexpr (x8_pairs<X>::value)
            if (pair)
              return X::template dot2<N>(G + g * gb, G + (g + 1) * gb, ap, nb,
                                         out + t * ldo + 8 * g, ldo);
          X::template dot<N>(G + g * gb, ap, nb, out + t * ldo + 8 * g, ldo);
        };
        if (gemv)
          token_tiles(TileSizes<3, 2, 1>(), t0, t1, tile);
        else
          token_tiles(TileSizes<4, 3, 2, 1>(), t0, t1, tile);
        g += pair;
      }
    }
}

// out[t * ldo + r] = W[r] . x_t for every row of an interleaved matrix (nrows a multiple of 8)
// and T tokens x + t * ldx; gemv: every token in the GEMV's order. With f32 activations (act 0)
// each group is unpacked to rows and every dot is Rows<X::ROW>'s own, so the bits are the row
// layout's.
template <class X>
inline int x8_gemm(const uint8_t* G, int64_t nrows, int64_t cols, const float* x, int64_t ldx,
                   int64_t T, float* out, int64_t ldo, int act, int nthreads, bool gemv) {
  if (!x8_shape<X>(nrows, cols) || T < 0) return PP_ERR_ARG;
  const int64_t ng = nrows / 8, nb = cols / X::QK, gb = x8_bytes<X>(cols), nch = cols / 32;
  const int nt = T > 1 ? nthreads : team_size(nthreads, nrows * nb * X::RB);
  if (act && X8_KERNELS) {
    ActBuf<X::ACT> xa(act, x, ldx, T, cols, nthreads);
    if (xa.failed(act)) return PP_ERR_ARG;
    return run_dynamic(nt, ng, x8_grain<X>(), [&](int64_t a, int64_t b) -> int {
      x8_groups<X>(G, gb, nb, a, b, xa.p, nch, T, out, ldo, gemv);
      return 0;
    });
  }
  if constexpr (X::ROW == DT_MXFP4) {  // MXFP4's own row products (mxfp4.h)
    return run_partitioned(nt, ng, [&](int64_t a, int64_t b) -> int {
      uint8_t* rows = (uint8_t*)std::malloc((size_t)(8 * nb * X::RB));
      if (!rows) return PP_ERR_ARG;
      int st = 0;
      for (int64_t g = a; g < b && !st; ++g) {
        X::unpack(G + g * gb, nb, rows);
        st = mx_gemm(rows, nb * X::RB, 8, cols, x, ldx, T, nullptr, 8, out + 8 * g, ldo, act, 1);
      }
      std::free(rows);
      return st;
    });
  } else {
    ActBuf<X::ROW> xf(0, x, ldx, T, cols);
    return run_partitioned(nt, ng, [&](int64_t a, int64_t b) -> int {
      uint8_t* rows = (uint8_t*)std::malloc((size_t)(8 * nb * X::RB));
      if (!rows) return PP_ERR_ARG;
      for (int64_t g = a; g < b; ++g) {
        X::unpack(G + g * gb, nb, rows);
        for (int64_t t = 0; t < T; ++t)
          for (int r = 0; r < 8; ++r)
            out[t * ldo + 8 * g + r] =
                Rows<X::ROW>::dot(rows + r * nb * X::RB, x + t * ldx, xf, cols, nullptr);
      }
      std::free(rows);
      return 0;
    });
  }
}

// out[i] = W_i x for nm (at most 4) interleaved matrices of one layout and width, each in the
// GEMV's order, as one GEMV over their groups: x is rounded once and one thread team splits all
// the groups (attention's q, k and v).
template <class X>
inline int x8_gemv_multi(const uint8_t* const* W, const int64_t* nrows, int nm, int64_t cols,
                         const float* x, float* const* out, int act, int nthreads) {
  int64_t start[5] = {0, 0, 0, 0, 0};  // each matrix's first group
  if (nm < 1 || nm > 4) return PP_ERR_ARG;
  for (int i = 0; i < nm; ++i) {
    if (!x8_shape<X>(nrows[i], cols)) return PP_ERR_ARG;
    start[i + 1] = start[i] + nrows[i] / 8;
  }
  if (!act || !X8_KERNELS) {  // f32 activations: the row layout's dots, matrix by matrix
    int st = 0;
    for (int i = 0; i < nm && !st; ++i)
      st = x8_gemm<X>(W[i], nrows[i], cols, x, cols, 1, out[i], nrows[i], act, nthreads, true);
    return st;
  }
  const int64_t nb = cols / X::QK, gb = x8_bytes<X>(cols), nch = cols / 32;
  ActBuf<X::ACT> xa(act, x, cols, 1, cols);
  if (xa.failed(act)) return PP_ERR_ARG;
  const int nt = team_size(nthreads, 8 * start[nm] * nb * X::RB);
  return run_dynamic(nt, start[nm], x8_grain<X>(), [&](int64_t a, int64_t b) -> int {
    for (int i = 0; i < nm; ++i) {  // [a, b) cut at the matrices' bounds
      const int64_t lo = a > start[i] ? a : start[i], hi = b < start[i + 1] ? b : start[i + 1];
      if (lo < hi)
        x8_groups<X>(W[i], gb, nb, lo - start[i], hi - start[i], xa.p, nch, 1, out[i], 0, true);
    }
    return 0;
  });
}

// The routed experts' products of one token in one thread team: for i < k, out[i * n ..] =
// W_i . x_i with W_i the n rows (a multiple of 8) of interleaved stack W starting at ids[i] * n,
// and x_i = x + i * ldx (one x for every expert: ldx 0, rounded once); each in the GEMV's order.
template <class X>
inline int x8_experts(const uint8_t* W, int64_t ld, int64_t n, int64_t cols, const int64_t* ids,
                      int64_t k, const float* x, int64_t ldx, float* out, int act, int nthreads) {
  if (!x8_shape<X>(n, cols) || k < 1 || !act || !X8_KERNELS) return PP_ERR_ARG;
  const int64_t nx = ldx ? k : 1, nb = cols / X::QK, nch = cols / 32, gpe = n / 8;
  ActBuf<X::ACT> xa(act, x, ldx, nx, cols);
  if (xa.failed(act)) return PP_ERR_ARG;
  const int nt = team_size(nthreads, k * n * nb * X::RB);
  return run_partitioned(nt, k * gpe, [&](int64_t a, int64_t b) -> int {
    for (int64_t q = a; q < b; ++q) {
      const int64_t i = q / gpe, g = ids[i] * gpe + q % gpe;
      const QAct* ap = xa.p + (ldx ? i : 0) * nch;
      x8_groups<X>(W + g * ld, 0, nb, 0, 1, ap, nch, 1, out + i * n + 8 * (q % gpe), 0, true);
    }
    return 0;
  });
}

inline int x8_experts(int dtype, const uint8_t* W, int64_t ld, int64_t n, int64_t cols,
                      const int64_t* ids, int64_t k, const float* x, int64_t ldx, float* out,
                      int act, int nthreads) {
  return x8_layout(dtype, [&](auto X) {
    return x8_experts<decltype(X)>(W, ld, n, cols, ids, k, x, ldx, out, act, nthreads);
  });
}

// ---- rows in the file's layout, multiplied in a layout's order (X::gdot) ---------------------
// A sparse step's gathered rows (a few neurons a token) and a sparse prompt's needed rows cannot
// take a copy interleaved at load; gdot builds each block of 8 rows' group in registers and
// multiplies it as dot does, so these products carry the bits of the interleaved matrix's.

// Group g (positions 8 g ..) of a row list (idx, or rows 0..k-1 when null): rows[r] = its row's
// start (positions past k repeat the last row); bad[r]: the index was out of range (row 0 read).
inline void group_rows(const uint8_t* W, int64_t ld, int64_t nrows, const int64_t* idx,
                       int64_t k, int64_t g, const uint8_t** rows, bool* bad) {
  for (int r = 0; r < 8; ++r) {
    const int64_t row = row_at(idx, 8 * g + r < k ? 8 * g + r : k - 1, nrows);
    bad[r] = row < 0;
    rows[r] = W + (row < 0 ? 0 : row) * ld;
  }
}

// out[j] = f(W_0[idx[j]] . x, W_{M-1}[idx[j]] . x) for j < k and M (1 or 2) matrices of
// one width (a row gather, or a GLU's gate and up): 8 rows at a time, the next group's rows
// prefetched meanwhile; an index out of range gives NaN and PP_ERR_INDEX.
template <class X, int M, class F>
inline int x8_rows_gather(const uint8_t* const* W, const int64_t* ld, int64_t nrows, int64_t cols,
                          const float* x, const int64_t* idx, int64_t k, float* out, int act,
                          int nthreads, F f) {
  if (!X8_KERNELS || !act || cols % X::QK || k < 0) return PP_ERR_ARG;
  if (k == 0) return 0;
  const int64_t nb = cols / X::QK, ng = (k + 7) / 8;
  ActBuf<X::ACT> xa(act, x, cols, 1, cols);
  if (xa.failed(act)) return PP_ERR_ARG;
  const QAct* ap = xa.p;
  const int nt = team_size(nthreads, M * k * nb * X::RB);
  return run_dynamic(nt, ng, 1, [&](int64_t a, int64_t b) -> int {
    int err = 0;
    const uint8_t *rows[2][M][8], *none[8] = {};
    bool bad[2][8];
    auto fill = [&](int64_t g) {  // group g's rows into slot g & 1
      for (int m = 0; m < M; ++m)
        group_rows(W[m], ld[m], nrows, idx, k, g, rows[g & 1][m], bad[g & 1]);
    };
    fill(a);
    for (int64_t g = a; g < b; ++g) {
      const int c = g & 1, n = c ^ 1;
      if (g + 1 < b) fill(g + 1);
      float o[M][8];
      for (int m = 0; m < M; ++m)
        if constexpr (X8_KERNELS)
          X::template gdot<1>(rows[c][m], g + 1 < b ? rows[n][m] : none, &ap, nb, o[m], 0);
      for (int r = 0; r < 8 && 8 * g + r < k; ++r) {
        if (bad[c][r]) err = PP_ERR_INDEX;
        out[8 * g + r] = bad[c][r] ? NAN : f(o[0][r], o[M - 1][r]);
      }
    }
    return err;
  });
}

// out[j] = W[idx[j]] . x (idx null: rows 0..k-1).
template <class X>
inline int x8_rows_gemv(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
                        const int64_t* idx, int64_t k, float* out, int act, int nthreads) {
  return x8_rows_gather<X, 1>(&W, &ld, nrows, cols, x, idx, k, out, act, nthreads,
                              [](float v, float) { return v; });
}

// out[j] = act(G[idx[j]] . x, U[idx[j]] . x), a GLU's rows.
template <class X>
inline int x8_rows_glu(const uint8_t* G, int64_t ldg, const uint8_t* U, int64_t ldu,
                       int64_t nrows, int64_t cols, const float* x, const int64_t* idx, int64_t k,
                       int variant, float* out, int act, int nthreads) {
  const uint8_t* W[2] = {G, U};
  const int64_t ld[2] = {ldg, ldu};
  const uint16_t* gt = variant == V_GEGLU ? gelu_lut(act) : nullptr;
  return x8_rows_gather<X, 2>(W, ld, nrows, cols, x, idx, k, out, act, nthreads,
                              [&](float g, float u) { return activate(variant, g, u, gt); });
}

// out[t * ldo + r] = W[r] . x_t for every row and T tokens, where need (T, nrows; null:
// everywhere) asks for some row of a group of 8 in a tile of up to 4 tokens; 0 elsewhere.
template <class X>
inline int x8_rows_gemm(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, const float* x,
                        int64_t ldx, int64_t T, float* out, int64_t ldo, const uint8_t* need,
                        int act, int nthreads) {
  if (!X8_KERNELS || !act || cols % X::QK || nrows < 1 || T < 0) return PP_ERR_ARG;
  const int64_t nb = cols / X::QK, ng = (nrows + 7) / 8, nch = cols / 32;
  ActBuf<X::ACT> xa(act, x, ldx, T, cols, nthreads);
  if (xa.failed(act)) return PP_ERR_ARG;
  const int nt = T > 1 ? nthreads : team_size(nthreads, nrows * nb * X::RB);
  return run_dynamic(nt, ng, 1, [&](int64_t a, int64_t b) -> int {
    const uint8_t *rows[8], *none[8] = {};
    bool bad[8];
    for (int64_t g = a; g < b; ++g) {
      const int nr = (int)(nrows - 8 * g < 8 ? nrows - 8 * g : 8);
      group_rows(W, ld, nrows, nullptr, nrows, g, rows, bad);
      token_tiles(TileSizes<4, 3, 2, 1>(), 0, T, [&](auto NT, int64_t t) {
        constexpr int N = decltype(NT)::value;
        float o[N * 8] = {};  // 0 where no token of the tile needs a row of the group
        if (!need || any_needed(need, nrows, 8 * g, nr, t, N)) {
          const QAct* ap[N];
          for (int i = 0; i < N; ++i) ap[i] = xa.p + (t + i) * nch;
          if constexpr (X8_KERNELS) X::template gdot<N>(rows, none, ap, nb, o, 8);
        }
        for (int i = 0; i < N; ++i)
          for (int r = 0; r < nr; ++r) out[(t + i) * ldo + 8 * g + r] = o[i * 8 + r];
      });
    }
    return 0;
  });
}

// out[j, :] = row idx[j] as f32 (idx null: rows 0..k-1), through the rows of its group.
template <class X>
inline int x8_dequant(const uint8_t* G, int64_t nrows, int64_t cols, const int64_t* idx,
                      int64_t k, float* out, int nthreads) {
  if (!x8_shape<X>(nrows, cols)) return PP_ERR_ARG;
  const int64_t nb = cols / X::QK, gb = x8_bytes<X>(cols), rb = nb * X::RB;
  return run_partitioned(nthreads, k, [&](int64_t a, int64_t b) -> int {
    uint8_t* rows = (uint8_t*)std::malloc((size_t)(8 * rb));
    if (!rows) return PP_ERR_ARG;
    int err = 0;
    int64_t have = -1;
    for (int64_t j = a; j < b; ++j) {
      const int64_t r = row_at(idx, j, nrows);
      if (r < 0) {
        for (int64_t c = 0; c < cols; ++c) out[j * cols + c] = NAN;
        err = PP_ERR_INDEX;
        continue;
      }
      if (r / 8 != have) X::unpack(G + (r / 8) * gb, nb, rows), have = r / 8;
      if constexpr (X::ROW == DT_MXFP4)
        for (int64_t c = 0; c < nb; ++c)
          mx_block(rows + (r % 8) * rb + c * MX_TS, out + j * cols + 32 * c);
      else
        row_decode<X::ROW>(rows + (r % 8) * rb, out + j * cols, cols);
    }
    std::free(rows);
    return err;
  });
}

// Rows (ld bytes apart) -> the interleaved layout at out, or back (unpack: W is the layout and
// out the rows). Returns the layout's code, or -1 (no AVX2 kernels, or a shape it cannot take).
template <class X>
inline int x8_repack(const uint8_t* W, int64_t ld, int64_t nrows, int64_t cols, uint8_t* out,
                     int unpack, int nthreads) {
  if (!X8_KERNELS || !x8_shape<X>(nrows, cols)) return -1;
  const int64_t nb = cols / X::QK, gb = x8_bytes<X>(cols), rb = nb * X::RB;
  run_partitioned(nthreads, nrows / 8, [&](int64_t a, int64_t b) -> int {
    for (int64_t g = a; g < b; ++g) {
      if (unpack)
        X::unpack(W + g * gb, nb, out + 8 * g * rb);
      else
        X::pack(W + 8 * g * ld, ld, nb, out + g * gb);
    }
    return 0;
  });
  return X::CODE;
}

}  // namespace
