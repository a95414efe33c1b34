"""DeepSeek-2's multi-head latent attention (MLA) as llama.cpp's deepseek2 graph computes it, with
the absorption that caches the latent instead of the heads (``families/deepseek.py``).

For T tokens x (T, n_embd) after attn_norm, n_head heads, a head's q·k width d_k
(``key_length_mla``) = d_n dims without RoPE + n_rot with, value width d_v, latent width r:

    q        = attn_q_b · rms_norm(attn_q_a · x) · attn_q_a_norm  (or attn_q · x)  (T, H, d_k)
    q_n, q_r = q[..., :d_n], rope(q[..., d_n:])
    c, k_r   = attn_kv_a_mqa · x = (T, r) and (T, n_rot); k_r = rope(k_r)
    c        = rms_norm(c) · attn_kv_a_norm
    cache[p] = [c, k_r]                                   (r + n_rot) per token, one head
    q_h      = [attn_k_b[h] · q_n[h], q_r[h]]             (r + n_rot) per head
    o_h      = softmax(q_h · cache · kq_scale) · cache[:, :r]        (r,) per head
    out      = attn_output · [attn_v_b[h] · o_h for h]

kq_scale is mscale² / sqrt(d_k), mscale YaRN's magnitude (``rope_scaling.mla_kq_scale``). A file
of llama.cpp's first MLA converter holds ``attn_kv_b`` (per head d_n rows of k, then d_v rows of
v, over the latent): its v rows are ``attn_v_b[h]``, and ``attn_k_b[h] · q_n[h]`` is the sum of
its k rows weighted by q_n[h] (``Weight.rows_sum``). llama.cpp runs those files without the
absorption (heads in the cache), so their logits agree with llama.cpp's within rounding, not bit
for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from powerpy.errors import FileFormatError, ModelConfigError
from powerpy.families import Rope
from powerpy.families.deepseek import mla_layout
from powerpy.families.rope_scaling import mla_kq_scale
from powerpy.model import ggml_numerics, kernels, layer_record
from powerpy.model.attention import apply_rope
from powerpy.model.biased import row_slices
from powerpy.model.device import OnDevices
from powerpy.model.kernels import RECORD_FLAGS
from powerpy.model.matrices import Weight
from powerpy.model.norms import rms_norm

# the Block fields the latent attention reads from a deepseek2 layer (families/deepseek.py)
FIELDS = (
    "attn_q_a",
    "attn_q_a_norm",
    "attn_q_b",
    "attn_q",
    "attn_kv_a_mqa",
    "attn_kv_a_norm",
    "attn_k_b",
    "attn_v_b",
    "attn_kv_b",
)


@dataclass
class Latent:
    """One layer's latent attention weights (numpy shapes; H heads, r the latent width).

    Attributes:
        kv_a: ``attn_kv_a_mqa`` (r + n_rot, n_embd).
        kv_a_norm: (r,) f32.
        k_b: per head (r, d_n): q_n -> its latent query; or, with ``k_rows``, per head the
            (d_n, r) k rows of ``attn_kv_b``, summed weighted by q_n.
        v_b: per head (d_v, r).
        q: ``attn_q`` (H · d_k, n_embd), or None with q's low rank:
        q_a, q_a_norm, q_b: (q_lora_rank, n_embd), (q_lora_rank,), (H · d_k, q_lora_rank).
        kq_scale: the scores' scale.
    """

    kv_a: Weight
    kv_a_norm: Tensor
    k_b: list[Weight]
    v_b: list[Weight]
    kq_scale: float
    q: Weight | None = None
    q_a: Weight | None = None
    q_a_norm: Tensor | None = None
    q_b: Weight | None = None
    k_rows: bool = False
    stacks: tuple[Weight, Weight] | None = None  # (attn_k_b, attn_v_b) whole, for mla_part

    @property
    def device(self) -> torch.device:
        return self.kv_a.device

    def projections(self) -> list[Weight]:
        """The matrices a token reads (q or q_a and q_b, kv_a, the heads' k_b and v_b: the
        whole stacks where the file has them), without attn_output and the norms."""
        heads = list(self.stacks) if self.stacks is not None else [*self.k_b, *self.v_b]
        return [w for w in (self.q, self.q_a, self.q_b, self.kv_a) if w is not None] + heads

    def part(self, blk, a, l: int) -> layer_record.Part | None:
        """The layer record's attention half (``layer_record.attention_part``): mla_part."""
        return mla_part(blk, a, l)


