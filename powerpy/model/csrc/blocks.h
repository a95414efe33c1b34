#pragma once
// One token's decode blocks (CPU-only decode): a layer's attention block and its FFN block, one
// call each, for every family's layout. What differs between families is data, the layer's
// record (layer_record.h LayerRecord, built by powerpy.model.layer_record): which norm (RMS, or
// LayerNorm with a bias), which norm each half reads (attention's own in falcon-40B), row biases
// of q, k, v, output, up and down, per-head q/k RMSNorm, RoPE (adjacent or NEOX pairs, or none:
// learned positions), the q·k scale, score soft-cap and sliding window, post norms of both
// outputs (gemma), a gated or ungated FFN, and a sequential or parallel residual. Each step is
// the one the per-op path (powerpy.model.transformer) takes, in its order, with the same
// functions, so the two paths give the same bits where their numerics agree. A mixture of
// experts' FFN runs moe.h's block (decode.cpp exports them).

#include "moe.h"

namespace {

// One layer's record, decoded.
struct Layer {
  const LayerRecord* rec;  // the record itself
  Mat q, k, v, o, fc1, fc2, gate, up, down;
  const float *attn_w, *attn_b, *ffn_w, *ffn_b, *post_attn, *post_ffn, *q_norm, *k_norm;
  const float *bq, *bk, *bv, *bo, *bu, *bd, *tau, *sinks;
  int flags, variant;
  int64_t window;
  float scale, softcap;
  explicit Layer(const LayerRecord* r)
      : rec(r), q(r->attn[0]), k(r->attn[1]), v(r->attn[2]), o(r->attn[3]), fc1(r->ffn[0]),
        fc2(r->ffn[1]), gate(r->ffn[2]), up(r->ffn[3]), down(r->ffn[4]),
        attn_w(r->attn_norm[0]), attn_b(r->attn_norm[1]), ffn_w(r->ffn_norm[0]),
        ffn_b(r->ffn_norm[1]), post_attn(r->post_norm[0]), post_ffn(r->post_norm[1]),
        q_norm(r->qk_norm[0]), k_norm(r->qk_norm[1]), bq(r->bias[0]), bk(r->bias[1]),
        bv(r->bias[2]), bo(r->bias[3]), bu(r->bias[4]), bd(r->bias[5]), tau(r->tau),
        sinks(r->sinks), flags((int)r->flags), variant((int)r->variant), window(r->window),
        scale(r->scale), softcap(r->softcap) {}

  // y = the layer's norm of x (n): RMSNorm, or LayerNorm with its bias b (may be null).
  void norm(const float* x, const float* w, const float* b, int64_t n, float eps, float* y) const {
    if (flags & LF_LAYER_NORM) layer_norm(x, w, b, n, eps, y);
    else rms_norm(x, w, n, eps, y);
  }
};

// Wall-clock seconds per decode phase, summed by the thread that runs the blocks (the teams
// of each matrix product start and join inside a phase, so a phase's time is all of its work).
// Nested: PH_ATTN_PROJ (the q, k, v and output products) inside PH_ATTENTION (the whole block);
// PH_PREDICTOR (fc1, fc2 and the selection) and PH_FFN_DOWN (the down pass) inside PH_FFN.
// powerpy.model.stack_decode.PHASES names them in this order.
enum Phase { PH_ATTENTION, PH_ATTN_PROJ, PH_FFN, PH_PREDICTOR, PH_FFN_DOWN, PH_COUNT };

// Adds the seconds of its scope to ph[i] (ph null: untimed, no clock read).
struct Lap {
  double* ph;
  int i;
  double t0;
  Lap(double* p, int phase) : ph(p), i(phase), t0(p ? omp_get_wtime() : 0.0) {}
  ~Lap() {
    if (ph) ph[i] += omp_get_wtime() - t0;
  }
};

// The model's heads: n_head query heads of hd, n_kv key/value heads, the first n_rot dims of
// each head rotated; the norms' eps.
struct Heads {
  int64_t n_head, n_kv, hd, n_rot;
  float eps;
};

inline void add_bias(float* y, const float* b, int64_t n) {
  if (b)
    for (int64_t i = 0; i < n; ++i) y[i] += b[i];
}

// RoPE of `heads` heads of hd at y: pairs (2i, 2i + 1), or (i, i + n_rot / 2) in NEOX mode, pair
// i turned by rot[i] = (cos, sin).
inline void rope_heads(float* y, int64_t heads, int64_t hd, int64_t n_rot, bool neox,
                       const float* rot) {
  const int64_t half = n_rot / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < half; ++i)
      rope_at(y + h * hd + (neox ? i : 2 * i), neox ? half : 1, rot[2 * i], rot[2 * i + 1]);
}

