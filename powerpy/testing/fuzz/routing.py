"""Mutations of DeepSeek-style mixtures for the load-path fuzzer (family "moe"): what GLM-4.5's
``glm4moe`` files add to a mixture (the gating function, expert groups, leading dense and NextN
layers, the routing's selection bias ``exp_probs_b``, shared experts counted by
``expert_shared_count``), and their seed cases. Drafts are ``experts.moe_draft``'s."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from powerpy.formats.constants import GGUFValueType as V
from powerpy.formats.constants import Keys, Names
from powerpy.testing.fuzz.experts import (
    F32,
    MOE_SPECS,
    _f32,
    _layer,
    _set,
    drop_tensor,
    moe_archs,
    put_key,
    set_key,
)
from powerpy.testing.fuzz.files import INTS, SIGNED, Draft, Tensor, mutation, pick

UNGATED_SHARED = (Names.FFN_GATE_SHEXP, Names.FFN_UP_SHEXP, Names.FFN_DOWN_SHEXP)


@mutation("moe")
@moe_archs("glm4moe")
def gating(d: Draft, rng: np.random.Generator) -> str:
    """expert_gating_func another function, unknown, huge or not an integer; expert groups
    that split the experts unevenly, too small, more used than there are, or gone."""
    which = int(rng.integers(3))
    if which == 0:
        codes = [(c, V.UINT32) for c in (0, 1, 3, 4)]
        key = Keys.EXPERT_GATING_FUNC
        spec = pick(rng, [*codes, (pick(rng, INTS), V.UINT64), ("2", V.STRING)])
    elif which == 1:
        key, spec = (
            Keys.EXPERT_GROUP_COUNT,
            pick(
                rng,
                [
                    (2, V.UINT32),
                    (3, V.UINT32),
                    (4, V.UINT32),
                    (pick(rng, INTS), V.UINT64),
                    (pick(rng, SIGNED), V.INT32),
                ],
            ),
        )
        d.kv[d.key(Keys.EXPERT_GROUP_USED_COUNT)] = pick(rng, [(1, V.UINT32), (2, V.UINT32)])
    else:
        d.kv[d.key(Keys.EXPERT_GROUP_COUNT)] = (2, V.UINT32)
        key, spec = (
            Keys.EXPERT_GROUP_USED_COUNT,
            pick(rng, [(0, V.UINT32), (1, V.UINT32), (3, V.UINT32), (pick(rng, INTS), V.UINT64)]),
        )
    d.kv[d.key(key)] = spec
    return f"{key.split('.')[-1]} = {spec[0]!r}"


@mutation("moe")
@moe_archs("glm4moe")
def layer_counts(d: Draft, rng: np.random.Generator) -> str:
    """leading_dense_block_count or nextn_predict_layers 0, more, all, huge, negative or gone."""
    key = pick(rng, (Keys.LEADING_DENSE_BLOCK_COUNT, Keys.NEXTN_PREDICT_LAYERS))
    spec = pick(
        rng,
        [
            (0, V.UINT32),
            (2, V.UINT32),
            (3, V.UINT32),
            (4, V.UINT32),
            (pick(rng, INTS), V.UINT64),
            (pick(rng, SIGNED), V.INT32),
            None,
        ],
    )
    return put_key(d, key, spec)


@mutation("moe")
@moe_archs("glm4moe", "qwen3moe")
def selection_bias(d: Draft, rng: np.random.Generator) -> str:
    """The routing's selection bias missing, cut, as a (1, n) row, non-finite, in a leading dense
    layer, or in a family without one (qwen3moe)."""
    l = _layer(rng, d)
    name = Names.EXP_PROBS_B.format(l=l)
    if d.arch != "glm4moe" or rng.random() < 0.15:
        at = Names.EXP_PROBS_B.format(l=0 if d.arch == "glm4moe" else l)
        a = np.zeros(MOE_SPECS[d.arch].n_expert, np.float32)
        d.tensors.append(Tensor(at, a, F32, a.shape))
        return f"an {at} where none belongs"
    t = d.tensor(name)
    a = _f32(t)
    how = int(rng.integers(4))
    if how == 0:
        d.tensors.remove(t)
        return f"no {name}"
    if how == 1:
        b = a[None] if rng.integers(2) else a[:-1]
    elif how == 2:
        b = a.copy()
        b[int(rng.integers(b.size))] = pick(rng, (np.nan, np.inf, 1e30))
    else:
        b = np.concatenate([a, a])
    _set(t, np.ascontiguousarray(b))
    return f"{name} {a.shape} -> {b.shape}"


@mutation("moe")
@moe_archs("glm4moe")
def shared_count(d: Draft, rng: np.random.Generator) -> str:
    """expert_shared_count 0, 2, huge or gone; a shared expert's tensor missing or cut; or a
    gate row (qwen2moe's) where the shared expert has none."""
    how = int(rng.integers(4))
    if how == 0:
        spec = pick(rng, [(0, V.UINT32), (2, V.UINT32), (pick(rng, INTS), V.UINT64), None])
        key = d.key(Keys.EXPERT_SHARED_COUNT)
        if spec is None:
            del d.kv[key]
            return "no expert_shared_count"
        d.kv[key] = spec
        return f"expert_shared_count = {spec[0]!r}"
    name = pick(rng, UNGATED_SHARED).format(l=_layer(rng, d))
    t = d.tensor(name)
    if how == 1:
        d.tensors.remove(t)
        return f"no {name}"
    if how == 2:
        a = _f32(t)
        _set(t, a[: a.shape[0] // 2])
        return f"{name} cut"
    a = np.zeros(MOE_SPECS[d.arch].n_embd, np.float32)
    row = Names.FFN_GATE_INP_SHEXP.format(l=_layer(rng, d))
    d.tensors.append(Tensor(row, a, F32, a.shape))
    return f"an {row}"


# --- seed cases -----------------------------------------------------------------------------------
# name -> (arch, fn); messages in tests/test_fuzz_path.py
ROUTING_SEEDS: dict[str, tuple[str, Callable[[Draft], None]]] = {
    "moe_gating_unknown": ("glm4moe", set_key(Keys.EXPERT_GATING_FUNC, (4, V.UINT32))),
    "moe_groups_uneven": ("glm4moe", set_key(Keys.EXPERT_GROUP_COUNT, (3, V.UINT32))),
    "moe_probs_bias_missing": ("glm4moe", drop_tensor(Names.EXP_PROBS_B.format(l=2))),
    "moe_dense_lead_over_layers": (
        "glm4moe",
        set_key(Keys.LEADING_DENSE_BLOCK_COUNT, (5, V.UINT32)),
    ),
}
