"""What a model file must hold for its family, checked before its weights are read (each
tensor's bytes filling its slot is ``gguf_reader.check_tensor_sizes``): no per-layer tensor of
another layout (:func:`check_foreign`), and a fused matrix or its parts, never both or neither
(:func:`check_part`). Each refusal names the file, the tensor and what to do."""

from __future__ import annotations

import re

from powerpy.config import ModelArgs
from powerpy.errors import FileFormatError, ModelConfigError
from powerpy.families import Rope
from powerpy.formats.constants import Keys, Names
from powerpy.formats.gguf_reader import GGUFFile


def check_part(gf: GGUFFile, fam, part, l: int, fused_read: bool) -> None:
    """Refuse layer ``l``'s own ``part`` matrix beside the fused one (``fused_read``), or
    missing where the fused one is too.

    Raises:
        ModelConfigError: both layouts, naming both tensors.
        FileFormatError: neither, naming both tensors.
    """
    name = part.name.format(l=l)
    fused = next(f.name for f in fam.block if f.field == part.part_of).format(l=l)
    if fused_read and name in gf.tensors:
        raise ModelConfigError(
            f"{gf.path}: layer {l} holds both {fused!r} and {name!r}, one of its row blocks; a "
            "file holds the fused matrix or its parts, not both: re-convert the model"
        )
    if not fused_read and name not in gf.tensors:
        raise FileFormatError(
            f"{gf.path}: tensor {name!r} is missing, and so is the fused {fused!r} that would "
            "hold it; the file is incomplete or its block_count is wrong: re-convert the model"
        )


# Per-layer tensors some family has (their GGUF base names): a file of a family that lacks one
# of them is of another architecture, or corrupt. Other unknown tensors are ignored.
_LAYOUT_BASES = {
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_qkv",
    "attn_norm_2",
    "ffn_gate",
    "ffn_norm",
    "ffn_up",
    "ffn_down",
    "ffn_down_t",
    "ffn_gate_inp",
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
    "attn_q_norm",
    "attn_k_norm",
    "post_attention_norm",
    "post_ffw_norm",
    "exp_probs_b",
    "attn_sinks",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)")
_EXPERT_BASES = {"ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "exp_probs_b"}
# the first Mixtral GGUFs' layout: one 2-D tensor per expert (blk.N.ffn_gate.E.weight)
_ONE_PER_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")


def check_foreign(gf: GGUFFile, fam, args: ModelArgs) -> None:
    """Refuse a per-layer tensor of another layout (``_LAYOUT_BASES``) that ``fam`` does not
    declare for its layer (a mixture of experts' layer: its experts instead of a dense FFN; a
    leading dense layer: the dense FFN), an output matrix where the family has none, and learned
    positions in a family without them. A NextN layer's tensors are not checked (not run).

    Raises:
        ModelConfigError: naming the file, the tensor and what the family expects.
    """
    base = {t.name.split(".")[2] for t in fam.layer_block(False)}
    own = {False: base | {"ffn_down", "ffn_down_t"}}
    own[True] = {t.name.split(".")[2] for t in (*fam.layer_block(True), *fam.experts)}
    for name in gf.tensors:
        if _ONE_PER_EXPERT.fullmatch(name):
            raise ModelConfigError(
                f"{gf.path}: tensor {name!r} holds one expert of a mixture of experts on its "
                "own, the layout of the first Mixtral GGUFs, which llama.cpp no longer loads "
                "either; powerpy reads the experts of a layer as one stack "
                "(ffn_gate_exps, ffn_up_exps, ffn_down_exps): download a newer conversion of "
                "the model, or re-convert it"
            )
        m = _LAYER_TENSOR.fullmatch(name)
        if m is None or int(m.group(1)) >= args.n_layer:
            continue
        layer, what = int(m.group(1)), m.group(2)
        moe = args.layer_moe(layer)
        if what in _EXPERT_BASES and not args.moe and fam.experts:
            key = Keys.EXPERT_COUNT.format(arch=fam.arch)
            raise ModelConfigError(
                f"{gf.path}: tensor {name!r} belongs to a mixture of experts, but the file's "
                f"{key} is missing or 0; set it (and {key.replace('count', 'used_count')}) or "
                "re-convert the model"
            )
        if what in _EXPERT_BASES and args.moe and not moe and what in own[True]:
            key = Keys.LEADING_DENSE_BLOCK_COUNT.format(arch=fam.arch)
            raise ModelConfigError(
                f"{gf.path}: tensor {name!r} belongs to a mixture of experts, but layer {layer} "
                f"is one of the {args.n_layer_dense} leading dense layers ({key}); fix the key "
                "or re-convert the model"
            )
        if what in _LAYOUT_BASES and what not in own[moe]:
            raise ModelConfigError(
                f"{gf.path}: tensor {name!r} is not part of a {fam.arch} model, whose "
                f"{('mixture-of-experts ' if moe else 'dense ') if args.n_layer_dense else ''}"
                "layers hold "
                f"{', '.join(sorted(own[moe] - {'ffn_down', 'ffn_down_t'}))}"
                f"{'' if moe else ', the down matrix and predictors'}; the file is of another "
                "architecture or corrupt: re-convert the model"
            )
    if Names.OUTPUT in gf.tensors and not fam.output_tensor:
        raise ModelConfigError(
            f"{gf.path}: tensor {Names.OUTPUT!r} is not part of a {fam.arch} model, whose logits "
            f"read {Names.TOKEN_EMBD!r} (llama.cpp refuses the file too): re-convert the model"
        )
    if Names.POS_EMBD in gf.tensors and fam.rope is not Rope.LEARNED:
        raise ModelConfigError(
            f"{gf.path}: tensor {Names.POS_EMBD!r} (learned positions) is not part of a "
            f"{fam.arch} model, which uses RoPE; re-convert the model"
        )
