"""Placing a mixture of experts (docs/moe.md#placement): its neurons and their bytes.

Neuron j of expert e is neuron ``e · n_ff_exp + j`` of its layer, so statistics, ``.gpuidx``
files, the solver and the split treat a layer's ``n_expert · n_ff_exp`` expert neurons as they
treat a dense layer's ``n_ff``; the router (``ffn_gate_inp``) is placed with the predictors,
in the dense pass, with the routing's biases, as are a leading dense layer's FFN and a shared
expert (every token runs them). A hot neuron takes its row of the gate and up stacks at the
file's type (raw blocks), their biases' elements (GPT-OSS), and its down column as a row: a
block-quantized down stack cannot give a column as blocks (a block spans 32 neurons of one
output row), so the column goes to the device as f16 (f32 and bf16 stacks keep their type).
No torch here: names, types and byte counts only; and :func:`cpu_moe_index`, llama.cpp's
``--cpu-moe``/``--n-cpu-moe`` as a GPU index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from powerpy.config import ModelArgs
from powerpy.errors import PlacementError
from powerpy.formats.constants import TYPE_TRAITS, GGMLType, Names, bias_name
from powerpy.formats.gpuidx import GpuIndex
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
    each a gate row and an up row at the file's types (and their biases, GPT-OSS's) and a down
    column at :func:`down_element_bytes`. The leading dense layers (``n_layer_dense``) have no
    hot rows: the dense pass places their FFN whole (``FfnLayout.dense_layers``; their bytes
    per neuron are the first mixture layer's, so the capacity is counted in expert neurons).

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
    biases = [bias_name(w) for w in (Names.FFN_GATE_EXPS, Names.FFN_UP_EXPS)]
    per_layer = []
    dense = tuple(range(args.n_layer_dense))
    for layer in range(len(dense), args.n_layer):
        total = 4 * sum(b.format(l=layer) in gguf.tensors for b in biases)  # f32 elements
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
    up = gguf.tensors[Names.FFN_UP_EXPS.format(l=len(dense))]
    per_layer = [per_layer[0]] * len(dense) + per_layer
    return FfnLayout(n * ff, tuple(per_layer), True, up.ggml_type, dense, cut_groups(gguf, args))


def cut_groups(gguf: GGUFFile, args: ModelArgs) -> tuple[int, ...]:
    """Per layer, the neurons a cut keeps or drops together (``moe.Experts.cut_group``: one
    block of the down stack's type), where the file has a cut; else 0."""
    out = []
    for layer in range(args.n_layer):
        t = gguf.tensors.get(Names.FFN_DOWN_EXPS.format(l=layer))
        cut = layer < len(args.down_thresholds) and args.down_thresholds[layer] > 0
        k_quant = t is not None and t.ggml_type in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
        out.append((256 if k_quant else 32) if cut and t is not None else 0)
    return tuple(out)


def cpu_moe_index(args: ModelArgs, n_cpu_moe: int) -> GpuIndex:
    """llama.cpp's ``--n-cpu-moe N`` as a GPU index: the experts of the first ``n_cpu_moe``
    layers stay on the CPU, every neuron of every expert of the other layers goes to the GPU
    (``--cpu-moe``: ``n_cpu_moe`` = n_layer, none). Leading dense layers have no hot rows.

    Raises:
        PlacementError: a model without experts, or a negative count.
    """
    if not args.moe:
        raise PlacementError(
            f"--cpu-moe/--n-cpu-moe keep a mixture's experts on the CPU, but this {args.arch} "
            "model has none; place it with --vram-budget alone"
        )
    if n_cpu_moe < 0:
        raise PlacementError(f"--n-cpu-moe {n_cpu_moe}: it must be >= 0 (layers)")
    n = args.ffn_neurons
    whole, none = np.arange(n, dtype=np.int32), np.zeros(0, np.int32)
    first = max(n_cpu_moe, args.n_layer_dense)
    buckets = [none if l < first else whole for l in range(args.n_layer)]
    return GpuIndex.from_buckets(buckets, n, vram_capacity=0)
