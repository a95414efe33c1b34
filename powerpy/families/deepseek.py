"""DeepSeek-V2, V2-Lite, V3, R1 and Kimi-K2 (GGUF arch ``deepseek2``): multi-head latent attention
(MLA, ``model/mla.py``), then ``leading_dense_block_count`` dense layers and a mixture of experts
with shared experts (``expert_shared_count`` · ``expert_feed_forward_length`` wide, unscaled).

The attention, as llama.cpp's deepseek2 graph computes it: q from a low-rank pair (``attn_q_a``,
its RMSNorm ``attn_q_a_norm``, ``attn_q_b``) or, without ``attention.q_lora_rank`` (V2-Lite), a
plain ``attn_q``; each head's q splits into ``key_length_mla - n_rot`` dims without RoPE and
``n_rot`` turned in adjacent pairs. ``attn_kv_a_mqa`` gives the latent (``kv_lora_rank``, then
RMS-normed by ``attn_kv_a_norm``) and ``n_rot`` RoPE dims shared by every head; the KV cache
holds those ``kv_lora_rank + n_rot`` values per token, not the heads. Per head, ``attn_k_b``
maps its q into the latent (absorption), attention runs over the cache with one key head, and
``attn_v_b`` maps the weighted latent to the head's value; files of llama.cpp's first MLA
converter hold both maps fused in ``attn_kv_b`` instead (read as the same two, see
``model/mla.py``). YaRN (``rope.scaling.type`` "yarn") scales the RoPE and the scores, with
``rope.scaling.yarn_log_multiplier``.

The routing: softmax (V2) or, with ``expert_gating_func`` 2, a sigmoid with the selection bias
``exp_probs_b`` (V3, Kimi-K2), expert groups, ``expert_weights_norm`` and ``expert_weights_scale``
(``routing.py``). As llama.cpp does, a 26- or 27-layer file is a "lite" one: its
``attention.q_lora_rank`` is not read and q is a plain ``attn_q``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from powerpy.errors import ModelConfigError
from powerpy.families.base import Family, FFNVariant, LayerTensor, gated_ffn
from powerpy.families.experts import (
    EXPERTS,
    PROBS_BIAS,
    SHARED_BY_COUNT_KEYS,
    UNGATED_SHARED_EXPERT,
)
from powerpy.formats.constants import GGUFValueType, Keys, Names

LITE_LAYERS = (26, 27)  # llama.cpp: DeepSeek-V2-Lite, GigaChat3-10B-A1.8B

# The latent attention's tensors (``mla.Latent``'s fields); which of the optional ones a layer
# has follows q_lora_rank and kv_b (``mla.latent``)
MLA_BLOCK = (
    LayerTensor("attn_norm", Names.ATTN_NORM, ("n_embd",)),
    LayerTensor("attn_q_a", Names.ATTN_Q_A, ("q_lora_rank", "n_embd"), optional=True),
    LayerTensor("attn_q_a_norm", Names.ATTN_Q_A_NORM, ("q_lora_rank",), optional=True),
    LayerTensor("attn_q_b", Names.ATTN_Q_B, ("n_embd_mla_q", "q_lora_rank"), optional=True),
    LayerTensor("attn_q", Names.ATTN_Q, ("n_embd_mla_q", "n_embd"), optional=True),
    LayerTensor("attn_kv_a_mqa", Names.ATTN_KV_A_MQA, ("kv_a_rows", "n_embd")),
    LayerTensor("attn_kv_a_norm", Names.ATTN_KV_A_NORM, ("kv_lora_rank",)),
    LayerTensor("attn_k_b", Names.ATTN_K_B, ("n_head", "kv_lora_rank", "qk_nope"), optional=True),
    LayerTensor(
        "attn_v_b", Names.ATTN_V_B, ("n_head", "value_length_mla", "kv_lora_rank"), optional=True
    ),
    LayerTensor("attn_kv_b", Names.ATTN_KV_B, ("n_embd_kv_b", "kv_lora_rank"), optional=True),
    LayerTensor("attn_output", Names.ATTN_OUTPUT, ("n_embd", "n_embd_mla_v")),
    LayerTensor("ffn_norm", Names.FFN_NORM, ("n_embd",)),
    LayerTensor("ffn_gate", Names.FFN_GATE, ("n_ff", "n_embd")),  # the leading dense layers
    LayerTensor("ffn_up", Names.FFN_UP, ("n_ff", "n_embd")),
    *UNGATED_SHARED_EXPERT,
)


Q_LOW = ("attn_q_a", "attn_q_a_norm", "attn_q_b")  # q's low-rank pair (attn_q without it)
KV_SPLIT = ("attn_k_b", "attn_v_b")  # the latent's per-head maps (attn_kv_b fused)


def mla_layout(a: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The latent attention tensors (``Block`` fields) of ``ModelArgs`` ``a``'s layers, and
    those of the other layout they must not hold: q's low-rank pair or ``attn_q``
    (``q_lora_rank``), ``attn_k_b`` and ``attn_v_b`` or ``attn_kv_b`` (``kv_b``)."""
    need = (Q_LOW if a.q_lora_rank else ("attn_q",)) + (("attn_kv_b",) if a.kv_b else KV_SPLIT)
    other = (("attn_q",) if a.q_lora_rank else Q_LOW) + (KV_SPLIT if a.kv_b else ("attn_kv_b",))
    return need, other


