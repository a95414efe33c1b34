"""Where each tensor of a file lives in a loaded model: GGUF name -> the (object, attribute)
slots holding it (``runtime.build_hybrid`` moves what a placement puts on the accelerator
through them, and counts the host's bytes)."""

from __future__ import annotations

import dataclasses
from typing import Any

from powerpy.formats.constants import Names, bias_name
from powerpy.model.biased import BiasedWeight
from powerpy.model.matrices import TransposedWeight
from powerpy.model.weights import Block, Weights

__all__ = ["get_slot", "set_slot", "weight_slots"]

# DeepSeek-2's latent attention: GGUF base name -> its ``mla.Latent`` field (k_b and v_b are
# per-head lists; a fused attn_kv_b fills both)
_LATENT = {
    "attn_q": "q",
    "attn_q_a": "q_a",
    "attn_q_a_norm": "q_a_norm",
    "attn_q_b": "q_b",
    "attn_kv_a_mqa": "kv_a",
    "attn_kv_a_norm": "kv_a_norm",
    "attn_k_b": ("k_b",),
    "attn_v_b": ("v_b",),
    "attn_kv_b": ("k_b", "v_b"),
}


def get_slot(obj: Any, attr: str | int) -> Any:
    """A slot's value: an attribute, or an item of a list (a latent's per-head matrices)."""
    return obj[attr] if isinstance(attr, int) else getattr(obj, attr)


def set_slot(obj: Any, attr: str | int, value: Any) -> None:
    if isinstance(attr, int):
        obj[attr] = value
    else:
        setattr(obj, attr, value)


def _latent_slots(blk, layer: int) -> dict[str, list[tuple[Any, str | int]]]:
    """The slots of a layer's latent attention tensors (``_LATENT``)."""
    out: dict[str, list[tuple[Any, str | int]]] = {}
    for base, attr in _LATENT.items():
        name = f"blk.{layer}.{base}.weight"
        if isinstance(attr, str):
            if getattr(blk.mla, attr) is not None:
                out[name] = [(blk.mla, attr)]
            continue
        lists = [getattr(blk.mla, a) for a in attr]
        out[name] = [(heads, i) for heads in lists for i in range(len(heads))]
    return out


def weight_slots(weights: Weights, fam=None) -> dict[str, list[tuple[Any, str | int]]]:
    """GGUF tensor name -> the (object, attribute) slots holding it in the weights: one slot,
    three for a fused ``attn_qkv`` (its q, k and v row views), none for a matrix's bias (it
    travels with its matrix, ``BiasedWeight``). A norm's bias is ``{norm}_b``. Attributes are
    GGUF names, or the field ``fam`` (the model's family) declares for one (glm4moe's and
    gpt-oss's ``post_attention_norm`` fills ``ffn_norm``)."""
    ends = (
        (Names.TOKEN_EMBD, "token_embd"),
        (Names.OUTPUT_NORM, "output_norm"),
        (Names.OUTPUT, "output"),
    )
    slots: dict[str, list[tuple[Any, str | int]]] = {  # a pipeline stage has only its own ends
        name: [(weights, attr)] for name, attr in ends if getattr(weights, attr) is not None
    }
    if weights.output_norm_b is not None:
        slots[bias_name(Names.OUTPUT_NORM)] = [(weights, "output_norm_b")]
    fields = {f.name for f in dataclasses.fields(Block)}
    templates = [t for k, t in vars(Names).items() if k.isupper() and t.startswith("blk.{l}.")]
    for layer, blk in enumerate(weights.blk):
        for template in templates:
            attr = template.split(".")[2]  # blk.{l}.<attr>.weight: attributes are GGUF names
            if attr not in fields or getattr(blk, attr) is None:
                continue
            name = template.format(l=layer)
            slots[name] = [(blk, attr)]
            if isinstance(getattr(blk, attr), BiasedWeight):
                slots[bias_name(name)] = []
            elif getattr(blk, attr + "_b", None) is not None:
                slots[bias_name(name)] = [(blk, attr + "_b")]
        for lt in fam.block if fam is not None else ():
            name = lt.name.format(l=layer)
            if name not in slots and not lt.part_of and getattr(blk, lt.field, None) is not None:
                slots[name] = [(blk, lt.field)]
                if isinstance(getattr(blk, lt.field), BiasedWeight):
                    slots[bias_name(name)] = []
        if isinstance(blk.ffn_down_t, TransposedWeight):  # a dense file's down, as stored
            slots[Names.FFN_DOWN.format(l=layer)] = [(blk, "ffn_down_t")]
        if blk.mla is not None:
            slots.update(_latent_slots(blk, layer))
        if blk.moe is not None:  # the router; the experts' stacks go by hot rows
            slots[Names.FFN_GATE_INP.format(l=layer)] = [(blk.moe, "router")]
            # the routing's biases travel with the router (build_hybrid)
            slots[bias_name(Names.FFN_GATE_INP.format(l=layer))] = []
            slots[Names.EXP_PROBS_B.format(l=layer)] = []
        if blk.attn_q is not None:  # a fused attn_qkv: its parts' row views
            qkv = Names.ATTN_QKV.format(l=layer)
            slots[qkv] = [(blk, "attn_q"), (blk, "attn_k"), (blk, "attn_v")]
            slots[bias_name(qkv)] = []
    return slots
