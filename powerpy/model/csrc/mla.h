#pragma once
// DeepSeek-2's latent attention (powerpy/model/mla.py): one token's attention block over the
// cache of the latent, in one call, from a layer record flagged LF_MLA (built by mla.mla_part).
// Its matrices: the record's attn q holds attn_q (or attn_q_a), k attn_kv_a_mqa, v attn_q_b
// (zeros: a plain attn_q), o attn_output; its mla (layer_record.h RecMla) the per-head stacks
// attn_k_b (n_head * r, d_n) and attn_v_b (n_head * d_v, r), then r, d_n and d_v. The q/k norms
// are attn_q_a_norm and attn_kv_a_norm, the score scale kq_scale. Each step is the per-op path's
// (mla.attention) with its functions, so the two give the same bits. blocks.h, which declares
// mla_block, includes it at its end.

#include "blocks.h"

namespace {

// x (d) the residual stream -> out = x + attention (d); the cache rows of H.hd = r + n_rot f16
// (cdt 1) or f32 (cdt 0) values, the first r of them the values; rot: the step's (cos, sin)
// table of n_rot / 2 pairs (adjacent pairs). Returns 0 or a status.
static int mla_block(const Layer& L, const Heads& H, const float* rot, const float* x, void* kc,
                     int cdt, int64_t pos, float* out, int act, int nthreads, double* ph) {
  const RecMla& m = L.rec->mla;
  const Mat k_b(m.k_b), v_b(m.v_b);
  const int64_t r = m.rank, dn = m.d_nope, dv = m.d_v, nh = H.n_head, nr = H.n_rot;
  const int64_t dk = dn + nr, row = r + nr, d = L.q.cols, S = pos + 1;
  const Mat& q_last = L.v.w ? L.v : L.q;  // attn_q_b, or a plain attn_q
  if (H.n_kv != 1 || H.hd != row || !rot || !L.attn_w || !L.k_norm || L.k.nrows != row ||
      L.k.cols != d || q_last.nrows != nh * dk || k_b.nrows != nh * r || k_b.cols != dn ||
      v_b.nrows != nh * dv || v_b.cols != r || L.o.cols != nh * dv || L.o.nrows != d ||
      (L.v.w && (!L.q_norm || L.v.cols != L.q.nrows)) || (cdt != 0 && cdt != 1))
    return PP_ERR_ARG;
  const int64_t qa = L.v.w ? L.q.nrows : 0;
  float* buf = (float*)std::malloc(sizeof(float) * (d + qa + nh * dk + row + nh * row + nh * r +
                                                    nh * dv + d + S));
  if (!buf) return PP_ERR_ARG;
  float *xn = buf, *qlow = xn + d, *q = qlow + qa, *kv = q + nh * dk, *ql = kv + row;
  float *att = ql + nh * row, *vh = att + nh * r, *y = vh + nh * dv, *sc = y + d;
  rms_norm(x, L.attn_w, d, H.eps, xn);
  int st;
  {
    const Lap lap(ph, PH_ATTN_PROJ);
    if (qa) {
      st = mat_gemv(L.q, xn, nullptr, qa, qlow, act, nthreads);
      if (!st) rms_norm(qlow, L.q_norm, qa, H.eps, qlow);
      if (!st) st = mat_gemv(L.v, qlow, nullptr, nh * dk, q, act, nthreads);
    } else {
      st = mat_gemv(L.q, xn, nullptr, nh * dk, q, act, nthreads);
    }
    if (!st) st = mat_gemv(L.k, xn, nullptr, row, kv, act, nthreads);
  }
  if (!st) {
    rms_norm(kv, L.k_norm, r, H.eps, kv);  // the latent, then the shared RoPE dims
    rope_heads(kv + r, 1, nr, nr, false, rot);
    rope_heads(q + dn, nh, dk, nr, false, rot);
  }
  for (int64_t h = 0; h < nh && !st; ++h) {  // each head's q into the latent, then its RoPE dims
    const Lap lap(ph, PH_ATTN_PROJ);
    st = mat_gemv(sub_rows(k_b, h * r, r), q + h * dk, nullptr, r, ql + h * row, act, nthreads);
    std::memcpy(ql + h * row + r, q + h * dk + dn, sizeof(float) * nr);
  }
  for (int64_t i = 0; i < row && !st; ++i) {  // the cache row of this position
    if (cdt == 0) ((float*)kc)[pos * row + i] = kv[i];
    else ((uint16_t*)kc)[pos * row + i] = float_to_half(kv[i]);
  }
  if (!st && cdt == 1 && act) {  // llama.cpp's numerics (numerics.h attn_ggml), one KV head
    st = attn_ggml(ql, (const uint16_t*)kc, (const uint16_t*)kc, pos, 1, nh, 1, row, att,
                   nthreads, L.scale, false, 0.0f, 0, r, row, row);
  } else if (!st) {  // f32 activations: the softmax of the scaled scores, then the latent's sum
    for (int64_t h = 0; h < nh; ++h) {
      float mx = -INFINITY, sum = 0.0f, *o = att + h * r;
      for (int64_t t = 0; t < S; ++t) {
        sc[t] = kv_dot(ql + h * row, kc, cdt, t * row, row) * L.scale;
        mx = sc[t] > mx ? sc[t] : mx;
      }
      for (int64_t t = 0; t < S; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
      for (int64_t i = 0; i < r; ++i) o[i] = 0.0f;
      for (int64_t t = 0; t < S; ++t) kv_axpy(sc[t] / sum, kc, cdt, t * row, r, o);
    }
  }
  for (int64_t h = 0; h < nh && !st; ++h) {  // each head's value out of the latent
    const Lap lap(ph, PH_ATTN_PROJ);
    st = mat_gemv(sub_rows(v_b, h * dv, dv), att + h * r, nullptr, dv, vh + h * dv, act,
                  nthreads);
  }
  if (!st) {
    const Lap lap(ph, PH_ATTN_PROJ);
    st = mat_gemv(L.o, vh, nullptr, d, y, act, nthreads);
  }
  for (int64_t i = 0; i < d && !st; ++i) out[i] = x[i] + y[i];
  std::free(buf);
  return st;
}

}  // namespace
