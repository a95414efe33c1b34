"""One layer as the native decode blocks read it: its record (``csrc/common.h`` LayerRecord).

The attention block and the FFN block of a one-token step run in C (``csrc/blocks.h``) for every
family's layout; what differs between layouts is data, packed here per layer: the matrices (5
int64 each: ``kernels.Matrix``), pointers to the f32 norms, biases and cut, and the layout's
flags (LayerNorm or RMSNorm, RoPE in adjacent or NEOX pairs or none, a parallel residual, a
dense file's down matrix, q scaled before q·k, a mixture of experts: ``moe.moe_part``), the FFN
variant, the sliding window, the q·k
scale and the score soft-cap. The per-layer calls (``attention.attention_block``,
``ffn.fused_decode``) and the stack plan (``stack_decode``) build their records here, so the
three paths run the same kernels on the same data.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from powerpy.config import ModelArgs
from powerpy.families import Norm, Residual, Rope
from powerpy.model import interleave, kernels
from powerpy.model.biased import BiasedWeight
from powerpy.model.kernels import LAYER_RECORD_LEN, RECORD_FLAGS, RECORD_SLOTS, KernelLibrary
from powerpy.model.matrices import TransposedWeight
from powerpy.model.options import RunOptions

F = RECORD_FLAGS
S = RECORD_SLOTS


@dataclass
class Part:
    """Half of a layer's record (the attention block's or the FFN block's): slot -> int64
    values, and the tensors its pointers point into (kept alive here)."""

    lib: KernelLibrary
    slots: dict[int, int] = field(default_factory=dict)
    keep: list = field(default_factory=list)
    flags: int = 0

    def mat(self, slot: int, w, dense: bool = True) -> Tensor | None | bool:
        """Put matrix ``w`` (None: leave zeros) at ``slot``, in its layout for whole-matrix
        products when ``dense``; returns its row bias (None: none), or False when the kernels
        cannot read it."""
        if w is None:
            return None
        bias = None
        if isinstance(w, BiasedWeight):
            w, bias = w.inner, w.bias
        k = interleave.dense_kernel(w) if dense else w.kernel()
        if k is None or k[0] is not self.lib:
            return False
        self.matrix(slot, k[1])
        return bias

    def matrix(self, slot: int, m: kernels.Matrix) -> None:
        """Put a kernels' matrix (5 int64) at ``slot``."""
        self.keep.append(m)
        for i, v in enumerate(m.args):
            self.slots[slot + i] = v

    def vec(self, slot: int, t: Tensor | None) -> bool:
        """Put an f32 host vector's pointer at ``slot`` (None: 0); False when ``t`` is not on
        the host."""
        if t is None:
            return True
        if t.device.type != "cpu":
            return False
        t = kernels.as_f32(t)
        self.keep.append(t)
        self.slots[slot] = t.data_ptr()
        return True

    def f32(self, slot: int, v: float) -> None:
        """Put an f32 value's bit pattern at ``slot``."""
        self.slots[slot] = int(np.float32(v).view(np.uint32))


def layout_flags(a: ModelArgs) -> int:
    """The record flags of the family's layout (norm, RoPE, residual)."""
    fam = a.family
    flags = F["layer_norm"] if fam.norm is Norm.LAYER else 0
    if fam.rope is not Rope.LEARNED:
        flags |= F["rope"] | (F["neox"] if fam.rope is Rope.NEOX else 0)
    return flags | (F["parallel"] if fam.residual is Residual.PARALLEL else 0)


def score_scale(a: ModelArgs) -> float:
    """The q·k scale as the kernels compute it: ``attn_scale``, else 1/sqrt(head_dim) in f32."""
    if a.attn_scale:
        return float(np.float32(a.attn_scale))
    return float(np.float32(1) / np.sqrt(np.float32(a.head_dim)))


def attention_part(blk, a: ModelArgs, l: int) -> Part | None:
    """The attention block's half of layer ``l``'s record, or None when the block is not for
    the native kernels (``Block.native`` off, a matrix they cannot read, a norm off the host, or
    the call's numerics turn them off)."""
    lib = kernels.library()
    if lib is None or not blk.native:
        return None
    if blk.mla is not None:  # DeepSeek-2's latent attention (its own block, csrc/mla.h)
        return blk.mla.part(blk, a, l)
    p = Part(lib, flags=layout_flags(a))
    parallel = a.family.residual is Residual.PARALLEL
    own = parallel and blk.attn_norm_2 is not None  # falcon-40B: attention's own norm
    norm = (blk.attn_norm_2, blk.attn_norm_2_b) if own else (blk.attn_norm, blk.attn_norm_b)
    mats = (blk.attn_q, blk.attn_k, blk.attn_v, blk.attn_output)
    biases = [p.mat(S["attn"] + 5 * i, w) for i, w in enumerate(mats)]
    if any(b is False for b in biases) or norm[0] is None:
        return None
    vecs = [
        (S["attn_norm"], norm[0]),
        (S["attn_norm"] + 1, norm[1]),
        (S["post_norm"], blk.post_attention_norm),
        (S["qk_norm"], blk.attn_q_norm),
        (S["qk_norm"] + 1, blk.attn_k_norm),
        *((S["bias"] + i, b) for i, b in enumerate(biases)),
        (S["sinks"], blk.attn_sinks),
    ]
    if not all(p.vec(s, t) for s, t in vecs):
        return None
    if a.family.scale_q:  # ggml_scale of q before q·k (gemma's, phi3's graphs)
        p.flags |= F["q_scaled"]
    p.slots[S["window"]] = a.sliding_window if l in a.swa_layers else 0
    p.f32(S["scale"], score_scale(a))
    p.f32(S["softcap"], a.attn_softcap)
    return p


