"""The native library's ABI as Python sees it: its version, the dtype and FFN variant codes, the
decode blocks' layer record (``LayerRecord``, a ctypes mirror of the C struct), and each C
function's ctypes signature. ``kernels`` checks them against the loaded library
(``kernel_build.check_codes``) and applies the signatures."""

from __future__ import annotations

import ctypes

import torch

from powerpy.config import FFNVariant
from powerpy.formats.constants import GGMLType

ABI_VERSION = 29

# dtype codes of the C library (enum DType in csrc/common.h; checked at load: pp_dtype_code)
DTYPE_CODES: dict[torch.dtype | GGMLType, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    GGMLType.F32: 0,
    GGMLType.F16: 1,
    GGMLType.BF16: 2,
    GGMLType.Q8_0: 3,
    GGMLType.Q4_0: 4,
    GGMLType.Q4_1: 5,
    GGMLType.Q5_0: 6,
    GGMLType.Q5_1: 7,
    GGMLType.Q4_K: 8,
    GGMLType.Q5_K: 9,
    GGMLType.Q6_K: 10,
    GGMLType.MXFP4: 14,
}
QUANT_TYPES = tuple(
    t
    for t in DTYPE_CODES
    if isinstance(t, GGMLType) and t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
)
# FFN variants (enum Variant): gated h = act(gate·x, up·x) (pp_glu_gemv), then ungated act(up·x);
# checked at load (the record table's variant.<name>)
VARIANTS = {
    FFNVariant.REGLU: 0,
    FFNVariant.DRELU: 1,
    FFNVariant.SWIGLU: 2,
    FFNVariant.GEGLU: 3,
    FFNVariant.RELU: 4,
    FFNVariant.GELU: 5,
}

_i64, _u32, _ptr = ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p


# The decode blocks' layer record (csrc/layer_record.h, built by powerpy.model.layer_record): the
# same fields, by the same names, in the same order; checked at load field by field (offset and
# size) against the library's table (pp_layer_record_field: kernel_build.check_codes).
class RecMatrix(ctypes.Structure):
    """One matrix (``kernels.Matrix.args``; zeros: none)."""

    _fields_ = [("dtype", _i64), ("data", _ptr), ("ld", _i64), ("nrows", _i64), ("cols", _i64)]


class RecMoe(ctypes.Structure):
    """A mixture of experts' routing: experts per token, renormalised weights, their scale."""

    _fields_ = [("n_used", _i64), ("norm", _i64), ("scale", ctypes.c_float), ("scale_pad", _u32)]


class RecRoute(ctypes.Structure):
    """The routing beyond top-k and the experts' extras (``moe.route_args``): gating code,
    selection biases, expert groups and groups used, router bias, the experts' activation, their
    gate, up and down biases."""

    _fields_ = [
        ("gating", _i64),
        ("bias", _ptr),
        ("groups", _i64),
        ("used", _i64),
        ("router_b", _ptr),
        ("act", _i64),
        ("gate_b", _ptr),
        ("up_b", _ptr),
        ("down_b", _ptr),
    ]


class RecMla(ctypes.Structure):
    """A latent attention's per-head stacks attn_k_b and attn_v_b and its widths."""

    _fields_ = [
        ("k_b", RecMatrix),
        ("v_b", RecMatrix),
        ("rank", _i64),
        ("d_nope", _i64),
        ("d_v", _i64),
    ]


class LayerRecord(ctypes.Structure):
    """One layer as the decode blocks read it (its fields' meaning: ``csrc/layer_record.h``)."""

    _fields_ = [
        ("attn", RecMatrix * 4),  # q, k, v, output
        ("ffn", RecMatrix * 5),  # fc1, fc2, gate, up, down
        ("attn_norm", _ptr * 2),  # weight, bias
        ("ffn_norm", _ptr * 2),
        ("post_norm", _ptr * 2),  # attention's, the FFN's
        ("qk_norm", _ptr * 2),
        ("bias", _ptr * 6),  # q, k, v, output, up, down
        ("tau", _ptr),
        ("flags", _i64),  # RECORD_FLAGS
        ("variant", _i64),  # VARIANTS
        ("window", _i64),
        ("scale", ctypes.c_float),
        ("scale_pad", _u32),
        ("softcap", ctypes.c_float),
        ("softcap_pad", _u32),
        ("moe", RecMoe),
        ("shexp", RecMatrix * 4),  # a shared expert's gate row, gate, up, down
        ("route", RecRoute),
        ("mla", RecMla),
        ("sinks", _ptr),
    ]


