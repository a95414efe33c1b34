// What Python checks at load (kernels.py, kernel_build.check_codes): the ABI version, the decode
// layer record's length and layout, the dtype codes and the SIMD level of the build.

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
