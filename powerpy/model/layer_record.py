"""One layer as the native decode blocks read it: its record (``csrc/layer_record.h``
LayerRecord, mirrored by ``kernel_abi.LayerRecord``).

The attention block and the FFN block of a one-token step run in C (``csrc/blocks.h``) for every
family's layout; what differs between layouts is data, packed here per layer: the matrices
(``kernels.Matrix``), pointers to the f32 norms, biases and cut, and the layout's flags
(LayerNorm or RMSNorm, RoPE in adjacent or NEOX pairs or none, a parallel residual, a dense
file's down matrix, q scaled before q·k, a mixture of experts: ``moe.moe_part``), the FFN
variant, the sliding window, the q·k scale and the score soft-cap. The per-layer calls
(``attention.attention_block``, ``ffn.fused_decode``) and the stack plan (``stack_decode``)
build their records here, so the three paths run the same kernels on the same data.

A part names what it puts in the record by the tensor's name in the file where it holds one
(``AT``: "ffn_gate", "attn_q.bias"), else by the record's own field ("tau", "window") or
sub-record member ("moe.n_used", "mla.rank").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from powerpy.config import ModelArgs
from powerpy.families import Norm, Residual, Rope
from powerpy.model import interleave, kernels
from powerpy.model.biased import BiasedWeight
from powerpy.model.kernels import RECORD_FLAGS, KernelLibrary, LayerRecord
from powerpy.model.matrices import TransposedWeight
from powerpy.model.options import RunOptions

F = RECORD_FLAGS

# Where each named tensor sits in the record: its path there, a field with its index in an array
# field ("ffn[2]") or a sub-record's member ("mla.k_b").
AT: dict[str, str] = {
    **{n: f"attn[{i}]" for i, n in enumerate(("attn_q", "attn_k", "attn_v", "attn_output"))},
    **{n: f"ffn[{i}]" for i, n in enumerate(("fc1", "fc2", "ffn_gate", "ffn_up", "ffn_down"))},
    "ffn_gate_inp": "ffn[0]",  # a mixture's router, in fc1's place
    **{
        n: f"shexp[{i}]"
        for i, n in enumerate(
            ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
        )
    },
    "attn_norm": "attn_norm[0]",
    "attn_norm.bias": "attn_norm[1]",
    "ffn_norm": "ffn_norm[0]",
    "ffn_norm.bias": "ffn_norm[1]",
    "post_attention_norm": "post_norm[0]",
    "post_ffw_norm": "post_norm[1]",
    "attn_q_norm": "qk_norm[0]",
    "attn_k_norm": "qk_norm[1]",
    **{
        f"{n}.bias": f"bias[{i}]"
        for i, n in enumerate(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down"))
    },
    "attn_sinks": "sinks",
    # a latent attention's tensors where its block reads them (csrc/mla.h)
    "attn_q_a": "attn[0]",
    "attn_kv_a_mqa": "attn[1]",
    "attn_q_b": "attn[2]",
    "attn_q_a_norm": "qk_norm[0]",
    "attn_kv_a_norm": "qk_norm[1]",
    "attn_k_b": "mla.k_b",
    "attn_v_b": "mla.v_b",
}
_PATH = re.compile(r"(?:(\w+)\.)?(\w+)(?:\[(\d+)\])?")


@dataclass
class Part:
    """Half of a layer's record (the attention block's or the FFN block's): its values by name
    (a Matrix, a vector's pointer, a number or a sub-record), and the tensors its pointers point
    into (kept alive here)."""

    lib: KernelLibrary
    values: dict[str, object] = field(default_factory=dict)
    keep: list = field(default_factory=list)
    flags: int = 0

    def mat(self, name: str, w, dense: bool = True) -> Tensor | None | bool:
        """Put matrix ``w`` (None: leave zeros) as ``name``, in its layout for whole-matrix
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
        self.matrix(name, k[1])
        return bias

    def matrix(self, name: str, m: kernels.Matrix) -> None:
        """Put a kernels' matrix as ``name``."""
        self.keep.append(m)
        self.set(name, m)

    def vec(self, name: str, t: Tensor | None) -> bool:
        """Put an f32 host vector's pointer as ``name`` (None: 0); False when ``t`` is not on
        the host."""
        if t is None:
            return True
        if t.device.type != "cpu":
            return False
        t = kernels.as_f32(t)
        self.keep.append(t)
        self.set(name, t.data_ptr())
        return True

    def set(self, name: str, v) -> None:
        """Put value ``v`` as ``name`` (an f32 field rounds a float to f32)."""
        _place(name)  # a name the record has
        self.values[name] = v


def _place(name: str) -> tuple[str, str, int | None]:
    """Where ``name`` goes (``AT``, else the name is the path): (the sub-record or "", the
    field, the index in an array field or None); KeyError for a name the record lacks."""
    m = _PATH.fullmatch(AT.get(name, name))
    sub, f, i = m.groups() if m else ("", "", None)
    t = dict(LayerRecord._fields_).get(sub) if sub else LayerRecord
    if f not in dict(getattr(t, "_fields_", ())):
        raise KeyError(f"the layer record has no {name!r}")
    return sub or "", f, None if i is None else int(i)


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
    names = ("attn_q", "attn_k", "attn_v", "attn_output")
    mats = (blk.attn_q, blk.attn_k, blk.attn_v, blk.attn_output)
    biases = [p.mat(n, w) for n, w in zip(names, mats, strict=True)]
    if any(b is False for b in biases) or norm[0] is None:
        return None
    vecs = [
        ("attn_norm", norm[0]),
        ("attn_norm.bias", norm[1]),
        ("post_attention_norm", blk.post_attention_norm),
        ("attn_q_norm", blk.attn_q_norm),
        ("attn_k_norm", blk.attn_k_norm),
        *((f"{n}.bias", b) for n, b in zip(names, biases, strict=True)),
        ("attn_sinks", blk.attn_sinks),
    ]
    if not all(p.vec(n, t) for n, t in vecs):
        return None
    if a.family.scale_q:  # ggml_scale of q before q·k (gemma's, phi3's graphs)
        p.flags |= F["q_scaled"]
    p.set("window", a.sliding_window if l in a.swa_layers else 0)
    p.set("scale", score_scale(a))
    p.set("softcap", a.attn_softcap)
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
    names = ("fc1", "fc2", "ffn_gate", "ffn_up", "ffn_down")
    mats = (blk.fc1 if gated else None, blk.fc2 if gated else None, blk.ffn_gate, blk.ffn_up, down)
    rows = gated or cold  # gate and up read as gathered rows (a cold task's selection too)
    dense = (True, True, not rows, not rows, stored)  # row gathers and sums read rows
    biases = [p.mat(n, w, d) for n, w, d in zip(names, mats, dense, strict=True)]
    if any(b is False for b in biases) or any(b is not None for b in (*biases[:3], biases[4])):
        return None  # a matrix the kernels cannot read; a bias other than up's (none has one)
    if biases[3] is not None and blk.ffn_gate is not None:
        return None  # an up bias in a gated FFN (no family has one; the fused GLU reads none)
    if blk.ffn_gate is not None:  # the fused GLU reads gate and up rows alike
        g, u = p.values["ffn_gate"].args, p.values["ffn_up"].args
        if any(g[i] != u[i] for i in (0, 3, 4)):  # dtype, rows, columns
            return None
    parallel = a.family.residual is Residual.PARALLEL
    norm = (blk.attn_norm, blk.attn_norm_b) if parallel else (blk.ffn_norm, blk.ffn_norm_b)
    vecs = [
        ("ffn_norm", norm[0]),
        ("ffn_norm.bias", norm[1]),
        ("post_ffw_norm", blk.post_ffw_norm),
        ("ffn_up.bias", biases[3]),
        ("ffn_down.bias", blk.ffn_down_b),
        ("tau", tau),
    ]
    if cold:  # the task gets the normed input: no norm, bias or post norm of the block's
        vecs = [("ffn_up.bias", biases[3]), ("tau", tau)]
    elif norm[0] is None:
        return None
    if not all(p.vec(n, t) for n, t in vecs):
        return None
    p.set("variant", kernels.VARIANTS[a.ffn_variant])
    return p


def record(*parts: Part) -> LayerRecord:
    """The C record of a layer made of ``parts`` (their values; the flags OR-ed)."""
    rec = LayerRecord()
    for p in parts:
        for name, v in p.values.items():
            sub, f, i = _place(name)
            if isinstance(v, kernels.Matrix):
                v = v.rec
            on = getattr(rec, sub) if sub else rec
            if i is None:
                setattr(on, f, v)
            else:
                getattr(on, f)[i] = v
        rec.flags |= p.flags
    return rec


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