// How scores are made: scale (the softmax's), softcap (cap * tanh(s / cap) first; 0: none) and a
// sliding window (a query at p sees keys p - window + 1 .. p; 0: every earlier key).
struct AttnOpts {
  float scale, softcap;
  int64_t window;
  const float* sinks;  // (n_head) each head's sink logit, or null
  int64_t first(int64_t p) const { return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0; }
};

// The attention of one query at position pos over an f32 (cdt 0) or f16 (cdt 1) cache with f32
// activations: per head, scores over the window's cells (scaled, soft-capped), softmax, weighted
// values. sc: n_head * (pos + 1) floats of scratch.
static int attn_f32(const float* q, const void* kc, const void* vc, int cdt, int64_t pos,
                    const Heads& H, const AttnOpts& ao, float* sc, float* att, int nthreads) {
  const int64_t hd = H.hd, nkv = H.n_kv * hd, S = pos + 1, group = H.n_head / H.n_kv;
  const int64_t c0 = ao.first(pos);
  const int nt = team_size(nthreads, (S - c0) * nkv * 8 * group);
  return run_partitioned(nt, H.n_head, [&](int64_t h0, int64_t h1) -> int {
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t off = h / group * hd;  // this head's kv head, within a cache row
      const float* qh = q + h * hd;
      float* s = sc + h * S;
      float mx = -INFINITY;
      for (int64_t t = c0; t < S; ++t) {
        s[t] = kv_dot(qh, kc, cdt, t * nkv + off, hd) * ao.scale;
        if (ao.softcap != 0.0f) s[t] = tanhf(s[t] / ao.softcap) * ao.softcap;
        mx = s[t] > mx ? s[t] : mx;
      }
      if (ao.sinks) mx = ao.sinks[h] > mx ? ao.sinks[h] : mx;
      float sum = ao.sinks ? std::exp(ao.sinks[h] - mx) : 0.0f;
      for (int64_t t = c0; t < S; ++t) sum += (s[t] = std::exp(s[t] - mx));
      float* o = att + h * hd;
      for (int64_t i = 0; i < hd; ++i) o[i] = 0.0f;
      for (int64_t t = c0; t < S; ++t) kv_axpy(s[t] / sum, vc, cdt, t * nkv + off, hd, o);
    }
    return 0;
  });
}

static int mla_block(const Layer& L, const Heads& H, const float* rot, const float* x, void* kc,
                     int cdt, int64_t pos, float* out, int act, int nthreads, double* ph);

