"""Mixtures of experts as family data: the tensors of a MoE FFN (``EXPERTS``, llama.cpp's names
and layout), a shared expert's (``SHARED_EXPERT``), and the hyperparameters that go with them
(``ModelArgs``'s ``n_expert``, ``n_expert_used``, ``n_ff_exp``, ``expert_norm``,
``expert_scale``, ``n_ff_shexp``; docs/moe.md)."""

from __future__ import annotations

import math
from typing import Any

from powerpy.errors import ModelConfigError
from powerpy.families.base import Family, LayerTensor
from powerpy.formats.constants import Keys, Names

# The router, then each expert's gate, up and down matrices stacked (llama.cpp's
# build_moe_ffn); the down stack as llama.cpp stores it, (n_embd, n_ff_exp) per expert.
EXPERTS = (
    LayerTensor("ffn_gate_inp", Names.FFN_GATE_INP, ("n_expert", "n_embd")),
    LayerTensor("ffn_gate_exps", Names.FFN_GATE_EXPS, ("n_expert", "n_ff_exp", "n_embd")),
    LayerTensor("ffn_up_exps", Names.FFN_UP_EXPS, ("n_expert", "n_ff_exp", "n_embd")),
    LayerTensor("ffn_down_exps", Names.FFN_DOWN_EXPS, ("n_expert", "n_embd", "n_ff_exp")),
)

# A shared expert (qwen2moe, llama.cpp's "shexp"): a SwiGLU FFN every token runs beside its
# routed experts, its output scaled by sigmoid(ffn_gate_inp_shexp · x). ``Block`` fields, so the
# dense pass of a placement moves them like any other matrix.
SHARED_EXPERT = (
    LayerTensor("ffn_gate_inp_shexp", Names.FFN_GATE_INP_SHEXP, ("n_embd",)),
    LayerTensor("ffn_gate_shexp", Names.FFN_GATE_SHEXP, ("n_ff_shexp", "n_embd")),
    LayerTensor("ffn_up_shexp", Names.FFN_UP_SHEXP, ("n_ff_shexp", "n_embd")),
    LayerTensor("ffn_down_shexp", Names.FFN_DOWN_SHEXP, ("n_embd", "n_ff_shexp")),
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
    shared = {}
    if fam.shared_expert:  # llama.cpp: n_ff without the key
        key = Keys.EXPERT_SHARED_FEED_FORWARD_LENGTH
        shared["n_ff_shexp"] = get(key, get(Keys.FEED_FORWARD_LENGTH))
    return dict(
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=n_ff_exp,
        expert_norm=norm,
        expert_scale=get(Keys.EXPERT_WEIGHTS_SCALE, 0.0, float),
        **shared,
    )


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
    if a.family.shared_expert and a.n_ff_shexp <= 0:
        key = Keys.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=a.arch)
        raise ModelConfigError(
            f"{source}: {key} is {a.n_ff_shexp}, the shared expert's width must be > 0; "
            "re-convert the model"
        )
    if not math.isfinite(a.expert_scale) or a.expert_scale < 0:
        raise ModelConfigError(
            f"{source}: expert_weights_scale is {a.expert_scale}, it must be a finite number "
            ">= 0 (0: none)"
        )
