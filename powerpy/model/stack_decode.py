"""One decode step through every block in one native call (CPU-only decode).

``Model._run`` can decode a token with two native calls per layer, the attention block and the
FFN block. With many small layers the Python between those calls costs as much as a layer's
work. A ``StackPlan`` packs every layer's matrices once per model and mode (sparse or dense);
``run`` hands the whole stack to ``pp_decode_layers``, which calls the same two block kernels
in the same order, so the results are the same bits.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from powerpy.model import interleave, kernels, layer_record, numerics
from powerpy.model.cache import KVCache
from powerpy.model.device import HOST
from powerpy.model.kernels import CACHE_CODES, KernelLibrary, LayerRecord, as_f32
from powerpy.model.moe import moe_part
from powerpy.model.options import RunOptions


@dataclass
class StackPlan:
    """Every layer's record packed for ``pp_decode_layers`` (``layer_record``: matrices, norms,
    biases, cut and layout flags, one family's layout or another's).

    Attributes:
        lib: the kernel library.
        records: the C records, one contiguous array (``LayerRecord * n_layer``; pointers
            into ``keep``).
        keep: the matrices and f32 vectors the records point into (kept alive here).
        counted: the layers with predictors, a cut or experts (their counts go to the statistics
            in sparse runs; the experts' in every run, as their routing is never off).
        experts: the layers that are mixtures of experts.
    """

    lib: KernelLibrary
    records: ctypes.Array
    keep: list
    counted: np.ndarray  # (k,) int64 layer ids (``layer_record.counted``, or experts)
    first: int = 0  # the plan runs layers first.. (a hybrid's host-only layers)
    experts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @staticmethod
    def build(blocks, args, opts: RunOptions, first: int = 0) -> StackPlan | None:
        """The plan for ``blocks`` (layers first..) under ``opts`` (sparse or dense), or None
        when some layer cannot run in the native block kernels (then the caller keeps its
        per-layer path)."""
        recs, keep, lib = [], [], None
        for l, blk in enumerate(blocks, start=first):
            att = layer_record.attention_part(blk, args, l)
            ffn = _ffn_part(blk, args, opts)
            if att is None or ffn is None or att.lib is not ffn.lib:
                return None
            lib = att.lib
            keep += att.keep + ffn.keep
            recs.append(layer_record.record(att, ffn))
        if lib is None:
            return None
        records = (LayerRecord * len(recs))(*recs)
        moe = [b.moe is not None for b in blocks]
        counted = np.flatnonzero(
            [layer_record.counted(b, opts) or e for b, e in zip(blocks, moe, strict=True)]
        )
        return StackPlan(lib, records, keep, counted, first, experts=np.flatnonzero(moe))

    def run(
        self, args, x: Tensor, cache: KVCache, rots: list, thr: float, opts: RunOptions
    ) -> Tensor:
        """x (1, n_embd) the residual stream before block ``first`` -> after the last block;
        writes those layers' cache rows at ``cache.pos`` (not advanced). rots: every layer's
        rotations (1, n_rot/2) complex (``OnDevices``: one object per distinct table), or None
        (learned positions)."""
        k, v = cache.k[self.first :], cache.v[self.first :]  # (n, n_ctx, n_kv, head_dim), host
        out = as_f32(x[0]).clone()
        n_layer, rs = len(self.records), rots[self.first :]
        tables: dict[int, Tensor] = {}  # each distinct table once (one, or gemma3's two)

        def table(r) -> int:  # (1, n_rot/2) complex: the kernels read its (cos, sin) pairs
            if id(r) not in tables:
                tables[id(r)] = r(HOST).contiguous()
            return tables[id(r)].data_ptr()

        if all(r is rs[0] for r in rs):  # one table (or none: learned positions)
            ptrs = np.full(n_layer, 0 if rs[0] is None else table(rs[0]), dtype=np.int64)
        else:
            ptrs = np.array([0 if r is None else table(r) for r in rs], dtype=np.int64)
        counts = np.zeros(n_layer, dtype=np.int64)
        clock = np.zeros(len(PHASES)) if opts.timer is not None else None
        st = self.lib.cdll.pp_decode_layers(
            n_layer,
            self.records,
            ptrs.ctypes.data,
            *layer_record.heads(args),
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0) * k.element_size(),
            CACHE_CODES[k.dtype],
            cache.pos,
            thr,
            out.data_ptr(),
            counts.ctypes.data,
            None if clock is None else clock.ctypes.data,
            len(PHASES),
            kernels.act_code(),
            torch.get_num_threads(),
        )
        if st:
            raise ValueError(f"decode_layers: invalid arguments (status {st})")
        if clock is not None:
            for name, secs in zip(PHASES, clock.tolist(), strict=True):
                opts.timer.add(name, secs)
        rows = self.counted if opts.sparse else self.experts
        if opts.stats is not None and rows.size:
            opts.stats.record_step(rows + self.first, counts[rows])
        return out[None]


# The native phase clock's phases, in blocks.h's Phase order: "attention_proj" (the q, k, v and
# output products) is timed inside "attention", "predictor" and "ffn_down" inside "ffn", as the
# per-layer path times the predictor inside the FFN.
PHASES = ("attention", "attention_proj", "ffn", "predictor", "ffn_down")


def plan_key(opts: RunOptions) -> tuple:
    """What a host plan depends on in ``opts``: the mode, the cut scale of a sparse run and the
    activations' rounding (the matrices' layouts)."""
    return (opts.sparse, opts.sparse and opts.cut_scale, opts.numerics.quantized_activations)


def plan_for(model, opts: RunOptions) -> StackPlan | None:
    """The model's plan for ``opts.sparse`` and ``opts.cut_scale``, built on first use (None:
    per-layer calls). It covers the layers from the first one after which every layer is on
    the host: all of a CPU-only model, the host part of a hybrid one (a placement fills the
    device from layer 0 on). The model keeps it with its other decode plans
    (``model.plans``, ``powerpy.model.plan.Plans.host``): data derived from its weights and
    the options' :func:`plan_key`, the same for every session."""
    return model.plans.host(plan_key(opts), lambda: build_plan(model, opts))


