"""Mixtures of experts as family data: the tensors of a MoE FFN (``EXPERTS``, llama.cpp's names
and layout), a shared expert's (``SHARED_EXPERT``), and the hyperparameters that go with them
(``ModelArgs``'s ``n_expert``, ``n_expert_used``, ``n_ff_exp``, ``expert_norm``,
``expert_scale``, ``n_ff_shexp``; docs/moe.md)."""

from __future__ import annotations

import math
from typing import Any

from powerpy.errors import ModelConfigError
from powerpy.families.base import GATINGS, Family, LayerTensor
from powerpy.formats.constants import GGUFValueType, Keys, Names

# The router, then each expert's gate, up and down matrices stacked (llama.cpp's
# build_moe_ffn); the down stack as llama.cpp stores it, (n_embd, n_ff_exp) per expert.
EXPERTS = (
    LayerTensor("ffn_gate_inp", Names.FFN_GATE_INP, ("n_expert", "n_embd")),
    LayerTensor("ffn_gate_exps", Names.FFN_GATE_EXPS, ("n_expert", "n_ff_exp", "n_embd")),
    LayerTensor("ffn_up_exps", Names.FFN_UP_EXPS, ("n_expert", "n_ff_exp", "n_embd")),
    LayerTensor("ffn_down_exps", Names.FFN_DOWN_EXPS, ("n_expert", "n_embd", "n_ff_exp")),
)

# The routing's selection bias (DeepSeek-V3, GLM-4.5): added to the probabilities that choose
# the experts, not to their weights; ``moe.Experts.probs_b``
PROBS_BIAS = LayerTensor("exp_probs_b", Names.EXP_PROBS_B, ("n_expert",))

# A shared expert (qwen2moe, llama.cpp's "shexp"): a SwiGLU FFN every token runs beside its
# routed experts, its output scaled by sigmoid(ffn_gate_inp_shexp · x). ``Block`` fields, so the
# dense pass of a placement moves them like any other matrix.
SHARED_EXPERT = (
    LayerTensor("ffn_gate_inp_shexp", Names.FFN_GATE_INP_SHEXP, ("n_embd",)),
    LayerTensor("ffn_gate_shexp", Names.FFN_GATE_SHEXP, ("n_ff_shexp", "n_embd")),
    LayerTensor("ffn_up_shexp", Names.FFN_UP_SHEXP, ("n_ff_shexp", "n_embd")),
    LayerTensor("ffn_down_shexp", Names.FFN_DOWN_SHEXP, ("n_embd", "n_ff_shexp")),
)
# … and one whose output is added unscaled (glm4moe, deepseek2): no gate row
UNGATED_SHARED_EXPERT = SHARED_EXPERT[1:]
# the keys llama.cpp's loader requires of a DeepSeek-style mixture (glm4moe, deepseek2)
SHARED_BY_COUNT_KEYS = frozenset(
    {
        Keys.EXPERT_COUNT,
        Keys.EXPERT_USED_COUNT,
        Keys.EXPERT_SHARED_COUNT,
        Keys.EXPERT_FEED_FORWARD_LENGTH,
    }
)


