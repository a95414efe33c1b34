"""One decode step through every block in one native call (CPU-only decode).

``Model._run`` can decode a token with two native calls per layer, the attention block and the
FFN block. With many small layers the Python between those calls costs as much as a layer's
work. A ``StackPlan`` packs every layer's matrices once per model and mode (sparse or dense);
``run`` hands the whole stack to ``pp_decode_layers``, which calls the same two block kernels
in the same order, so the results are the same bits.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from powerpy.config import FFNVariant
from powerpy.model import kernels
from powerpy.model.attention import attention_kernels
from powerpy.model.cache import KVCache
from powerpy.model.ffn import ffn_kernels
from powerpy.model.kernels import CACHE_CODES, KernelLibrary, Matrix, as_f32
from powerpy.model.moe import moe_kernels
from powerpy.model.options import RunOptions

_REC = kernels.LAYER_RECORD_LEN  # int64 per layer: 4 + 5 matrices of 5, 2 norms, down_stored, tau


@dataclass
class StackPlan:
    """Every layer's matrices and norms packed for ``pp_decode_layers``.

    Attributes:
        lib: the kernel library.
        records: (n_layer, 48) int64, the C records (pointers into ``keep``'s tensors).
        keep: the matrices and f32 norms the records point into (kept alive here).
        gated: the layers with predictors, a cut or experts (their counts go to the statistics
            in sparse runs; the experts' in every run, as their routing is never off).
        variant: the FFN activation's kernel code.
        experts: the layers that are mixtures of experts.
    """

    lib: KernelLibrary
    records: np.ndarray
    keep: list
    gated: np.ndarray  # (k,) int64 layer ids
    variant: int
    first: int = 0  # the plan runs layers first.. (a hybrid's host-only layers)
    experts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @staticmethod
    def build(blocks, variant, opts: RunOptions) -> StackPlan | None:
        """The plan for ``blocks`` under ``opts`` (sparse or dense), or None when some layer
        cannot run in the native block kernels (then the caller keeps its per-layer path)."""
        recs, keep, lib = [], [], None
        for blk in blocks:
            att = attention_kernels(blk)
            if blk.moe is not None:  # a mixture of experts: pp_moe_decode's record
                rec = _moe_record(att, blk, opts, keep)
                if rec is None:
                    return None
                lib = att[0]
                recs.append(rec)
                continue
            ffn = ffn_kernels(blk, opts)
            if att is None or ffn is None or att[0] is not ffn[0]:
                return None
            lib = att[0]
            norms = [as_f32(blk.attn_norm), as_f32(blk.ffn_norm)]
            tau = None if ffn[3] is None else as_f32(ffn[3])
            keep += att[1] + [m for m in ffn[1] if m is not None] + norms + [tau]
            rec = list(Matrix.pack(att[1] + ffn[1]))
            ptrs = [norms[0].data_ptr(), norms[1].data_ptr(), int(ffn[2])]
            recs.append(rec + ptrs + [0 if tau is None else tau.data_ptr()])
        if lib is None:
            return None
        records = np.ascontiguousarray(np.array(recs, dtype=np.int64).reshape(-1, _REC))
        gated = np.flatnonzero(
            [b.fc1 is not None or b.cut(opts) is not None or b.moe is not None for b in blocks]
        )
        experts = np.flatnonzero([b.moe is not None for b in blocks])
        code = kernels.VARIANTS[FFNVariant(variant)]
        return StackPlan(lib, records, keep, gated, code, experts=experts)

    def run(
        self, args, x: Tensor, cache: KVCache, rot: Tensor, thr: float, opts: RunOptions
    ) -> Tensor:
        """x (1, n_embd) the residual stream before block ``first`` -> after the last block;
        writes those layers' cache rows at ``cache.pos`` (not advanced). rot: (n_rot / 2,)
        complex."""
        k, v = cache.k[self.first :], cache.v[self.first :]  # (n, n_ctx, n_kv, head_dim), host
        out = as_f32(x[0]).clone()
        r = torch.view_as_real(rot.contiguous())  # (n_rot / 2, 2): cos, sin
        n_layer = self.records.shape[0]
        counts = np.zeros(n_layer, dtype=np.int64)
        st = self.lib.cdll.pp_decode_layers(
            n_layer, self.records.ctypes.data, args.norm_eps, r.data_ptr(), args.n_rot,
            args.n_head, args.n_head_kv, args.head_dim, k.data_ptr(), v.data_ptr(),
            k.stride(0) * k.element_size(), CACHE_CODES[k.dtype], cache.pos, thr, self.variant,
            out.data_ptr(), counts.ctypes.data, kernels.act_code(),
            torch.get_num_threads(),
        )  # fmt: skip
        if st:
            raise ValueError(f"decode_layers: invalid arguments (status {st})")
        rows = self.gated if opts.sparse else self.experts
        if opts.stats is not None and rows.size:
            opts.stats.record_step(rows + self.first, counts[rows])
        return out[None]


def _moe_record(att, blk, opts: RunOptions, keep: list) -> list[int] | None:
    """A mixture of experts' layer record (down_stored 2): attention, then the router, gate, up
    and down stacks, then k, norm and the scale's bits where a fifth matrix would be; None when
    the layer's attention or experts are not for the block kernels."""
    kern = moe_kernels(blk, opts)
    if att is None or kern is None or att[0] is not kern[0]:
        return None
    _, mats, tau = kern
    ex = blk.moe
    norms = [as_f32(blk.attn_norm), as_f32(blk.ffn_norm)]
    tau = None if tau is None else as_f32(tau)
    keep += att[1] + mats + norms + [tau]
    scale = int(np.array([ex.scale], np.float32).view(np.int32)[0])
    rec = list(Matrix.pack(att[1] + mats)) + [ex.n_used, int(ex.norm), scale, 0, 0]
    return rec + [norms[0].data_ptr(), norms[1].data_ptr(), 2, 0 if tau is None else tau.data_ptr()]


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {mode: plan}


def plan_for(model, opts: RunOptions) -> StackPlan | None:
    """The model's plan for ``opts.sparse`` and ``opts.cut_scale``, built on first use (None:
    per-layer calls). It covers the layers from the first one after which every layer is on
    the host: all of a CPU-only model, the host part of a hybrid one (a placement fills the
    device from layer 0 on)."""
    plans = _PLANS.setdefault(model, {})
    key = (opts.sparse, opts.sparse and opts.cut_scale, opts.numerics.quantized_activations)
    if key not in plans:
        blocks = model.weights.blk
        first = len(blocks)
        while first > 0 and _native(blocks[first - 1], opts):
            first -= 1
        plan = None
        if first < len(blocks):
            plan = StackPlan.build(blocks[first:], model.args.ffn_variant, opts)
        if plan is not None:
            plan.first = first
        plans[key] = plan
    return plans[key]


def _native(blk, opts: RunOptions) -> bool:
    """The block runs in the native block kernels (every matrix and norm on the host)."""
    if blk.moe is not None:
        return attention_kernels(blk) is not None and moe_kernels(blk, opts) is not None
    return attention_kernels(blk) is not None and ffn_kernels(blk, opts) is not None


def usable(cache: KVCache, opts: RunOptions) -> bool:
    """Whether a step with this cache and these options may take the one-call path: kernels
    on, a host cache of a kernel type, no per-phase timer (it times the per-layer calls), no
    observer or oracle (they need every neuron)."""
    return (
        opts.numerics.native
        and opts.timer is None
        and opts.observer is None
        and opts.oracle is None
        and cache.k.device.type == "cpu"
        and cache.k.dtype in CACHE_CODES
        and cache.k.is_contiguous()
        and cache.v.is_contiguous()
    )