def latent(fields: dict, args, l: int, path: str) -> Latent:
    """The latent attention of layer ``l`` from the loader's ``fields`` (popped from them):
    q's low-rank pair where ``q_lora_rank`` > 0, else ``attn_q``; ``attn_k_b`` and ``attn_v_b``,
    or a fused ``attn_kv_b`` (``args.kv_b``).

    Raises:
        FileFormatError: a tensor the layer's keys need is missing (named).
        ModelConfigError: a tensor of the other layout is there too (named).
    """
    t = {f: fields.pop(f, None) for f in FIELDS}
    need, other = mla_layout(args)
    names = {f: f"blk.{l}.{f}.weight" for f in FIELDS}
    why = f"q_lora_rank {args.q_lora_rank} and " + (
        "attention.key_length_mla unset" if args.kv_b else "attention.key_length_mla set"
    )
    for f in need:
        if t[f] is None:
            raise FileFormatError(
                f"{path}: tensor {names[f]!r} is missing; a deepseek2 layer with {why} needs "
                f"{', '.join(need)}: the file is incomplete or of another converter"
            )
    for f in other:
        if t[f] is not None:
            raise ModelConfigError(
                f"{path}: tensor {names[f]!r} does not fit a deepseek2 layer with {why} (it "
                f"holds {', '.join(need)}): re-convert the model"
            )
    H, r, d_n, d_v = args.n_head, args.kv_lora_rank, args.qk_nope, args.value_length_mla
    if args.kv_b:  # per head d_n k rows, then d_v v rows
        parts = row_slices(t["attn_kv_b"], (d_n, d_v) * H, repack=False)
        k_b, v_b, k_rows = parts[0::2], parts[1::2], True
    else:
        # 3-D tensors: llama.cpp multiplies each head's matrix as stored (no repacking)
        k_b, k_rows = row_slices(t["attn_k_b"], (r,) * H, repack=False), False
        v_b = row_slices(t["attn_v_b"], (d_v,) * H, repack=False)
    return Latent(
        kv_a=t["attn_kv_a_mqa"],
        kv_a_norm=t["attn_kv_a_norm"],
        k_b=k_b,
        v_b=v_b,
        kq_scale=mla_kq_scale(args, args.key_length_mla),
        q=t["attn_q"],
        q_a=t["attn_q_a"],
        q_a_norm=t["attn_q_a_norm"],
        q_b=t["attn_q_b"],
        k_rows=k_rows,
        stacks=None if args.kv_b else (t["attn_k_b"], t["attn_v_b"]),
    )


def mla_part(blk, a, l: int) -> layer_record.Part | None:
    """The attention half of a deepseek2 layer's record for the native decode block
    (``csrc/mla.h``, flag "mla"): attn_q (or attn_q_a), attn_kv_a_mqa, attn_q_b, attn_output,
    the per-head stacks, the norms, the widths and the score scale; None where it does not
    apply (a fused attn_kv_b, a matrix the kernels cannot read or not on the host)."""
    m: Latent = blk.mla
    lib = kernels.library()
    if lib is None or m.stacks is None:
        return None
    p = layer_record.Part(lib, flags=RECORD_FLAGS["rope"] | RECORD_FLAGS["mla"])
    mats = [
        ("attn_q" if m.q is not None else "attn_q_a", m.q if m.q is not None else m.q_a),
        ("attn_kv_a_mqa", m.kv_a),
        ("attn_q_b", m.q_b),  # (None: a plain attn_q)
        ("attn_output", blk.attn_output),
    ]
    if any(p.mat(name, w) is not None for name, w in mats):
        return None  # a matrix the kernels cannot read (False) or a bias
    for name, w in zip(("attn_k_b", "attn_v_b"), m.stacks, strict=True):
        k = w.kernel()  # each head's matrix as stored (3-D tensors: not interleaved)
        if k is None or k[0] is not lib:
            return None
        p.matrix(name, k[1])
    vecs = (
        ("attn_norm", blk.attn_norm),
        ("attn_q_a_norm", m.q_a_norm),
        ("attn_kv_a_norm", m.kv_a_norm),
    )
    if not all(p.vec(n, t) for n, t in vecs):
        return None
    p.set("mla.rank", a.kv_lora_rank)
    p.set("mla.d_nope", a.qk_nope)
    p.set("mla.d_v", a.value_length_mla)
    p.set("scale", m.kq_scale)
    return p


