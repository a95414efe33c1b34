#pragma once
// The decode block kernels' record of one layer (blocks.h Layer, moe.h, mla.h, decode.cpp's
// layer loop), declared once: Python's ctypes mirror is powerpy.model.kernel_abi.LayerRecord,
// built by powerpy.model.layer_record and checked at load field by field against the table
// abi.cpp exports (pp_layer_record_field: every field's name, offset and size, the LF_* flags and
// the variant codes). Its bytes are those of the 111 int64 slots it replaced (each field's byte
// offset / 8 is its old slot; the static_asserts below), so a record is 111 int64 to any library
// since the GPT-OSS ABI (tools/kernel_diff.cpp writes them so for two revisions).
//
// Zeros are "absent" throughout: a matrix of zeros (no gate in an ungated FFN, no predictor in a
// dense run), a null vector, a window or soft-cap of 0. Pointers are to f32 host vectors.

#include <cstddef>
#include <cstdint>

// One matrix as Python describes it (kernels.Matrix.args; mat.h Mat reads it).
struct RecMatrix {
  int64_t dtype;     // enum DType (common.h)
  const void* data;  // row 0
  int64_t ld;        // bytes from one row to the next (an interleaved layout: one group of 8)
  int64_t nrows, cols;
};

// A mixture of experts' routing (LF_MOE): experts per token, whether their weights are
// renormalised, and the weights' scale (0 or 1: none).
struct RecMoe {
  int64_t n_used;
  int64_t norm;
  float scale;
  uint32_t scale_pad;  // zero
};

// The routing beyond top-k and the experts' extras (moe.h route_scores, moe_decode; built by
// moe.py route_args; all zeros: a plain softmax, SwiGLU, no biases).
struct RecRoute {
  int64_t gating;          // 0 softmax, 1 sigmoid, 2 the chosen logits' softmax
  const float* bias;       // (n_expert) selection biases, added to the scores top-k reads
  int64_t groups, used;    // expert groups and how many a token uses (groups <= 1: none)
  const float* router_b;   // (n_expert) the router's bias (GPT-OSS)
  int64_t act;             // the experts' activation: 0 SwiGLU, 1 GPT-OSS's clamped swiglu_oai
  const float* gate_b;     // (n_expert, n_ff) the gate stack's biases
  const float* up_b;       // (n_expert, n_ff) the up stack's
  const float* down_b;     // (n_expert, n_embd) the down stack's
};

// DeepSeek-2's latent attention (LF_MLA; mla.h): the per-head stacks and the widths.
struct RecMla {
  RecMatrix k_b;   // attn_k_b (n_head * rank, d_nope)
  RecMatrix v_b;   // attn_v_b (n_head * d_v, rank)
  int64_t rank;    // the latent's width (kv_lora_rank)
  int64_t d_nope;  // a head's q·k dims without RoPE
  int64_t d_v;     // a head's value width
};

// A latent attention puts attn_q (or attn_q_a), attn_kv_a_mqa, attn_q_b (zeros: a plain attn_q)
// and attn_output in attn's four matrices, attn_q_a_norm and attn_kv_a_norm in qk_norm, its
// kq_scale in scale. A mixture of experts puts its router in ffn's fc1 and its gate, up and down
// stacks in ffn's gate, up and down (moe.h moe_decode).
struct LayerRecord {
  RecMatrix attn[4];  // q (n_head * hd, n_embd), k and v (n_kv * hd, n_embd), output
                      // (n_embd, n_head * hd)
  RecMatrix ffn[5];   // fc1 (r, n_embd) and fc2 (n_ff, r): the predictor; gate and up
                      // (n_ff, n_embd); down (n_ff, n_embd) rows, or (n_embd, n_ff) as a dense
                      // file stores it (LF_DOWN_STORED)
  const float* attn_norm[2];  // (n_embd) the norm attention reads: weight, bias (LayerNorm)
  const float* ffn_norm[2];   // (n_embd) the norm the FFN reads: weight, bias
  const float* post_norm[2];  // (n_embd) the post norms of attention's and the FFN's outputs
  const float* qk_norm[2];    // (hd) the per-head q and k RMSNorm weights
  const float* bias[6];       // the row biases of q, k, v, output, up and down
  const float* tau;           // (n_ff) the FFN's cut
  int64_t flags;              // LF_* (below)
  int64_t variant;            // the FFN's enum Variant (common.h)
  int64_t window;             // the sliding window (0: every key)
  float scale;                // the q·k scale
  uint32_t scale_pad;         // zero
  float softcap;              // the score soft-cap (0: none)
  uint32_t softcap_pad;       // zero
  RecMoe moe;                 // a mixture of experts' routing (LF_MOE)
  RecMatrix shexp[4];         // a shared expert: its gate row (1, n_embd; zeros: unscaled),
                              // gate and up (n_ff_s, n_embd), down (n_embd, n_ff_s); zeros: none
  RecRoute route;             // the routing beyond top-k, the experts' biases (LF_MOE)
  RecMla mla;                 // a latent attention's stacks and widths (LF_MLA)
  const float* sinks;         // (n_head) the heads' attention sink logits (GPT-OSS)
};

// Each field at its old int64 slot, 111 in all.
#define PP_AT_SLOT(field, slot) \
  static_assert(offsetof(LayerRecord, field) == 8 * (slot), #field " at slot " #slot)
PP_AT_SLOT(attn, 0);
PP_AT_SLOT(ffn, 20);
PP_AT_SLOT(attn_norm, 45);
PP_AT_SLOT(ffn_norm, 47);
PP_AT_SLOT(post_norm, 49);
PP_AT_SLOT(qk_norm, 51);
PP_AT_SLOT(bias, 53);
PP_AT_SLOT(tau, 59);
PP_AT_SLOT(flags, 60);
PP_AT_SLOT(variant, 61);
PP_AT_SLOT(window, 62);
PP_AT_SLOT(scale, 63);
PP_AT_SLOT(softcap, 64);
PP_AT_SLOT(moe, 65);
PP_AT_SLOT(shexp, 68);
PP_AT_SLOT(route, 88);
PP_AT_SLOT(mla, 97);
PP_AT_SLOT(sinks, 110);
#undef PP_AT_SLOT
static_assert(sizeof(RecMatrix) == 5 * 8 && sizeof(RecMoe) == 3 * 8 && sizeof(RecRoute) == 9 * 8 &&
                  sizeof(RecMla) == 13 * 8,
              "the sub-records' slots");
static_assert(offsetof(RecMoe, scale) == 16 && offsetof(RecRoute, router_b) == 32 &&
                  offsetof(RecRoute, down_b) == 64 && offsetof(RecMla, rank) == 80,
              "the sub-records' fields");
static_assert(sizeof(LayerRecord) == 111 * 8, "a record of 111 int64");

namespace {

// LayerRecord::flags: LayerNorm (else RMSNorm); RoPE, in NEOX pairs (i, i + n_rot / 2) or
// adjacent ones; a parallel block (the FFN reads the block's input); the down matrix as a dense
// file stores it (n_embd, n_ff); q scaled before q·k (else the scores, in the softmax); a mixture
// of experts; a latent attention.
enum LayerFlags {
  LF_LAYER_NORM = 1, LF_ROPE = 2, LF_NEOX = 4, LF_PARALLEL = 8, LF_DOWN_STORED = 16,
  LF_Q_SCALED = 32, LF_MOE = 64, LF_MLA = 128
};

}  // namespace
