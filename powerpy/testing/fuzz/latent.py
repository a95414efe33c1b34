"""Mutations of DeepSeek-2 files for the load-path fuzzer (family "moe"): the latent attention's
keys (its ranks and head widths) and tensors (q's low-rank pair or a plain q, the latent, the
per-head maps or the fused ``attn_kv_b``), and YaRN's keys; with their seed cases. Drafts are
``experts.moe_draft``'s."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from powerpy.formats.constants import GGUFValueType as V
from powerpy.formats.constants import Keys, Names
from powerpy.testing.fuzz.experts import (
    F32,
    MOE_SPECS,
    _f32,
    _set,
    drop_tensor,
    moe_archs,
    put_key,
    set_key,
)
from powerpy.testing.fuzz.files import FLOATS, INTS, SIGNED, Draft, Tensor, mutation, pick

LATENT_KEYS = (
    Keys.Q_LORA_RANK,
    Keys.KV_LORA_RANK,
    Keys.KEY_LENGTH_MLA,
    Keys.VALUE_LENGTH_MLA,
    Keys.ROPE_DIMENSION_COUNT,
)
LATENT = (
    Names.ATTN_Q_A,
    Names.ATTN_Q_A_NORM,
    Names.ATTN_Q_B,
    Names.ATTN_KV_A_MQA,
    Names.ATTN_KV_A_NORM,
    Names.ATTN_K_B,
    Names.ATTN_V_B,
    Names.ATTN_OUTPUT,
)
YARN_KEYS = (
    Keys.ROPE_SCALING_FACTOR,
    Keys.ROPE_SCALING_YARN_EXT_FACTOR,
    Keys.ROPE_SCALING_YARN_BETA_FAST,
    Keys.ROPE_SCALING_YARN_BETA_SLOW,
    Keys.ROPE_SCALING_YARN_LOG_MUL,
    Keys.ROPE_SCALING_ORIG_CTX,
)


@mutation("moe")
@moe_archs("deepseek2")
def latent_keys(d: Draft, rng: np.random.Generator) -> str:
    """A latent rank or head width 0, smaller than the RoPE dims, another width, huge,
    negative, not an integer, or gone."""
    key = pick(rng, LATENT_KEYS)
    spec = pick(
        rng,
        [
            (0, V.UINT32),
            (4, V.UINT32),
            (8, V.UINT32),
            (24, V.UINT32),
            (pick(rng, INTS), V.UINT64),
            (pick(rng, SIGNED), V.INT32),
            (16.0, V.FLOAT32),
            None,
        ],
    )
    return put_key(d, key, spec)


@mutation("moe")
@moe_archs("deepseek2")
def latent_tensors(d: Draft, rng: np.random.Generator) -> str:
    """A latent attention tensor missing, transposed, cut or non-finite; a plain attn_q or a
    fused attn_kv_b beside the low-rank and split ones."""
    l = int(rng.integers(3))
    how = int(rng.integers(5))
    if how == 4:
        spec = MOE_SPECS[d.arch]
        rows, name = pick(
            rng, ((spec.n_head * 24, Names.ATTN_Q), (spec.n_head * 32, Names.ATTN_KV_B))
        )
        a = np.zeros((rows, 32 if name == Names.ATTN_Q else 16), np.float32)
        d.tensors.append(Tensor(name.format(l=l), a, F32, a.shape))
        return f"an {name.format(l=l)} beside the other layout"
    name = pick(rng, LATENT).format(l=l)
    t = d.tensor(name)
    a = _f32(t)
    if how == 0:
        d.tensors.remove(t)
        return f"no {name}"
    if how == 1:
        b = a.T if a.ndim == 2 else a.transpose(0, 2, 1) if a.ndim == 3 else a[None]
    elif how == 2:
        b = a[: max(a.shape[0] // 2, 1)]
    else:
        b = a.copy()
        b.flat[int(rng.integers(b.size))] = pick(rng, (np.nan, np.inf, 1e30))
    _set(t, np.ascontiguousarray(b))
    return f"{name} {a.shape} -> {b.shape}"


@mutation("moe")
@moe_archs("deepseek2", "glm4moe")
def yarn(d: Draft, rng: np.random.Generator) -> str:
    """YaRN scaling with its factor, extrapolation mix, betas, log multiplier or original
    context odd: 0, negative, huge, NaN, or another type."""
    d.kv[d.key(Keys.ROPE_SCALING_TYPE)] = ("yarn", V.STRING)
    key = pick(rng, YARN_KEYS)
    if key == Keys.ROPE_SCALING_ORIG_CTX:
        spec = pick(rng, [(0, V.UINT32), (1, V.UINT32), (pick(rng, INTS), V.UINT64)])
    else:
        spec = pick(rng, [(pick(rng, FLOATS), V.FLOAT32), (40.0, V.FLOAT32), ("4", V.STRING)])
    d.kv[d.key(key)] = spec
    return f"yarn, {key.split('.')[-1]} = {spec[0]!r}"


# --- seed cases -----------------------------------------------------------------------------------
# name -> (arch, fn); messages in tests/test_fuzz_path.py
LATENT_SEEDS: dict[str, tuple[str, Callable[[Draft], None]]] = {
    "mla_k_b_missing": ("deepseek2", drop_tensor(Names.ATTN_K_B.format(l=1))),
    "mla_kv_lora_rank_zero": ("deepseek2", set_key(Keys.KV_LORA_RANK, (0, V.UINT32))),
    "mla_key_length_too_small": ("deepseek2", set_key(Keys.KEY_LENGTH_MLA, (8, V.UINT32))),
}
