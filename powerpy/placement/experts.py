"""Placing a mixture of experts (docs/moe.md#placement): its neurons and their bytes.

Neuron j of expert e is neuron ``e · n_ff_exp + j`` of its layer, so statistics, ``.gpuidx``
files, the solver and the split treat a layer's ``n_expert · n_ff_exp`` expert neurons as they
treat a dense layer's ``n_ff``; the router (``ffn_gate_inp``) is placed with the predictors,
in the dense pass. A hot neuron takes its row of the gate and up stacks at the file's type (raw
blocks) and its down column as a row: a block-quantized down stack cannot give a column as
blocks (a block spans 32 neurons of one output row), so the column goes to the device as f16
(f32 and bf16 stacks keep their type). No torch here: names, types and byte counts only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from powerpy.config import ModelArgs
from powerpy.errors import PlacementError
from powerpy.formats.constants import TYPE_TRAITS, GGMLType, Names
from powerpy.placement.budget import FfnLayout

if TYPE_CHECKING:
    from powerpy.formats.gguf_reader import GGUFFile

# bytes per element of a hot down column on the device, by the down stack's type (else f16)
DOWN_ELEMENT_BYTES = {GGMLType.F32: 4, GGMLType.BF16: 2, GGMLType.F16: 2}


def down_element_bytes(ggml_type: GGMLType) -> int:
    """Bytes per element of a hot down column placed from a stack of ``ggml_type``."""
    return DOWN_ELEMENT_BYTES.get(ggml_type, 2)


def expert_layout(gguf: GGUFFile, args: ModelArgs) -> FfnLayout:
    """The split's layout of a mixture of experts: ``n_expert · n_ff_exp`` neurons per layer,
    each a gate row and an up row at the file's types and a down column at
    :func:`down_element_bytes`.

    Raises:
        PlacementError: an expert stack is missing or of another shape (named, with the
            shape the hyperparameters need).
    """
    n, ff, d = args.n_expert, args.n_ff_exp, args.n_embd
    want = {
        Names.FFN_GATE_EXPS: (n, ff, d),
        Names.FFN_UP_EXPS: (n, ff, d),
        Names.FFN_DOWN_EXPS: (n, d, ff),
    }
    per_layer = []
    for layer in range(args.n_layer):
        total = 0
        for template, shape in want.items():
            t = gguf.tensors.get(template.format(l=layer))
            if t is None or tuple(t.shape) != shape:
                found = "missing" if t is None else f"of shape {tuple(t.shape)}"
                raise PlacementError(
                    f"{gguf.path}: {template.format(l=layer)} is {found}; the experts need "
                    f"{shape} (n_expert, ...)"
                )
            if template == Names.FFN_DOWN_EXPS:
                total += d * down_element_bytes(t.ggml_type)
            else:
                tr = TYPE_TRAITS[t.ggml_type]
                total += d // tr.block_size * tr.type_size
        per_layer.append(total)
    up = gguf.tensors[Names.FFN_UP_EXPS.format(l=0)]
    return FfnLayout(n * ff, tuple(per_layer), True, up.ggml_type)