def attention(model, l: int, blk, x: Tensor, step, rot: OnDevices | None) -> Tensor:
    """The latent attention of x (T, n_embd) normed -> (T, n_embd) on attn_output's device;
    writes each segment's latent cache rows. ``model``: the ``transformer.Model``."""
    a, m = model.args, blk.mla
    T, dev = x.shape[0], m.device

    def on(t: Tensor, w) -> Tensor:  # t where w is (a placement may split the layer)
        return model._to(t, w.device)

    H, r, d_n, n_rot, eps = a.n_head, a.kv_lora_rank, a.qk_nope, a.n_rot, a.norm_eps
    if m.q is not None:
        q = m.q.linear(on(x, m.q))
    else:
        qa = m.q_a.linear(on(x, m.q_a))
        q = m.q_b.linear(on(rms_norm(on(qa, m.q_a_norm), m.q_a_norm, eps), m.q_b))
    q = on(q, m.kv_a).view(T, H, a.key_length_mla)
    kv = m.kv_a.linear(on(x, m.kv_a))  # (T, r + n_rot)
    c = on(rms_norm(on(kv[:, :r].contiguous(), m.kv_a_norm), m.kv_a_norm, eps), m.kv_a)
    rot_d = rot(dev) if rot is not None else None
    q_r = apply_rope(q[..., d_n:].contiguous(), rot_d, n_rot, Rope.NORM)  # (T, H, n_rot)
    k_r = apply_rope(kv[:, None, r:].contiguous(), rot_d, n_rot, Rope.NORM)[:, 0]  # (T, n_rot)
    q_n = q[..., :d_n]
    k_b = [(w, on(q_n[:, h].contiguous(), w)) for h, w in enumerate(m.k_b)]
    absorbed = [on(w.rows_sum(t) if m.k_rows else w.linear(t), m.kv_a) for w, t in k_b]
    q_lat = torch.cat([torch.stack(absorbed, dim=1), q_r], dim=2)  # (T, H, r + n_rot)
    row = torch.cat([c, k_r], dim=1)  # (T, r + n_rot)
    outs = []
    for cache, s, n in step.segments():
        p0 = cache.pos
        cache.k[l, p0 : p0 + n, 0].copy_(model._to(row[s : s + n], cache.device))
        o = _attend(q_lat[s : s + n], cache.k[l], p0, m.kq_scale, r)  # (n, H · r)
        outs.append(model._to(o, dev))
    o = (outs[0] if len(outs) == 1 else torch.cat(outs)).view(T, H, r)
    v = [on(w.linear(on(o[:, h].contiguous(), w)), blk.attn_output) for h, w in enumerate(m.v_b)]
    return blk.attn_output.linear(torch.cat(v, dim=1))  # (T, H·d_v) -> (T, n_embd)


def _attend(q: Tensor, k: Tensor, p0: int, scale: float, hv: int) -> Tensor:
    """Causal attention of q (n, H, r + n_rot) at positions p0.. over one layer's latent cache
    k (n_ctx, 1, r + n_rot) filled up to p0 + n, its first hv dims the values -> (n, H · hv):
    llama.cpp's numerics over an f16 host cache, else torch's."""
    c = ggml_numerics.library(q)
    if c is not None and k.dtype is torch.float16 and k.device.type == "cpu":
        return ggml_numerics.attention_mla(c, q, k, p0, scale, hv)
    n, H, _ = q.shape
    keys = k[: p0 + n, 0].float()  # (S, r + n_rot)
    scores = torch.einsum("nhd,sd->nhs", q.float(), keys) * scale
    hidden = keys.new_ones(n, p0 + n, dtype=torch.bool).triu(diagonal=p0 + 1)  # after p0 + i
    scores = scores.masked_fill_(hidden[:, None], -torch.inf)
    return torch.einsum("nhs,sd->nhd", scores.softmax(-1), keys[:, :hv]).reshape(n, H * hv)