// One token's attention block (a latent attention's: mla.h mla_block): xa = the layer's
// attention norm of x; q, k, v = W·xa plus their
// row biases; each q and k head RMS-normed (q_norm, k_norm); RoPE by rot (null: none); q times
// the scale where the layer scales q (LF_Q_SCALED, gemma) rather than the scores; k and v written
// to the cache row pos (f32 or f16: cdt 0 / 1, rows of n_kv * hd); query head h reads kv head
// h / (n_head / n_kv) over the window (llama.cpp's f16 numerics with act and an f16 cache, else
// attn_f32); y = W_o · attention + bias, post-normed; out = x + y, or y alone in a parallel
// block (LF_PARALLEL: ffn_block adds both to x in llama.cpp's order). ph: the phase clock (null:
// untimed). Returns 0 or a status.
static int attn_block(const Layer& L, const Heads& H, const float* rot, const float* x, void* kc,
                      void* vc, int cdt, int64_t pos, float* out, int act, int nthreads,
                      double* ph = nullptr) {
  if (L.flags & LF_MLA) return mla_block(L, H, rot, x, kc, cdt, pos, out, act, nthreads, ph);
  const int64_t hd = H.hd, nq = H.n_head * hd, nkv = H.n_kv * hd, S = pos + 1;
  const int64_t d = L.q.cols;
  const bool rope = L.flags & LF_ROPE;
  if (L.q.nrows != nq || L.k.nrows != nkv || L.v.nrows != nkv || L.o.cols != nq ||
      L.o.nrows != d || H.n_rot > hd || H.n_rot % 2 || H.n_kv < 1 || H.n_head % H.n_kv ||
      (cdt != 0 && cdt != 1) || (rope && !rot) || !L.attn_w || L.k.cols != d || L.v.cols != d)
    return PP_ERR_ARG;
  float* buf = (float*)std::malloc(sizeof(float) * (2 * nq + 2 * nkv + H.n_head * S + 2 * d));
  if (!buf) return PP_ERR_ARG;
  float *q = buf, *k = q + nq, *v = k + nkv, *att = v + nkv, *sc = att + nq;
  float *xn = sc + H.n_head * S, *y = xn + d;
  L.norm(x, L.attn_w, L.attn_b, d, H.eps, xn);
  int st;
  if (L.q.dtype == L.k.dtype && L.q.dtype == L.v.dtype) {
    const Mat qkv[3] = {L.q, L.k, L.v};
    float* const outs[3] = {q, k, v};
    const Lap lap(ph, PH_ATTN_PROJ);
    st = mat_gemv_multi(qkv, 3, xn, outs, act, nthreads);
  } else {
    const Lap lap(ph, PH_ATTN_PROJ);
    st = mat_gemv(L.q, xn, nullptr, nq, q, act, nthreads);
    if (!st) st = mat_gemv(L.k, xn, nullptr, nkv, k, act, nthreads);
    if (!st) st = mat_gemv(L.v, xn, nullptr, nkv, v, act, nthreads);
  }
  if (st) {
    std::free(buf);
    return st;
  }
  add_bias(q, L.bq, nq);
  add_bias(k, L.bk, nkv);
  add_bias(v, L.bv, nkv);
  for (int64_t h = 0; L.q_norm && h < H.n_head; ++h)  // per head, in place
    rms_norm(q + h * hd, L.q_norm, hd, H.eps, q + h * hd);
  for (int64_t h = 0; L.k_norm && h < H.n_kv; ++h)
    rms_norm(k + h * hd, L.k_norm, hd, H.eps, k + h * hd);
  if (rope) {
    rope_heads(q, H.n_head, hd, H.n_rot, L.flags & LF_NEOX, rot);
    rope_heads(k, H.n_kv, hd, H.n_rot, L.flags & LF_NEOX, rot);
  }
  for (int64_t i = 0; i < nkv; ++i) {  // the cache row of this position
    if (cdt == 0) {
      ((float*)kc)[pos * nkv + i] = k[i];
      ((float*)vc)[pos * nkv + i] = v[i];
    } else {
      ((uint16_t*)kc)[pos * nkv + i] = float_to_half(k[i]);
      ((uint16_t*)vc)[pos * nkv + i] = float_to_half(v[i]);
    }
  }
  const bool q_scaled = L.flags & LF_Q_SCALED;  // ggml_scale of q; the softmax scales by 1
  if (cdt == 1 && act) {  // llama.cpp's numerics (see attn_ggml)
    st = attn_ggml(q, (const uint16_t*)kc, (const uint16_t*)vc, pos, 1, H.n_head, H.n_kv, hd, att,
                   nthreads, L.scale, q_scaled, L.softcap, L.window, 0, 0, 0, L.sinks);
  } else {
    for (int64_t i = 0; q_scaled && i < nq; ++i) q[i] *= L.scale;
    const AttnOpts ao{q_scaled ? 1.0f : L.scale, L.softcap, L.window, L.sinks};
    st = attn_f32(q, kc, vc, cdt, pos, H, ao, sc, att, nthreads);
  }
  if (!st) {
    const Lap lap(ph, PH_ATTN_PROJ);
    st = mat_gemv(L.o, att, nullptr, d, y, act, nthreads);
  }
  if (!st) {
    add_bias(y, L.bo, d);
    if (L.post_attn) L.norm(y, L.post_attn, nullptr, d, H.eps, y);
    if (L.flags & LF_PARALLEL)
      std::memcpy(out, y, sizeof(float) * d);
    else
      for (int64_t i = 0; i < d; ++i) out[i] = x[i] + y[i];
  }
  std::free(buf);
  return st;
}