def expert_args(fam: Family, n_expert: int, sparse: bool, get, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of ``ModelArgs`` from a file's keys (``get`` reads one
    by template, with a default); {} for a dense FFN.

    Raises:
        ModelConfigError: experts in a family without them, none in a family that needs them,
            or experts in a PWRI file.
    """
    key = Keys.EXPERT_COUNT.format(arch=fam.arch)
    if n_expert and not fam.experts:
        raise ModelConfigError(
            f"{source}: {key} is {n_expert}, but {fam.arch} models have no experts; remove the "
            "key or re-convert the model"
        )
    if fam.moe_required and n_expert <= 0:
        raise ModelConfigError(
            f"{source}: {fam.arch} is a mixture of experts, but {key} is {n_expert}: it must be "
            "> 0; re-convert the model"
        )
    if n_expert == 0:
        return {}
    if sparse:
        raise ModelConfigError(
            f"{source}: a PowerInfer (PWRI) file with {n_expert} experts: powerpy runs "
            "mixture-of-experts models from GGUF files (routing is their sparsity, the cut "
            "their neuron sparsity); convert the model to GGUF"
        )
    n_used = get(Keys.EXPERT_USED_COUNT, 0)
    if fam.expert_ff_key is None:
        n_ff_exp = get(Keys.FEED_FORWARD_LENGTH)
    else:  # llama.cpp: n_ff / n_expert_used without the key
        n_ff_exp = get(fam.expert_ff_key, max(get(Keys.FEED_FORWARD_LENGTH) // max(n_used, 1), 0))
    norm = get(Keys.EXPERT_WEIGHTS_NORM, True, bool)
    shared: dict[str, Any] = {}
    if fam.shared_expert and fam.shared_by_count:  # n_ff_exp wide per shared expert
        shared["n_expert_shared"] = get(Keys.EXPERT_SHARED_COUNT, 0)
        shared["n_ff_shexp"] = n_ff_exp * shared["n_expert_shared"]
    elif fam.shared_expert:  # llama.cpp: n_ff without the key
        key = Keys.EXPERT_SHARED_FEED_FORWARD_LENGTH
        shared["n_ff_shexp"] = get(key, get(Keys.FEED_FORWARD_LENGTH))
    code = get(Keys.EXPERT_GATING_FUNC, 0)
    if code not in (0, *GATINGS):
        key = Keys.EXPERT_GATING_FUNC.format(arch=fam.arch)
        raise ModelConfigError(
            f"{source}: {key} is {code}; powerpy routes by "
            f"{', '.join(f'{k} ({v})' for k, v in GATINGS.items())}, or 0 (the family's)"
        )
    return dict(
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=n_ff_exp,
        expert_norm=norm,
        expert_scale=get(Keys.EXPERT_WEIGHTS_SCALE, 0.0, float),
        expert_gating=GATINGS.get(code, fam.expert_gating),
        n_expert_groups=get(Keys.EXPERT_GROUP_COUNT, 0),
        n_group_used=get(Keys.EXPERT_GROUP_USED_COUNT, 0),
        n_layer_dense=get(Keys.LEADING_DENSE_BLOCK_COUNT, 0),
        **shared,
    )


def expert_kv(a: Any) -> dict:
    """The mixture-of-experts keys of ``ModelArgs`` ``a`` (``to_gguf_kv``'s share): what
    :func:`expert_args` reads back as ``a``'s values."""
    u32, f32, arch, fam = GGUFValueType.UINT32, GGUFValueType.FLOAT32, a.arch, a.family
    kv = {
        Keys.EXPERT_COUNT.format(arch=arch): (a.n_expert, u32),
        Keys.EXPERT_USED_COUNT.format(arch=arch): (a.n_expert_used, u32),
    }
    if fam.expert_ff_key is not None:
        kv[fam.expert_ff_key.format(arch=arch)] = (a.n_ff_exp, u32)
    defaults = dict(fam.key_defaults)
    if a.expert_norm != defaults.get(Keys.EXPERT_WEIGHTS_NORM, True):
        kv[Keys.EXPERT_WEIGHTS_NORM.format(arch=arch)] = (a.expert_norm, GGUFValueType.BOOL)
    optional = (  # (key, value, unset, type): written when set
        (Keys.EXPERT_WEIGHTS_SCALE, a.expert_scale, 0.0, f32),
        (Keys.EXPERT_GROUP_COUNT, a.n_expert_groups, 0, u32),
        (Keys.EXPERT_GROUP_USED_COUNT, a.n_group_used, 0, u32),
        (Keys.LEADING_DENSE_BLOCK_COUNT, a.n_layer_dense, 0, u32),
        (Keys.EXPERT_SHARED_COUNT, a.n_expert_shared, 0, u32),
    )
    for key, value, unset, kind in optional:
        if value != unset:
            kv[key.format(arch=arch)] = (value, kind)
    if a.n_ff_shexp and not fam.shared_by_count:
        kv[Keys.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=arch)] = (a.n_ff_shexp, u32)
    if a.expert_gating != fam.expert_gating:
        code = next(k for k, v in GATINGS.items() if v == a.expert_gating)
        kv[Keys.EXPERT_GATING_FUNC.format(arch=arch)] = (code, u32)
    return kv


def check_experts(a: Any, source: str) -> None:
    """Raise ``ModelConfigError`` for expert counts or widths that make no mixture."""
    keys = (Keys.EXPERT_COUNT, Keys.EXPERT_USED_COUNT)
    count, used = (k.format(arch=a.arch) for k in keys)
    if not 0 < a.n_expert_used <= a.n_expert:
        raise ModelConfigError(
            f"{source}: {used} is {a.n_expert_used}, it must be between 1 and {count} "
            f"({a.n_expert}); the file's keys are corrupt: re-convert the model"
        )
    if a.n_ff_exp <= 0:
        raise ModelConfigError(
            f"{source}: the experts' FFN width is {a.n_ff_exp}, it must be > 0; re-convert the "
            "model"
        )
    if a.family.shared_by_count and a.n_expert_shared <= 0:
        key = Keys.EXPERT_SHARED_COUNT.format(arch=a.arch)
        raise ModelConfigError(
            f"{source}: {key} is {a.n_expert_shared}; {a.arch} runs at least one shared expert: "
            "re-convert the model"
        )
    if a.family.shared_expert and a.n_ff_shexp <= 0:
        key = Keys.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=a.arch)
        raise ModelConfigError(
            f"{source}: {key} is {a.n_ff_shexp}, the shared expert's width must be > 0; "
            "re-convert the model"
        )
    if not 0 <= a.n_layer_dense <= a.n_layer:
        key = Keys.LEADING_DENSE_BLOCK_COUNT.format(arch=a.arch)
        raise ModelConfigError(
            f"{source}: {key} is {a.n_layer_dense}, it must be between 0 and the {a.n_layer} "
            "layers; re-convert the model"
        )
    groups, used_groups = a.n_expert_groups, a.n_group_used
    if groups > 1:  # llama.cpp ranks each group by its two best experts
        per = a.n_expert // groups
        if a.n_expert % groups or per < 2 or not 0 < used_groups <= groups:
            keys = (Keys.EXPERT_GROUP_COUNT, Keys.EXPERT_GROUP_USED_COUNT)
            gk, uk = (k.format(arch=a.arch) for k in keys)
            raise ModelConfigError(
                f"{source}: {gk} {groups} and {uk} {used_groups} do not fit {count} "
                f"({a.n_expert}): the groups must split the experts evenly, at least 2 in each, "
                "and 1 to all of them used; re-convert the model"
            )
        if used_groups * per < a.n_expert_used:
            raise ModelConfigError(
                f"{source}: {used} is {a.n_expert_used}, more than the {used_groups * per} "
                f"experts of the {used_groups} groups a token may use; re-convert the model"
            )
    if not math.isfinite(a.expert_scale) or a.expert_scale < 0:
        raise ModelConfigError(
            f"{source}: expert_weights_scale is {a.expert_scale}, it must be a finite number "
            ">= 0 (0: none)"
        )
