// One token's decode: a layer's attention block and FFN block (blocks.h, mla.h), and every layer in
// one call per token (the CPU-only decode's layer loop).

#include "blocks.h"  // the decode blocks of every family's layout (MoE layers: moe.h's)
#include "mla.h"     // DeepSeek-2's latent attention block

extern "C" {

// One token's attention block in one call (blocks.h attn_block): rec is the layer's record
// (layer_record.h LayerRecord), x (n_embd) the residual stream, rot (n_rot / 2, 2) the (cos, sin)
// of this position (null: no RoPE), kc / vc one layer's cache (cdt 0: f32, 1: f16), out = x +
// attention. Returns 0 or a status.
int pp_attn_decode(const LayerRecord* rec, int64_t n_head, int64_t n_kv, int64_t hd, int64_t n_rot,
                   float eps, const float* rot, const float* x, void* kc, void* vc, int cdt,
                   int64_t pos, float* out, int act, int nthreads) {
  const Heads H{n_head, n_kv, hd, n_rot, eps};
  return attn_block(Layer(rec), H, rot, x, kc, vc, cdt, pos, out, act, nthreads);
}

// One token's FFN block in one call (blocks.h ffn_block): r the residual stream it adds to, xs
// the FFN's source (r, or the block's input in a parallel block), out = r + FFN (may be xs).
// Returns the number of neurons whose down rows were added, or -status.
int64_t pp_ffn_decode(const LayerRecord* rec, float eps, float thr, const float* r, const float* xs,
                      float* out, int act, int nthreads) {
  return ffn_block(Layer(rec), eps, thr, r, xs, out, act, nthreads);
}

// One token through every block (CPU-only decode), one call per token instead of two per layer:
// per layer the attention block then the FFN block, x (n_embd) updated in place. layers: n_layer
// records (layer_record.h); rots[l]: layer l's (cos, sin) table (null: no RoPE). Layer l's keys
// and values are at kc/vc + l * layer_bytes; counts[l] receives the number of neurons whose down
// rows layer l added. phases (n_phases = PH_COUNT doubles, or null: untimed): the
// seconds of each blocks.h Phase are added to it. Returns 0 or the first failing status.
int pp_decode_layers(int64_t n_layer, const LayerRecord* layers, const float* const* rots,
                     int64_t n_head, int64_t n_kv, int64_t hd, int64_t n_rot, float eps, void* kc,
                     void* vc, int64_t layer_bytes, int cdt, int64_t pos, float thr, float* x,
                     int64_t* counts, double* phases, int64_t n_phases, int act, int nthreads) {
  if (n_layer <= 0) return 0;
  if (phases && n_phases != PH_COUNT) return PP_ERR_ARG;
  const int64_t d = layers[0].attn[0].cols;  // attn_q's
  const Heads H{n_head, n_kv, hd, n_rot, eps};
  float* y = (float*)std::malloc(sizeof(float) * d);
  if (!y) return PP_ERR_ARG;
  int st = 0;
  for (int64_t l = 0; l < n_layer && !st; ++l) {
    const Layer L(layers + l);
    if (L.q.cols != d) {
      st = PP_ERR_ARG;
      break;
    }
    {
      const Lap lap(phases, PH_ATTENTION);
      st = attn_block(L, H, rots[l], x, (char*)kc + l * layer_bytes,
                      (char*)vc + l * layer_bytes, cdt, pos, y, act, nthreads, phases);
    }
    if (st) break;
    const Lap lap(phases, PH_FFN);
    const int64_t k =
        ffn_block(L, eps, thr, y, L.flags & LF_PARALLEL ? x : y, x, act, nthreads, phases);
    if (k < 0) st = (int)-k;
    else counts[l] = k;
  }
  std::free(y);
  return st;
}

}  // extern "C"