def build_plan(model, opts: RunOptions) -> StackPlan | None:
    """A new :func:`plan_for` (not kept)."""
    blocks = model.weights.blk
    first = len(blocks)
    while first > 0 and _native(blocks[first - 1], model.args, first - 1, opts):
        first -= 1
    if first == len(blocks):
        return None
    return StackPlan.build(blocks[first:], model.args, opts, first)


def prepare(model, opts: RunOptions) -> None:
    """Build now what decoding under ``opts`` builds on first use: its plan, with the
    interleaved layouts its matrices take, and the output matrix's layout (at load, as
    llama.cpp repacks its weights, rather than in the first prompt). Only with the native
    kernels and llama.cpp's rounding, the numerics those layouts serve."""
    num = opts.numerics
    if not (num.native and num.quantized_activations):
        return
    with numerics.using(num):
        plan_for(model, opts)
        out = model.weights.output  # None in a pipeline stage before the last
        if out is not None and out.device.type == "cpu":
            interleave.dense_kernel(out)


def _ffn_part(blk, args, opts: RunOptions) -> layer_record.Part | None:
    """The FFN half of a layer's record: a mixture of experts' or a dense FFN's."""
    if blk.moe is not None:
        return moe_part(blk, args, opts)
    return layer_record.ffn_part(blk, args, opts)


def _native(blk, args, l: int, opts: RunOptions) -> bool:
    """The block runs in the native block kernels (every matrix and vector on the host)."""
    return (
        layer_record.attention_part(blk, args, l) is not None
        and _ffn_part(blk, args, opts) is not None
    )


def usable(cache: KVCache, opts: RunOptions) -> bool:
    """Whether a step with this cache and these options may take the one-call path: kernels
    on, a host cache of a kernel type (a latent cache's values are a view of its keys, which
    the latent block reads), no observer or oracle (they need every neuron). A per-phase timer
    reads the native phase clock (``PHASES``)."""
    return (
        opts.numerics.native
        and opts.observer is None
        and opts.oracle is None
        and cache.k.device.type == "cpu"
        and cache.k.dtype in CACHE_CODES
        and cache.k.is_contiguous()
        and (cache.v.is_contiguous() or cache.latent)
    )
