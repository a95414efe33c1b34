// What Python checks at load (kernels.py, kernel_build.check_codes): the ABI version, the decode
// layer record's size and its fields by name, the dtype codes and the SIMD level of the build.

#include "simd.h"  // (common.h: the codes; PP_SIMD)

extern "C" {

// Bumped whenever a signature changes; kernels.py refuses a library with another version.
int pp_abi_version(void) { return PP_ABI_VERSION; }

// The bytes of one decode layer record (layer_record.h LayerRecord; 111 int64: before ABI 29 this
// returned that count). kernel_build.check_codes compares it with ctypes.sizeof of its own.
int pp_layer_record_len(void) { return (int)sizeof(LayerRecord); }

// The decode layer record's fields, for kernel_build.check_codes to compare with kernel_abi's
// ctypes mirror one by one and name the field that differs: each field of LayerRecord by its
// name ("attn", ...), each member of its sub-records by "sub.member" ("moe.n_used", ...) and of
// RecMatrix by "matrix.member", with its byte offset (in LayerRecord; a RecMatrix member's, in
// RecMatrix) and size; then the codes the record holds, with the code as the offset and size 0:
// "flag.<name>", an LF_* bit of flags, and "variant.<name>", an enum Variant. Returns the number
// of entries; for 0 <= i < that, *name, *offset and *size receive entry i's.
int pp_layer_record_field(int i, const char** name, int64_t* offset, int64_t* size) {
  struct Entry {
    const char* name;
    int64_t offset, size;
  };
#define PP_FIELD(f) {#f, (int64_t)offsetof(LayerRecord, f), (int64_t)sizeof(LayerRecord::f)}
#define PP_MEMBER(s, T, f) \
  {#s "." #f, (int64_t)(offsetof(LayerRecord, s) + offsetof(T, f)), (int64_t)sizeof(T::f)}
#define PP_MATRIX(f) {"matrix." #f, (int64_t)offsetof(RecMatrix, f), (int64_t)sizeof(RecMatrix::f)}
#define PP_CODE(prefix, n, v) {prefix #n, (int64_t)(v), 0}
  static const Entry f[] = {
      PP_FIELD(attn), PP_FIELD(ffn), PP_FIELD(attn_norm), PP_FIELD(ffn_norm),
      PP_FIELD(post_norm), PP_FIELD(qk_norm), PP_FIELD(bias), PP_FIELD(tau), PP_FIELD(flags),
      PP_FIELD(variant), PP_FIELD(window), PP_FIELD(scale), PP_FIELD(scale_pad),
      PP_FIELD(softcap), PP_FIELD(softcap_pad), PP_FIELD(moe), PP_MEMBER(moe, RecMoe, n_used),
      PP_MEMBER(moe, RecMoe, norm), PP_MEMBER(moe, RecMoe, scale),
      PP_MEMBER(moe, RecMoe, scale_pad), PP_FIELD(shexp), PP_FIELD(route),
      PP_MEMBER(route, RecRoute, gating), PP_MEMBER(route, RecRoute, bias),
      PP_MEMBER(route, RecRoute, groups), PP_MEMBER(route, RecRoute, used),
      PP_MEMBER(route, RecRoute, router_b), PP_MEMBER(route, RecRoute, act),
      PP_MEMBER(route, RecRoute, gate_b), PP_MEMBER(route, RecRoute, up_b),
      PP_MEMBER(route, RecRoute, down_b), PP_FIELD(mla), PP_MEMBER(mla, RecMla, k_b),
      PP_MEMBER(mla, RecMla, v_b), PP_MEMBER(mla, RecMla, rank), PP_MEMBER(mla, RecMla, d_nope),
      PP_MEMBER(mla, RecMla, d_v), PP_FIELD(sinks),
      PP_MATRIX(dtype), PP_MATRIX(data), PP_MATRIX(ld), PP_MATRIX(nrows), PP_MATRIX(cols),
      PP_CODE("flag.", layer_norm, LF_LAYER_NORM), PP_CODE("flag.", rope, LF_ROPE),
      PP_CODE("flag.", neox, LF_NEOX), PP_CODE("flag.", parallel, LF_PARALLEL),
      PP_CODE("flag.", down_stored, LF_DOWN_STORED), PP_CODE("flag.", q_scaled, LF_Q_SCALED),
      PP_CODE("flag.", moe, LF_MOE), PP_CODE("flag.", mla, LF_MLA),
      PP_CODE("variant.", reglu, V_REGLU), PP_CODE("variant.", drelu, V_DRELU),
      PP_CODE("variant.", swiglu, V_SWIGLU), PP_CODE("variant.", geglu, V_GEGLU),
      PP_CODE("variant.", relu, V_RELU), PP_CODE("variant.", gelu, V_GELU)};
#undef PP_FIELD
#undef PP_MEMBER
#undef PP_MATRIX
#undef PP_CODE
  const int n = (int)(sizeof f / sizeof f[0]);
  if (i >= 0 && i < n) {
    *name = f[i].name;
    *offset = f[i].offset;
    *size = f[i].size;
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