// A mixture of experts' FFN block (moe.h moe_decode, llama.cpp's build_moe_ffn) from a record:
// RMSNorm, a sequential block, no biases or post norm.
static int64_t moe_block(const Layer& L, float eps, const float* r, float* out, int act,
                         int nthreads) {
  if (L.flags & (LF_LAYER_NORM | LF_PARALLEL) || L.ffn_b || L.post_ffn || L.bu || L.bd || !L.ffn_w)
    return -PP_ERR_ARG;
  const LayerRecord& R = *L.rec;
  // the router, the gate, up and down stacks, then a shared expert's 4 matrices (or zeros)
  const RecMatrix mats[8] = {R.ffn[0],   R.ffn[2],   R.ffn[3],   R.ffn[4],
                             R.shexp[0], R.shexp[1], R.shexp[2], R.shexp[3]};
  return moe_decode(mats, R.moe.n_used, (int)R.moe.norm, R.moe.scale, &R.route, L.tau, r, L.ffn_w,
                    eps, out, nullptr, nullptr, act, nthreads);
}

// Whether a record's FFN matrices fit together: a variant of its kind (gated or not), a gate of
// up's rows and no up bias beside it, a down matrix of n_ff rows (or, stored, n_ff columns).
static bool ffn_layout_ok(const Layer& L) {
  const bool gated = L.gate.w != nullptr, stored = L.flags & LF_DOWN_STORED;
  const int64_t n_ff = L.up.nrows;
  const bool variant_ok = gated ? L.variant >= V_REGLU && L.variant <= V_GEGLU
                                : L.variant == V_RELU || L.variant == V_GELU;
  return variant_ok && !(gated && (L.gate.nrows != n_ff || L.bu)) &&
         (stored ? L.down.cols == n_ff : L.down.nrows == n_ff);
}

// The rows sel (k of them; null: the first k) of one token's FFN: h_j = act(gate_j·x, up_j·x)
// (gated), or act(up_j·x + bias_j) (ungated: RELU, GELU); with tau, a computed neuron with
// |h_j| < tau[j] is dropped before its down row is read; y = sum_j h_j down_t[j] (or, with
// LF_DOWN_STORED, a dense file's ffn_down (n_embd, n_ff) times h over every row). h: k floats
// of scratch; kept: the rows added. The FFN block and a hybrid layer's cold task (host_tasks.h)
// both run it. Returns a status.
static int ffn_rows(const Layer& L, const float* x, const int64_t* sel, int64_t k, float* h,
                    float* y, int act, int nthreads, int64_t* kept, double* ph = nullptr) {
  const bool gated = L.gate.w != nullptr, stored = L.flags & LF_DOWN_STORED;
  const Mat &up = L.up, &down = L.down;
  int st = 0;
  if (k && gated) st = mat_glu(L.gate, up, x, sel, k, L.variant, h, act, nthreads);
  if (k && !gated) {
    st = mat_gemv(up, x, sel, k, h, act, nthreads);
    const uint16_t* gt = gelu_lut(act);
    for (int64_t j = 0; j < k && !st; ++j) {
      const float u = L.bu ? h[j] + L.bu[sel ? sel[j] : j] : h[j];
      h[j] = L.variant == V_RELU ? (u > 0.0f ? u : 0.0f) : gelu(u, gt);
    }
  }
  *kept = k;
  if (st) return st;
  const Lap lap(ph, PH_FFN_DOWN);
  if (stored) return mat_gemv(down, h, nullptr, down.nrows, y, act, nthreads);
  if (k) return mat_axpy(down, h, sel, k, y, nthreads, L.tau, L.tau ? kept : nullptr);
  *kept = 0;
  std::memset(y, 0, sizeof(float) * down.cols);
  return 0;
}