def ffn_part(blk, a: ModelArgs, opts: RunOptions, *, cold: bool = False) -> Part | None:
    """The FFN block's half of a layer's record under ``opts`` (the predictor where it gates,
    the cut), or None when it does not apply: ``Block.native`` off, a matrix the kernels cannot
    read, a norm off the host, hot rows (a hybrid placement), profiling or an oracle. ``cold``:
    the host rows of a hybrid layer, as its cold task reads them (``host_tasks``): the host
    matrices and the cut, no predictor (the device's mask selects), hot rows or not."""
    if opts.observer is not None or opts.oracle is not None or (blk.hot is not None and not cold):
        return None
    lib = kernels.library()
    if lib is None or not blk.native or blk.moe is not None or blk.ffn_up is None:
        return None  # (experts: moe.moe_part)
    p = Part(lib, flags=layout_flags(a))
    down = blk.ffn_down_t
    stored = isinstance(down, TransposedWeight)  # a dense file's ffn_down: (n_embd, n_ff)
    if stored:
        p.flags |= F["down_stored"]
        down = down.inner
    gated = blk.gates(opts) and not stored and not cold
    tau = None if stored else blk.cut(opts)
    mats = (blk.fc1 if gated else None, blk.fc2 if gated else None, blk.ffn_gate, blk.ffn_up, down)
    rows = gated or cold  # gate and up read as gathered rows (a cold task's selection too)
    dense = (True, True, not rows, not rows, stored)  # row gathers and sums read rows
    pairs = enumerate(zip(mats, dense, strict=True))
    biases = [p.mat(S["ffn"] + 5 * i, w, d) for i, (w, d) in pairs]
    if any(b is False for b in biases) or any(b is not None for b in (*biases[:3], biases[4])):
        return None  # a matrix the kernels cannot read; a bias other than up's (none has one)
    if biases[3] is not None and blk.ffn_gate is not None:
        return None  # an up bias in a gated FFN (no family has one; the fused GLU reads none)
    g, u = S["ffn"] + 10, S["ffn"] + 15  # the fused GLU reads gate and up rows alike
    if blk.ffn_gate is not None and any(p.slots[g + i] != p.slots[u + i] for i in (0, 3, 4)):
        return None
    parallel = a.family.residual is Residual.PARALLEL
    norm = (blk.attn_norm, blk.attn_norm_b) if parallel else (blk.ffn_norm, blk.ffn_norm_b)
    vecs = [
        (S["ffn_norm"], norm[0]),
        (S["ffn_norm"] + 1, norm[1]),
        (S["post_norm"] + 1, blk.post_ffw_norm),
        (S["bias"] + 4, biases[3]),
        (S["bias"] + 5, blk.ffn_down_b),
        (S["tau"], tau),
    ]
    if cold:  # the task gets the normed input: no norm, bias or post norm of the block's
        vecs = [(S["bias"] + 4, biases[3]), (S["tau"], tau)]
    elif norm[0] is None:
        return None
    if not all(p.vec(s, t) for s, t in vecs):
        return None
    p.slots[S["variant"]] = kernels.VARIANTS[a.ffn_variant]
    return p


def record(*parts: Part) -> ctypes.Array:
    """The C record of a layer made of ``parts`` (their slots; the flags OR-ed), as ctypes."""
    vals = [0] * LAYER_RECORD_LEN
    flags = 0
    for p in parts:
        for s, v in p.slots.items():
            vals[s] = v
        flags |= p.flags
    vals[S["flags"]] = flags
    return (ctypes.c_int64 * LAYER_RECORD_LEN)(*vals)


def heads(a: ModelArgs) -> tuple[int, int, int, int, float]:
    """The model's (n_head, n_head_kv, head_dim, n_rot, norm eps) for the block kernels."""
    return a.n_head, a.n_head_kv, a.head_dim, a.n_rot, a.norm_eps


def counted(blk, opts: RunOptions) -> bool:
    """Whether a layer's FFN counts go to the statistics (a predictor or a cut selects)."""
    return blk.fc1 is not None or blk.cut(opts) is not None


def rotation(rot: Tensor | None) -> Tensor | None:
    """A step's rotations (1, n_rot/2) or (n_rot/2,) complex as the kernels read them: (n_rot/2,
    2) f32 (cos, sin); None stays None (no RoPE)."""
    if rot is None:
        return None
    return torch.view_as_real(rot.reshape(-1).contiguous())