# The bits of LayerRecord.flags (enum LayerFlags)
RECORD_FLAGS = {
    "layer_norm": 1,
    "rope": 2,
    "neox": 4,
    "parallel": 8,
    "down_stored": 16,
    "q_scaled": 32,
    "moe": 64,
    "mla": 128,
}


def record_fields(record: type[ctypes.Structure] = LayerRecord) -> dict[str, tuple[int, int]]:
    """The entries of the library's record table (``pp_layer_record_field``) as this side has
    them, in its order: name -> (offset, size) of each field of ``record``, of each member of its
    sub-records ("moe.n_used") and of RecMatrix ("matrix.data"); then the flags ("flag.<name>")
    and variant codes ("variant.<name>") as (code, 0)."""
    out = {}
    for name, t in record._fields_:
        f = getattr(record, name)
        out[name] = (f.offset, f.size)
        if issubclass(t, ctypes.Structure) and t is not RecMatrix:
            for sub, _ in t._fields_:
                m = getattr(t, sub)
                out[f"{name}.{sub}"] = (f.offset + m.offset, m.size)
    for name, _ in RecMatrix._fields_:
        m = getattr(RecMatrix, name)
        out[f"matrix.{name}"] = (m.offset, m.size)
    out |= {f"flag.{k}": (v, 0) for k, v in RECORD_FLAGS.items()}
    return out | {f"variant.{k.value}": (v, 0) for k, v in VARIANTS.items()}


