"""RoPE scaling as llama.cpp reads and applies it: none, linear, or YaRN (``rope.scaling.type``
"yarn"), and the factor YaRN scales cos and sin by (llama.cpp's ``yarn_attn_factor``).

YaRN (ggml's ``rope_yarn``): pair i of n_rot/2 turns by θ_i·p interpolated between its
extrapolated angle θ_e = θ_i·p / factor_i and its interpolated one θ_e / scale, by a ramp that is
1 below the dims ``corr_dims`` puts low and 0 above the high one, times ``ext_factor``; cos and
sin are multiplied by ``yarn_attn_factor`` · (1 + 0.1·ln(scale)). llama.cpp sets that factor so
the product is the YaRN magnitude ``get_mscale(scale, …)``: ``attn_factor`` below. DeepSeek-2
also scales its attention scores by the square of the magnitude its ``yarn_log_multiplier``
gives (``mla_kq_scale``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from powerpy.errors import ModelConfigError, shown
from powerpy.formats.constants import Keys

SCALINGS = ("none", "linear", "yarn")
F32 = np.float32
_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_LIBM.logf.argtypes, _LIBM.logf.restype = [ctypes.c_float], ctypes.c_float


def _logf(x) -> F32:
    """libm's logf, as llama.cpp calls it (glibc's, not numpy's or double's rounded)."""
    return F32(_LIBM.logf(float(x)))


def read_scaling(kv: Mapping[str, Any], get: Callable[..., Any], arch: str, source: str) -> dict:
    """The ``ModelArgs`` fields of a file's RoPE scaling (``get`` reads a key by template with
    a default; family-only keys it ignores for families that do not read them).

    Raises:
        ModelConfigError: an unknown scaling type.
    """
    key = Keys.ROPE_SCALING_TYPE.format(arch=arch)
    scaling = kv.get(key, "linear")  # llama.cpp: no type is "linear", a factor of 0 is none
    if not isinstance(scaling, str) or scaling not in SCALINGS:
        raise ModelConfigError(
            f"{source}: {key} is {shown(scaling)}; powerpy runs "
            f"{', '.join(repr(s) for s in SCALINGS)} RoPE scaling"
        )
    factor = get(Keys.ROPE_SCALING_FACTOR, 0.0, float) if scaling != "none" else 0.0
    out: dict[str, Any] = {"rope_scale": factor or 1.0}
    if scaling == "yarn":
        ext = get(Keys.ROPE_SCALING_YARN_EXT_FACTOR, -1.0, float)
        out["rope_ext_factor"] = ext if ext >= 0 else 1.0  # negative: not set
        out["rope_yarn_beta_fast"] = get(Keys.ROPE_SCALING_YARN_BETA_FAST, 32.0, float)
        out["rope_yarn_beta_slow"] = get(Keys.ROPE_SCALING_YARN_BETA_SLOW, 1.0, float)
        # the converter stores 0.1 · mscale_all_dims; llama.cpp divides it out in f32
        log_mul = get(Keys.ROPE_SCALING_YARN_LOG_MUL, 0.0, float)
        out["rope_yarn_log_mul"] = float(F32(log_mul) / F32(0.1))
    return out


def scaling_kv(a: Any) -> dict:
    """The RoPE scaling keys of ``ModelArgs`` ``a`` (``to_gguf_kv``'s share)."""
    from powerpy.formats.constants import GGUFValueType

    f32, arch, kv = GGUFValueType.FLOAT32, a.arch, {}
    if a.rope_scale != 1.0 or a.rope_ext_factor:
        kind = "yarn" if a.rope_ext_factor else "linear"
        kv[Keys.ROPE_SCALING_TYPE.format(arch=arch)] = (kind, GGUFValueType.STRING)
        kv[Keys.ROPE_SCALING_FACTOR.format(arch=arch)] = (a.rope_scale, f32)
    if a.rope_ext_factor:
        optional = (
            (Keys.ROPE_SCALING_YARN_EXT_FACTOR, a.rope_ext_factor, 1.0),
            (Keys.ROPE_SCALING_YARN_BETA_FAST, a.rope_yarn_beta_fast, 32.0),
            (Keys.ROPE_SCALING_YARN_BETA_SLOW, a.rope_yarn_beta_slow, 1.0),
            (Keys.ROPE_SCALING_YARN_LOG_MUL, float(F32(a.rope_yarn_log_mul) * F32(0.1)), 0.0),
        )
        for key, value, unset in optional:
            if value != unset:
                kv[key.format(arch=arch)] = (value, f32)
    return kv


def _mscale(scale: F32, m: F32) -> F32:
    """llama.cpp's get_mscale: 1 for scale <= 1, else 0.1·m·ln(scale) + 1, in f32."""
    return F32(1.0) if scale <= 1 else F32(F32(F32(0.1) * m) * _logf(scale)) + F32(1.0)


def attn_factor(a: Any) -> float:
    """llama.cpp's ``yarn_attn_factor`` for ``ModelArgs`` ``a``: the file's
    ``rope.scaling.attn_factor``, and with YaRN the magnitude ``get_mscale`` (over DeepSeek-2's
    log-multiplied one where it has that) divided by the (1 + 0.1·ln(scale)) ggml's ``rope_yarn``
    multiplies back, in f32."""
    af = F32(1.0)
    if a.rope_ext_factor:
        factor = F32(1.0) / F32(F32(1.0) / F32(a.rope_scale))
        log_mul = F32(a.rope_yarn_log_mul)
        if log_mul != 0:
            m = log_mul if a.arch == "deepseek2" and log_mul != 1 else F32(1.0)
            af = _mscale(factor, m) / _mscale(factor, log_mul)
        else:
            af = _mscale(factor, F32(1.0))
        af = F32(af * F32(F32(1.0) / F32(F32(1.0) + F32(F32(0.1) * _logf(factor)))))
    return float(F32(af * F32(a.rope_attn_factor)))


def mla_kq_scale(a: Any, head_k: int) -> float:
    """DeepSeek-2's attention score scale: mscale² / sqrt(head_k), mscale the YaRN magnitude of
    its log multiplier (llama.cpp's deepseek2 graph, after it cancels ``attn_factor``'s
    adjustment), in f32."""
    af, fs = F32(attn_factor(a)), F32(F32(1.0) / F32(a.rope_scale))
    ln = _logf(F32(F32(1.0) / fs))
    org = F32(af * F32(F32(1.0) + F32(F32(0.1) * ln)))
    ms = F32(org * F32(F32(1.0) + F32(F32(F32(0.1) * F32(a.rope_yarn_log_mul)) * ln)))
    return float(F32(F32(F32(1.0) * ms) * ms) / F32(math.sqrt(F32(head_k))))
