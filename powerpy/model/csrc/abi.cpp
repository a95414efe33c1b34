// What Python checks at load (kernels.py, kernel_build.check_codes): the ABI version, the decode
// layer record's length, layout and named fields, the dtype codes and the SIMD level of the build.

#include "simd.h"  // (common.h: the codes; PP_SIMD)

extern "C" {

// Bumped whenever a signature changes; kernels.py refuses a library with another version.
int pp_abi_version(void) { return PP_ABI_VERSION; }

// The int64 per layer record of the decode blocks (kernels.py checks its LAYER_RECORD_LEN).
int pp_layer_record_len(void) { return REC_LEN; }

// The record's layout, for kernels.py to check against its own (RECORD_LAYOUT): the slots of
// LayerRecord, the LF_* flags, then the variant codes, 31 int64 in all.
void pp_layer_record_layout(int64_t* out) {
  const int64_t v[] = {REC_ATTN, REC_FFN, REC_ATTN_NORM, REC_FFN_NORM, REC_POST_NORM,
                       REC_QK_NORM, REC_BIAS, REC_TAU, REC_FLAGS, REC_VARIANT, REC_WINDOW,
                       REC_SCALE, REC_SOFTCAP, REC_MOE, REC_SHEXP, REC_ROUTE, REC_MLA, REC_SINKS,
                       REC_LEN,
                       LF_LAYER_NORM, LF_ROPE,
                       LF_NEOX, LF_PARALLEL, LF_DOWN_STORED, LF_Q_SCALED, LF_MOE, LF_MLA, V_GEGLU,
                       V_RELU, V_GELU, V_COUNT};
  for (size_t i = 0; i < sizeof v / sizeof v[0]; ++i) out[i] = v[i];
}

// The record's fields by name, for kernel_build.check_codes to compare with Python's one by one
// and name the field that differs: "slot.<name>", the first int64 of a part of a LayerRecord, and
// "flag.<name>", an LF_* bit of REC_FLAGS. Returns the number of fields; for 0 <= i < that,
// *name and *value receive field i's.
int pp_layer_record_field(int i, const char** name, int64_t* value) {
  static const struct {
    const char* name;
    int64_t value;
  } f[] = {{"slot.attn", REC_ATTN},           {"slot.ffn", REC_FFN},
           {"slot.attn_norm", REC_ATTN_NORM}, {"slot.ffn_norm", REC_FFN_NORM},
           {"slot.post_norm", REC_POST_NORM}, {"slot.qk_norm", REC_QK_NORM},
           {"slot.bias", REC_BIAS},           {"slot.tau", REC_TAU},
           {"slot.flags", REC_FLAGS},         {"slot.variant", REC_VARIANT},
           {"slot.window", REC_WINDOW},       {"slot.scale", REC_SCALE},
           {"slot.softcap", REC_SOFTCAP},     {"slot.moe", REC_MOE},
           {"slot.shexp", REC_SHEXP},         {"slot.route", REC_ROUTE},
           {"slot.mla", REC_MLA},             {"slot.sinks", REC_SINKS},
           {"flag.layer_norm", LF_LAYER_NORM}, {"flag.rope", LF_ROPE},
           {"flag.neox", LF_NEOX},            {"flag.parallel", LF_PARALLEL},
           {"flag.down_stored", LF_DOWN_STORED}, {"flag.q_scaled", LF_Q_SCALED},
           {"flag.moe", LF_MOE},              {"flag.mla", LF_MLA}};
  const int n = (int)(sizeof f / sizeof f[0]);
  if (i >= 0 && i < n) {
    *name = f[i].name;
    *value = f[i].value;
  }
  return n;
}

// The dtype code (enum DType) of ggml type id ggml_type, or -1 when the kernels do not read it
// (kernels.py checks its DTYPE_CODES against this).
int pp_dtype_code(int ggml_type) {
  for (int dt = 0; dt < DT_COUNT; ++dt)
    if (GGML_TYPE_OF[dt] == ggml_type) return dt;
  return -1;
}

// 2 = AVX-512F, 1 = AVX2+FMA+F16C, 0 = scalar.
int pp_simd_level(void) { return PP_SIMD; }

}  // extern "C"