_i32, _p, _f = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
_rec = ctypes.POINTER(LayerRecord)
# every function's ctypes signature: (argument types, result type)
SIGNATURES = {
    "pp_abi_version": ([], _i32),
    "pp_simd_level": ([], _i32),
    "pp_layer_record_len": ([], _i32),  # ctypes.sizeof(LayerRecord)
    "pp_dtype_code": ([_i32], _i32),  # ggml type id -> dtype code, or -1
    # i, &name, &offset, &size -> the number of record table entries (kernel_build.check_codes)
    "pp_layer_record_field": (
        [_i32, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_i64), ctypes.POINTER(_i64)],
        _i32,
    ),
    # dtype, W, ld, nrows, cols, x, idx, k, out, act, nthreads
    "pp_gather_gemv": ([_i32, _p, _i64, _i64, _i64, _p, _p, _i64, _p, _i32, _i32], _i32),
    # dtype, W, ld, nrows, cols, h, idx, k, out, accumulate, nthreads
    "pp_gather_axpy": ([_i32, _p, _i64, _i64, _i64, _p, _p, _i64, _p, _i32, _i32], _i32),
    "pp_rows_sum": ([_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i32], _i32),  # ... h, T, out
    # dtype, G, ldg, U, ldu, nrows, cols, x, idx, k, variant, out, act, nthreads
    "pp_glu_gemv": (
        [_i32, _p, _i64, _p, _i64, _i64, _i64, _p, _p, _i64, _i32, _p, _i32, _i32],
        _i32,
    ),
    # dtype, W, ld, nrows, cols, x, ldx, T, out, ldo, need, act, nthreads
    "pp_gemm": ([_i32, _p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64, _p, _i32, _i32], _i32),
    # dtype, W, ld, nrows, cols, idx, k, out, nthreads
    "pp_dequant_rows": ([_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i32], _i32),
    "pp_stream_read": ([_p, _i64, _i32], ctypes.c_double),  # buffer, bytes, nthreads
    # W, ld, nrows, cols, out, unpack, nthreads -> the interleaved dtype code or -1
    "pp_repack_x8": ([_i32, _p, _i64, _i64, _i64, _p, _i32, _i32], _i32),
    # record, n_head, n_kv, head_dim, n_rot, eps, rot, x, k, v, cache dtype, pos, out, act, nthr
    "pp_attn_decode": (
        [_rec, _i64, _i64, _i64, _i64, _f, _p, _p, _p, _p, _i32, _i64, _p, _i32, _i32],
        _i32,
    ),
    # record, eps, thr, residual, source, out, act, nthreads
    "pp_ffn_decode": ([_rec, _f, _f, _p, _p, _p, _i32, _i32], _i64),
    # layers, records, rots, n_head, n_kv, head_dim, n_rot, eps, k, v, layer bytes, cache dtype,
    # pos, thr, x, counts, phases, n_phases, act, nthreads (powerpy.model.stack_decode: one
    # token, all blocks)
    "pp_decode_layers": (
        [
            _i64,
            _rec,
            _p,
            *[_i64] * 4,
            _f,
            _p,
            _p,
            _i64,
            _i32,
            _i64,
            _f,
            *[_p] * 3,
            _i64,
            _i32,
            _i32,
        ],
        _i32,
    ),
    # llama.cpp's float steps (called by powerpy.model.ggml_numerics)
    "pp_rope_table": ([_p, _i64, _i64, _f, _p], None),  # positions, n, n_rot, base, out
    # positions, n, n_rot, base, freq_scale, factors (or NULL), mscale, out
    "pp_rope_table_ext": ([_p, _i64, _i64, _f, _f, _p, _f, _p], None),
    # … , mscale, ext_factor, n_ctx_orig, beta_fast, beta_slow, out (YaRN)
    "pp_rope_table_yarn": ([_p, _i64, _i64, _f, _f, _p, _f, _f, _i64, _f, _f, _p], None),
    # x, T, heads, head_dim, n_rot, rot, neox
    "pp_rope": ([_p, _i64, _i64, _i64, _i64, _p, _i32], None),
    # q, k cache, v cache, p0, T, n_head, n_kv, head_dim, out, nthreads
    "pp_attn": ([_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _p, _i32], _i32),
    # … , scale, scale_q, softcap, window, out, nthreads
    "pp_attn_ext": ([_p, _p, _p, *[_i64] * 5, _f, _i32, _f, _i64, _p, _p, _i32], _i32),  # … sinks
    # q, cache, p0, T, n_head, hk, hv, scale, out, nthreads (MLA's latent attention)
    "pp_attn_mla": ([_p, _p, *[_i64] * 5, _f, _p, _i32], _i32),
    "pp_layer_norm": ([_p, _p, _p, _i64, _i64, _f, _p, _i32], None),  # x, w, b, T, n, eps, y, nt
    "pp_gelu": ([_p, _i64, _p, _i32, _i32], None),  # x, n, y, act, nthreads
    "pp_rms_norm": ([_p, _p, _i64, _i64, _f, _p, _i32], None),  # x, w, T, n, eps, y, nthreads
    "pp_softcap": ([_p, _i64, _f], None),  # x (in place), n, cap
    "pp_gelu_table": ([_p], None),  # out (65536 f16 bit patterns)
    "pp_swiglu": ([_p, _p, _i64, _p, _i32], None),  # g, u, n, out, nthreads
    "pp_soft_max": ([_p, _i64, _i64, _p], None),  # x, rows, n, out (the MoE router)
    "pp_silu_div": ([_p, _i64, _p], None),  # x, n, out (a shared expert's gate)
    # W, ld, nrows, cols, x, T, out, nthreads: f32 rows in tinyBLAS's order (the MoE router)
    "pp_gemm_f32_gw": ([_p, _i64, _i64, _i64, _p, _i64, _p, _i32], _i32),
    # mats (8 RecMatrix), k, norm, scale, route, tau, resid, norm w, eps, out, ids, wts, act,
    # nthreads
    "pp_moe_decode": (
        [_p, _i64, _i32, _f, ctypes.POINTER(RecRoute), _p, _p, _p, _f, _p, _p, _p, _i32, _i32],
        _i64,
    ),
    "pp_sigmoid": ([_p, _i64, _p], None),  # x, n, out (a sigmoid routing)
    "pp_swiglu_oai": ([_p, _p, _i64, _p], None),  # g, u, n, out (GPT-OSS's experts)
    "pp_moe_cut": ([_p, _i64, _i64, _i64, _p, _p, _p], None),  # h, T, n, group, w, tau, idx
    # dtype, W, ld, nrows, cols, h, T, out, act, nthreads: a cut's down product (kept groups)
    "pp_down_runs": ([_i32, _p, _i64, _i64, _i64, _p, _i64, _p, _i32, _i32], _i32),
}