// One token's FFN block: r the residual stream it adds to, xs its source (r in a sequential
// block; in a parallel one the block's input, and r the attention's output alone). With a
// predictor (fc1, fc2) the neurons j with fc2·relu(fc1·xs) >= thr, else all of them; xn = the
// layer's FFN norm of xs; h_j = act(gate_j·xn, up_j·xn) (gated, no up bias), or
// act(up_j·xn + bias_j) (ungated: RELU, GELU); with tau, a computed neuron with |h_j| < tau[j]
// is dropped before its down row is read; y = sum_j h_j down_t[j] (or, with LF_DOWN_STORED, a
// dense file's ffn_down (n_embd, n_ff) times h: no predictor, no cut) plus the down bias,
// post-normed; out = r + y, or (r + y) + xs in a parallel block (out may be xs). ph: the phase
// clock (null: untimed). Returns the neurons whose down rows were added, or -status.
static int64_t ffn_block(const Layer& L, float eps, float thr, const float* r, const float* xs,
                         float* out, int act, int nthreads, double* ph = nullptr) {
  if (L.flags & LF_MOE) return moe_block(L, eps, r, out, act, nthreads);
  const bool stored = L.flags & LF_DOWN_STORED;
  const Mat &fc1 = L.fc1, &fc2 = L.fc2, &up = L.up, &down = L.down;
  const int64_t n_ff = up.nrows;
  if (!ffn_layout_ok(L) || !L.ffn_w || (stored && (fc1.w || L.tau))) return -PP_ERR_ARG;
  const int64_t H = fc1.w ? fc1.nrows : 0;
  const int64_t d = up.cols, nd = stored ? down.nrows : down.cols;
  float* buf =
      (float*)std::malloc(sizeof(float) * (H + 2 * n_ff + d + nd) + sizeof(int64_t) * n_ff);
  if (!buf) return -PP_ERR_ARG;
  float *z = buf, *logit = buf + H, *h = logit + n_ff, *x = h + n_ff, *y = x + d;
  int64_t* idx = (int64_t*)(y + nd);
  L.norm(xs, L.ffn_w, L.ffn_b, d, eps, x);
  int64_t k = n_ff;
  int st = 0;
  const int64_t* sel = nullptr;
  if (fc1.w) {
    const Lap lap(ph, PH_PREDICTOR);
    if (fc2.nrows != n_ff || fc2.cols != H) st = PP_ERR_ARG;
    if (!st) st = mat_gemv(fc1, xs, nullptr, H, z, act, nthreads);
    for (int64_t i = 0; i < H && !st; ++i) z[i] = z[i] > 0.0f ? z[i] : 0.0f;
    if (!st) st = mat_gemv(fc2, z, nullptr, n_ff, logit, act, nthreads);
    k = 0;
    for (int64_t j = 0; j < n_ff && !st; ++j)
      if (logit[j] >= thr) idx[k++] = j;
    sel = idx;
  }
  int64_t kept = k;  // with a cut: the rows the down pass really adds
  if (!st) st = ffn_rows(L, x, sel, k, h, y, act, nthreads, &kept, ph);
  if (!st) {
    add_bias(y, L.bd, nd);
    if (L.post_ffn) L.norm(y, L.post_ffn, nullptr, nd, eps, y);
    if (L.flags & LF_PARALLEL)  // (attention + FFN) + input, as llama.cpp's parallel graphs add
      for (int64_t i = 0; i < nd; ++i) out[i] = (r[i] + y[i]) + xs[i];
    else
      for (int64_t i = 0; i < nd; ++i) out[i] = r[i] + y[i];
  }
  std::free(buf);
  return st ? -st : kept;
}

}  // namespace

// The latent attention block (declared above, for attn_block): every file that sees the decode
// blocks sees its definition.
#include "mla.h"