def mla_args(get: Callable[..., Any], n_layer: int, source: str) -> dict:
    """The latent attention's ``ModelArgs`` fields, as llama.cpp reads them: the ranks, a
    head's q·k and value widths (``key_length_mla``/``value_length_mla``; a file with
    ``attn_kv_b`` has them in ``key_length``/``value_length``), and the cache's row: one head
    of ``kv_lora_rank + n_rot`` (``key_length``, ``n_head_kv`` 1).

    Raises:
        ModelConfigError: widths that make no latent attention.
    """
    kv_lora = get(Keys.KV_LORA_RANK)
    q_lora = 0 if n_layer in LITE_LAYERS else get(Keys.Q_LORA_RANK)
    n_embd, n_head = get(Keys.EMBEDDING_LENGTH), get(Keys.HEAD_COUNT)
    head = n_embd // n_head if n_head > 0 else 0
    k_mla, v_mla = get(Keys.KEY_LENGTH_MLA, 0), get(Keys.VALUE_LENGTH_MLA, 0)
    kv_b = not (k_mla and v_mla)
    if kv_b:  # llama.cpp's first MLA converter: the heads' widths, attn_kv_b
        k_mla, v_mla = get(Keys.KEY_LENGTH, head), get(Keys.VALUE_LENGTH, head)
    n_rot = get(Keys.ROPE_DIMENSION_COUNT)
    bad = [
        (Keys.KV_LORA_RANK, kv_lora, kv_lora <= 0),
        (Keys.Q_LORA_RANK, q_lora, q_lora < 0),
        (Keys.KEY_LENGTH_MLA if not kv_b else Keys.KEY_LENGTH, k_mla, k_mla <= n_rot),
        (Keys.VALUE_LENGTH_MLA if not kv_b else Keys.VALUE_LENGTH, v_mla, v_mla <= 0),
    ]
    for key, value, wrong in bad:
        if wrong:
            raise ModelConfigError(
                f"{source}: {key.format(arch='deepseek2')} is {value}; DeepSeek-2's latent "
                "attention needs a latent and "
                f"heads wider than the {n_rot} RoPE dims (rope.dimension_count): re-convert the "
                "model"
            )
    return dict(
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        key_length_mla=k_mla,
        value_length_mla=v_mla,
        kv_b=kv_b,
        key_length=kv_lora + n_rot,
        n_head_kv=1,
    )


def mla_kv(a: Any) -> dict:
    """``mla_args``'s keys from ``ModelArgs`` ``a`` (its inverse)."""
    u32, arch = GGUFValueType.UINT32, a.arch
    kv = {
        Keys.KV_LORA_RANK.format(arch=arch): (a.kv_lora_rank, u32),
        Keys.Q_LORA_RANK.format(arch=arch): (a.q_lora_rank, u32),
    }
    if a.kv_b:  # the heads' widths in key_length/value_length, a head per KV head
        kv[Keys.KEY_LENGTH.format(arch=arch)] = (a.key_length_mla, u32)
        kv[Keys.VALUE_LENGTH.format(arch=arch)] = (a.value_length_mla, u32)
        kv[Keys.HEAD_COUNT_KV.format(arch=arch)] = (a.n_head, u32)
        return kv
    kv[Keys.KEY_LENGTH.format(arch=arch)] = (a.kv_lora_rank + a.n_rot, u32)
    kv[Keys.VALUE_LENGTH.format(arch=arch)] = (a.kv_lora_rank, u32)
    kv[Keys.KEY_LENGTH_MLA.format(arch=arch)] = (a.key_length_mla, u32)
    kv[Keys.VALUE_LENGTH_MLA.format(arch=arch)] = (a.value_length_mla, u32)
    return kv


FAMILY = Family(
    arch="deepseek2",
    block=MLA_BLOCK,
    ffn_variant=gated_ffn(FFNVariant.SWIGLU),
    experts=(*EXPERTS, replace(PROBS_BIAS, optional=True)),  # V3's; V2 has none
    moe_required=True,
    expert_ff_key=Keys.EXPERT_FEED_FORWARD_LENGTH,
    shared_by_count=True,
    key_defaults=((Keys.EXPERT_WEIGHTS_NORM, False),),
    reads=frozenset(
        {
            Keys.LEADING_DENSE_BLOCK_COUNT,
            Keys.EXPERT_SHARED_COUNT,
            Keys.EXPERT_GATING_FUNC,
            Keys.ROPE_SCALING_YARN_LOG_MUL,
        }
    ),
    requires=SHARED_BY_COUNT_KEYS,
    attention="mla",
    extra_args=mla_args,
    args_kv=mla_kv,
)
