"""Write a synthetic PowerInfer (PWRI) model with random weights and working predictors:
LLaMA (the default), Falcon or OPT (``--arch``), in the layout ``powerpy.families`` declares.

The file has the keys and tensors of ``docs/formats.md#powerinfer-model-file`` (llama: ReGLU FFN;
falcon and opt: ReLU FFN without a gate; ffn_down_t, fc1/fc2) plus a byte-level SPM vocabulary
(<unk>, <s>, </s>, 256 byte tokens, then unused filler tokens up to the shape's vocabulary size),
and ``activation/activation_{i}.pt`` beside it holding each neuron's expected activation
frequency.

How the sparsity is made (so that the predictor is meaningful, not just random):
- Residual dimension 0 is a constant ``C``: every token embedding has ``C`` there, and no layer
  writes to it (row 0 of attn_output and column 0 of ffn_down_t are zero, and so are the
  matching entries of their biases).
- fc1 row 0 is ``e_0 / C``, so hidden unit 0 is always 1 and fc2 column 0 acts as a bias. The
  other hidden units come in pairs ``relu(u_k·x)``, ``relu(-u_k·x)`` whose difference is the
  linear ``u_k·x``; so ``logit_j = b_j + a_j·(U x)`` exactly.
- The row that decides whether neuron j fires (ffn_gate for llama, ffn_up for the ungated
  families, where j is active iff ``up_j·norm(x) > 0``) is ``(b_j / C) e_0 + a_j U`` (the same
  linear function, so ``logit_j >= 0`` iff ``row_j·x_pred >= 0``: after the norm's positive
  scaling, iff the neuron is active) plus an independent part the predictor cannot see
  (``--predictor-noise``, relative std), so the predictor's recall is realistic rather than
  perfect.
- LayerNorm (falcon, opt) also subtracts the mean of x, which would shift that row's value by
  ``mean(x)·sum(row_j)``. So residual dimension 1 is a sink that stays 0, the row holds
  ``-b_j / C`` there, and its other entries sum to zero: every such row sums to 0 and LayerNorm
  scales its value by ``1/std(x) > 0`` like RMSNorm. The FFN's own norm (falcon's attn_norm,
  opt's ffn_norm) is the identity (weight 1, bias 0), and ffn_up's bias (opt) is 0, for the
  same reason; the other norms, biases and the position table are random.
- The offsets ``b_j`` are calibrated layer by layer on real hidden states (a batch of
  single-token sequences run through the layers generated so far; opt's at random positions)
  so that neuron j is active with probability ``p_j``: with ``--powerlaw``, ``p_j ∝ rank^-alpha``
  (capped, hot neurons at random positions), otherwise ``p_j`` is spread mildly around
  ``--active``; the mean is ``--active`` either way.
- Sublayer outputs are rescaled so each adds about ``0.5 / sqrt(n_layer)`` of the embedding
  RMS: the residual stream stays bounded.

Family layouts: falcon is a parallel block with one fused attn_qkv (q heads, k heads, v heads)
and NeoX RoPE; a shape with one kv head is Falcon-7B-like (one attn_norm for attention and MLP),
one with several kv heads Falcon-40B-like (attention reads its own attn_norm_2). The predictor
reads the block input. opt is pre-LN with biases everywhere, learned positions
(``position_embd``, position p at row p + 2) and the output tied to token_embd; the predictor
reads the residual before ffn_norm.

The model is written layer by layer straight into the file (tensor infos first, then each
tensor as it is generated), so memory stays at about one layer plus the embeddings; the file is
renamed into place at the end. Dtypes follow upstream's converters: 1-D tensors F32; for q4_0,
gate/up/down_t/attention/embeddings/fc1/fc2 Q4_0 and output Q8_0 (upstream writes Q6_K there,
which powerpy cannot quantize).

The command line is ``tools/make_synthetic_model.py``.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from powerpy.families import Norm, Residual, Rope, family
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys, Names, bias_name
from powerpy.formats.gguf_types import tensor_nbytes
from powerpy.formats.gguf_writer import GGUFStreamWriter
from powerpy.testing.tiny import TinySpec, encode_array, spec_args, vocab_kv

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ctx: int
    n_vocab: int
    hidden: int  # predictor H


SHAPES = {
    "tiny": Shape(256, 1024, 2, 4, 2, 512, 512, 64),
    "1b": Shape(2048, 5632, 22, 32, 4, 2048, 32000, 256),  # TinyLlama-1.1B dimensions
    "7b": Shape(4096, 11008, 32, 32, 32, 4096, 32000, 1024),  # LLaMA-2-7B dimensions
}
# Falcon: "tiny" is multi-query (one kv head, one norm per block: Falcon-7B's layout); "1b" has
# 4 kv heads and so attn_norm_2, the layout of ReluFalcon-40B, the Falcon PowerInfer ships (8
# kv heads for 128 q heads there; 4 for 32 keeps that grouping's KV share of the attention).
FALCON_SHAPES = {
    "tiny": Shape(256, 1024, 2, 4, 1, 512, 512, 64),
    "1b": Shape(2048, 8192, 24, 32, 4, 2048, 65024, 256),  # n_ff = 4·n_embd, Falcon's vocab
}
OPT_SHAPES = {
    "tiny": Shape(256, 1024, 2, 4, 4, 512, 512, 64),
    "1b": Shape(2048, 8192, 24, 32, 32, 2048, 50272, 256),  # OPT-1.3B dimensions
}
ARCH_SHAPES = {"llama": SHAPES, "falcon": FALCON_SHAPES, "opt": OPT_SHAPES}
ARCHS = tuple(ARCH_SHAPES)
TIED_OUTPUT = frozenset({"opt"})  # archs written without output.weight (tied to token_embd)
DTYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}
FILE_TYPE = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q4_0: 2, GGMLType.Q8_0: 7}

C = 4.0  # the constant residual dimension; the largest element of its Q4_0/Q8_0 block
SIGMA_E = 1.0  # embedding std in the other dimensions
SIGMA_P = 0.5  # learned position embeddings' std (opt)
RMS_EPS = 1e-5
F32 = GGMLType.F32  # 1-D tensors (norms, biases)
LN_EPS = 1e-5  # LayerNorm's (falcon, opt): TinySpec's norm_eps, written to the file


# ---- encoding ------------------------------------------------------------------------------------


def encode(w: torch.Tensor, ggml_type: GGMLType) -> np.ndarray:
    """f32 tensor -> the array written to the file (typed for floats, raw blocks for quants)."""
    return encode_array(w.detach().float().contiguous().numpy(), ggml_type)


# ---- model pieces --------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of x (M, d), times w (d,) when given."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    return y if w is None else y * w


def layer_norm(
    x: torch.Tensor, w: torch.Tensor | None = None, b: torch.Tensor | None = None
) -> torch.Tensor:
    """LayerNorm of the rows of x (M, d), with weight w and bias b (d,) when given."""
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, LN_EPS)


def target_probs(
    n: int, active: float, powerlaw: bool, alpha: float, gen: torch.Generator
) -> torch.Tensor:
    """Per-neuron activation probabilities with mean ``active``: (n,) f64."""
    p_max = 0.97
    if powerlaw:
        r = torch.arange(1, n + 1, dtype=torch.float64) ** -alpha
        lo, hi = 0.0, active / float(r.mean()) * 10 + 1.0
        for _ in range(100):  # bisection on the scale a: mean(min(p_max, a r)) = active
            a = (lo + hi) / 2
            lo, hi = (a, hi) if float((a * r).clamp(max=p_max).mean()) < active else (lo, a)
        p = (a * r).clamp(max=p_max)
        return p[torch.randperm(n, generator=gen)]  # hot neurons at random positions
    p = torch.exp(0.3 * torch.randn(n, generator=gen, dtype=torch.float64))
    return (p * active / p.mean()).clamp(1e-4, p_max)


def scaled_to(y: torch.Tensor, target_rms: float) -> float:
    """Factor that brings the RMS of y (dims 1..) to target_rms."""
    rms = float(y[:, 1:].pow(2).mean().sqrt())
    return target_rms / max(rms, 1e-12)


@dataclass
class Plan:
    """What a file holds: its shape, family and tensor types."""

    shape: Shape
    wtype: GGMLType  # 2-D weights
    ptype: GGMLType  # predictors
    otype: GGMLType  # output
    arch: str = "llama"

    @property
    def norm_2(self) -> bool:
        """Falcon with several kv heads has attn_norm_2, attention's own norm (40B layout)."""
        return self.arch == "falcon" and self.shape.n_head_kv > 1

    @property
    def tied(self) -> bool:
        """No output.weight: the logits read token_embd."""
        return self.arch in TIED_OUTPUT


def layer_table(plan: Plan, l: int) -> list[tuple[str, str, tuple[int, ...], GGMLType]]:
    """Layer l's tensors in file order, from the family's record: ``(key, GGUF name, numpy
    shape, type)``, where key is the ``Block`` field (``LayerTensor.field``, or ffn_down_t, fc1,
    fc2) with ".bias" added for a bias. Required biases are written, optional ones are not."""
    fam, s = family(plan.arch), plan.shape
    gqa = s.n_embd // s.n_head * s.n_head_kv
    dims = {"n_embd": s.n_embd, "n_ff": s.n_ff, "n_embd_gqa": gqa, "n_embd_qkv": s.n_embd + 2 * gqa}
    out: list[tuple[str, str, tuple[int, ...], GGMLType]] = []

    def add(key: str, template: str, shape: tuple[int, ...], ggml_type: GGMLType, bias: str):
        out.append((key, template.format(l=l), shape, ggml_type if len(shape) == 2 else F32))
        if bias == "required":  # (rows,); ffn_down_t's is the output's, (n_embd,)
            n = s.n_embd if key == "ffn_down_t" else shape[0]
            out.append((f"{key}.bias", bias_name(template).format(l=l), (n,), F32))

    for t in fam.block:
        if t.optional and not (t.field == "attn_norm_2" and plan.norm_2):
            continue
        add(t.field, t.name, tuple(dims[x] for x in t.shape), plan.wtype, t.bias)
    add("ffn_down_t", Names.FFN_DOWN_T, (s.n_ff, s.n_embd), plan.wtype, fam.down_bias)
    add("fc1", Names.FC1, (s.hidden, s.n_embd), plan.ptype, "none")
    add("fc2", Names.FC2, (s.n_ff, s.hidden), plan.ptype, "none")
    return out


def tensor_infos(plan: Plan) -> list[tuple[str, tuple[int, ...], GGMLType]]:
    """The file's tensor table in order: ``(name, numpy shape, type)``."""
    fam, s = family(plan.arch), plan.shape
    infos = [(Names.TOKEN_EMBD, (s.n_vocab, s.n_embd), plan.wtype)]
    if fam.rope is Rope.LEARNED:
        infos.append((Names.POS_EMBD, (s.n_ctx + fam.position_offset, s.n_embd), plan.wtype))
    for l in range(s.n_layer):
        infos += [(name, shape, t) for _, name, shape, t in layer_table(plan, l)]
    infos.append((Names.OUTPUT_NORM, (s.n_embd,), F32))
    if fam.output_norm_bias:
        infos.append((bias_name(Names.OUTPUT_NORM), (s.n_embd,), F32))
    if not plan.tied:
        infos.append((Names.OUTPUT, (s.n_vocab, s.n_embd), plan.otype))
    return infos


def key_values(plan: Plan, name: str, threshold: float | None) -> dict:
    """The file's key/values (``ModelArgs.to_gguf_kv``, the byte vocabulary, file type)."""
    s, fam = plan.shape, family(plan.arch)
    spec = TinySpec(s.n_embd, s.n_layer, s.n_ff, s.n_head, s.n_head_kv, s.hidden, n_ctx=s.n_ctx,
                    arch=plan.arch)  # fmt: skip
    kv = spec_args(spec, s.n_vocab).to_gguf_kv(name=name)  # the family's sparse FFN
    if fam.rope is Rope.LEARNED:  # no rotation: no RoPE keys
        for key in (Keys.ROPE_DIMENSION_COUNT, Keys.ROPE_FREQ_BASE):
            kv.pop(key.format(arch=plan.arch))
    if plan.arch == "falcon":
        kv[Keys.TENSOR_DATA_LAYOUT.format(arch="falcon")] = ("jploski", GGUFValueType.STRING)
    kv[Keys.FILE_TYPE] = (FILE_TYPE[plan.wtype], GGUFValueType.UINT32)
    if threshold is not None:
        kv[Keys.SPARSE_THRESHOLD] = (float(threshold), GGUFValueType.FLOAT32)
    kv.update(vocab_kv(s.n_vocab))
    kv[Keys.ADD_BOS] = (True, GGUFValueType.BOOL)
    return kv


@dataclass
class Neurons:
    """One layer's FFN neurons as the predictor sees them (module docstring)."""

    rows: torch.Tensor  # (n_ff, d) unit rows deciding activity: ffn_gate, or ffn_up ungated
    fc1: torch.Tensor  # (H, d)
    fc2: torch.Tensor  # (n_ff, H)
    p: torch.Tensor  # (n_ff,) f64 target activation probabilities


def _centre(w: torch.Tensor) -> None:
    """Zero column 1 (the sink) of w (rows, d) and make each row's dims 2.. sum to zero."""
    w[:, 1] = 0.0
    w[:, 2:] -= w[:, 2:].mean(1, keepdim=True)


def neurons(
    X: torch.Tensor,
    s: Shape,
    gen: torch.Generator,
    *,
    active: float,
    powerlaw: bool,
    alpha: float,
    predictor_noise: float,
    sink: bool,
) -> Neurons:
    """The deciding rows and predictor of one layer, calibrated on the states X (M, d) that the
    predictor reads; ``sink``: LayerNorm families (rows that sum to zero, module docstring)."""
    d = s.n_embd
    r = (s.hidden - 1) // 2  # linear directions the predictor represents exactly
    U = torch.randn(r, d, generator=gen)
    U[:, 0] = 0.0
    if sink:
        _centre(U)
    U /= U.norm(dim=1, keepdim=True)
    A = torch.randn(s.n_ff, r, generator=gen) / math.sqrt(r)
    lin = (X @ U.T) @ A.T  # (M, n_ff) the predictable part a_j·(U x)
    mu, sd = lin.mean(0), lin.std(0).clamp_min(1e-6)
    p = target_probs(s.n_ff, active, powerlaw, alpha, gen)
    z = torch.distributions.Normal(0.0, 1.0).icdf(p).float()
    b = -mu + sd * z  # logit offset: P(b + a_j·Ux >= 0) = p_j (Gaussian model)
    rows = A @ U  # (n_ff, d)
    rows[:, 0] = b / C
    if sink:
        rows[:, 1] = -b / C
    E = torch.randn(s.n_ff, d, generator=gen)
    E[:, 0] = 0.0
    if sink:
        _centre(E)
    e_sd = (X @ E.T).std(0).clamp_min(1e-6)
    E *= (predictor_noise * sd / e_sd)[:, None]
    rows += E
    del E
    scale = 1.0 / rows.norm(dim=1)  # unit-norm rows; the same positive scale on fc2
    rows *= scale[:, None]
    fc1 = torch.zeros(s.hidden, d)
    fc1[0, 0] = 1.0 / C
    fc1[1 : 1 + r] = U
    fc1[1 + r : 1 + 2 * r] = -U
    fc2 = torch.zeros(s.n_ff, s.hidden)
    fc2[:, 0] = b
    fc2[:, 1 : 1 + r] = A
    fc2[:, 1 + r : 1 + 2 * r] = -A
    fc2 *= scale[:, None]
    return Neurons(rows, fc1, fc2, p)


def _layer(
    plan: Plan, X: torch.Tensor, gen: torch.Generator, **opts
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, tuple[float, float, float]]:
    """One layer: its tensors (keys of ``layer_table``) and the calibration states after it.

    Returns ``(X', tensors, p, (predicted active, true active, recall))``."""
    fam, s = family(plan.arch), plan.shape
    d, hd = s.n_embd, s.n_embd // s.n_head
    gqa = s.n_head_kv * hd
    ln = fam.norm is Norm.LAYER
    parallel = fam.residual is Residual.PARALLEL
    keys = {key for key, *_ in layer_table(plan, 0)}
    k0 = 2 if ln else 1  # dims no layer writes: 0 holds C, 1 is LayerNorm's sink
    beta = 0.5 / math.sqrt(s.n_layer)  # each sublayer adds this much of the embedding RMS

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen)

    def norm(
        x: torch.Tensor, w: torch.Tensor | None = None, b: torch.Tensor | None = None
    ) -> torch.Tensor:  # the family's norm
        return layer_norm(x, w, b) if ln else rms_norm(x, w)

    out: dict[str, torch.Tensor] = {}
    # the FFN's norm is the identity (module docstring); attention's is random unless shared
    ffn_norm = "attn_norm" if parallel else "ffn_norm"
    attn_norm = "attn_norm_2" if "attn_norm_2" in keys else "attn_norm"
    out[ffn_norm], out[f"{ffn_norm}.bias"] = torch.ones(d), torch.zeros(d)
    w_a = b_a = None
    if attn_norm != ffn_norm:
        w_a = 1.0 + 0.1 * randn(d)
        b_a = 0.1 * randn(d) if ln else None
        out[attn_norm], out[f"{attn_norm}.bias"] = w_a, b_a
    # -- attention: for one-token sequences its output is W_o · expand(W_v · x + b_v) + b_o
    wq = randn(d, d) / math.sqrt(d)
    wk = randn(gqa, d) / math.sqrt(d)
    wv = randn(gqa, d) / math.sqrt(d)
    wo = randn(d, d) / math.sqrt(d)
    wo[:k0] = 0.0  # never write the constant dimensions
    bias = {}
    for key, n in (("attn_q", d), ("attn_k", gqa), ("attn_v", gqa), ("attn_output", d)):
        if f"{key}.bias" in keys:
            bias[key] = 0.1 * randn(n)
    if "attn_output" in bias:
        bias["attn_output"][:k0] = 0.0
    v = norm(X, w_a, b_a) @ wv.T  # (M, n_kv * hd)
    if "attn_v" in bias:
        v = v + bias["attn_v"]
    v = v.view(-1, s.n_head_kv, hd).repeat_interleave(s.n_head // s.n_head_kv, dim=1)
    a = v.reshape(-1, d) @ wo.T  # (M, d)
    if "attn_output" in bias:
        a = a + bias["attn_output"]
    k_o = scaled_to(a, beta * SIGMA_E)
    wo *= k_o
    if "attn_output" in bias:
        bias["attn_output"] *= k_o
    a = a * k_o
    if "attn_qkv" in keys:
        out["attn_qkv"] = torch.cat([wq, wk, wv])  # q heads, k heads, v heads ("jploski")
    out.update(attn_q=wq, attn_k=wk, attn_v=wv, attn_output=wo)
    out.update({f"{k}.bias": b for k, b in bias.items()})
    del wq, wk, wv, v
    if not parallel:
        X = X + a
    # -- predictor and the deciding rows (x_pred = X, the FFN input before its norm)
    nr = neurons(X, s, gen, sink=ln, **opts)
    up = randn(s.n_ff, d) / math.sqrt(d) if fam.gated else nr.rows
    # -- FFN on the calibration states (its norm is the identity)
    xn = norm(X)
    g = xn @ nr.rows.T  # (M, n_ff)
    hmat = torch.relu(g) * (xn @ up.T) if fam.gated else torch.relu(g)
    logits = torch.relu(X @ nr.fc1.T) @ nr.fc2.T
    pred, true = logits >= 0, g > 0
    recall = float((pred & true).sum() / true.sum().clamp_min(1))
    down_t = randn(s.n_ff, d)
    down_t[:, :k0] = 0.0
    y = hmat @ down_t  # (M, d)
    b_d = None
    if "ffn_down_t.bias" in keys:
        b_d = 0.1 * randn(d)
        b_d[:k0] = 0.0
        y = y + b_d
    k_d = scaled_to(y, beta * SIGMA_E)
    down_t *= k_d
    X = X + y * k_d
    if parallel:
        X = X + a
    if b_d is not None:
        out["ffn_down_t.bias"] = b_d * k_d
    out.update(ffn_gate=nr.rows, ffn_up=up, ffn_down_t=down_t, fc1=nr.fc1, fc2=nr.fc2)
    out["ffn_up.bias"] = torch.zeros(s.n_ff)  # 0: the norm's scale must not shift the sign
    rates = (float(pred.float().mean()), float(true.float().mean()), recall)
    return X, out, nr.p, rates


@torch.no_grad()
def generate(
    plan: Plan,
    *,
    active: float = 0.10,
    powerlaw: bool = False,
    alpha: float = 1.4,
    predictor_noise: float = 0.2,
    calib_tokens: int = 256,
    seed: int = 0,
    stats: list[torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the model's tensors, f32 in numpy shapes, in the order of ``tensor_infos(plan)``;
    append each layer's activation probabilities (n_ff,) to ``stats``. The arguments are
    ``write_synthetic_model``'s. A yielded tensor is not changed afterwards."""
    fam, s = family(plan.arch), plan.shape
    ln = fam.norm is Norm.LAYER
    gen = torch.Generator().manual_seed(seed)
    d = s.n_embd
    opts = dict(active=active, powerlaw=powerlaw, alpha=alpha, predictor_noise=predictor_noise)
    t0 = time.time()
    # token embeddings: dims 1.. N(0, SIGMA_E), dim 0 = C, the block's largest magnitude
    emb = torch.randn(s.n_vocab, d, generator=gen) * SIGMA_E
    emb[:, 1:32].clamp_(-0.95 * C, 0.95 * C)
    emb[:, 0] = C
    if ln:
        emb[:, 1] = 0.0  # the sink
    yield Names.TOKEN_EMBD, emb
    # calibration states: the byte tokens and specials, as single-token sequences
    n_cal = min(calib_tokens, s.n_vocab)
    X = emb[torch.randperm(min(s.n_vocab, 259), generator=gen)[:n_cal]].clone()  # (M, d)
    if n_cal > 259:
        X = torch.cat([X, emb[259 : 259 + n_cal - X.shape[0]]])
    del emb
    if fam.rope is Rope.LEARNED:  # position p is row p + offset; calibrate at random positions
        off = fam.position_offset
        pos = torch.randn(s.n_ctx + off, d, generator=gen) * SIGMA_P
        pos[:, :2] = 0.0
        yield Names.POS_EMBD, pos
        X = X + pos[off + torch.randint(s.n_ctx, (X.shape[0],), generator=gen)]
        del pos
    for l in range(s.n_layer):
        X, tensors, p, (pred, true, recall) = _layer(plan, X, gen, **opts)
        for key, name, _, _ in layer_table(plan, l):
            yield name, tensors[key]
        del tensors
        if stats is not None:
            stats.append(p.float())
        log.info(
            "layer %3d: predicted active %.3f (target %.3f), true active %.3f, recall %.3f, "
            "residual rms %.2f  [%.0f s]",
            l, pred, active, true, recall, float(X[:, 1:].pow(2).mean().sqrt()), time.time() - t0,
        )  # fmt: skip
    yield Names.OUTPUT_NORM, 1.0 + 0.1 * torch.randn(d, generator=gen)
    if fam.output_norm_bias:
        yield bias_name(Names.OUTPUT_NORM), 0.1 * torch.randn(d, generator=gen)
    if not plan.tied:
        yield Names.OUTPUT, torch.randn(s.n_vocab, d, generator=gen) / math.sqrt(d)


def plan_for(
    arch: str, shape: str | Shape, dtype: str, predictor_dtype: str | None = None
) -> tuple[Plan, str]:
    """The plan of an architecture, a shape (a name of ``ARCH_SHAPES[arch]`` or a ``Shape``)
    and dtypes, and the shape's name.

    Raises:
        ValueError: an unknown architecture, shape or dtype.
    """
    if arch not in ARCH_SHAPES:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHS)}")
    if isinstance(shape, Shape):
        shape_, shape_name = shape, "custom"
    elif shape in ARCH_SHAPES[arch]:
        shape_, shape_name = ARCH_SHAPES[arch][shape], shape
    else:
        raise ValueError(f"{arch} has no shape {shape!r} (it has {', '.join(ARCH_SHAPES[arch])})")
    for dt in (dtype, predictor_dtype):
        if dt is not None and dt not in DTYPES:
            raise ValueError(f"dtype {dt!r} is not one of {', '.join(DTYPES)}")
    wtype = DTYPES[dtype]
    ptype = DTYPES[predictor_dtype] if predictor_dtype else wtype
    otype = GGMLType.Q8_0 if wtype == GGMLType.Q4_0 else wtype
    return Plan(shape_, wtype, ptype, otype, arch), shape_name


def write_synthetic_model(
    out: str | Path,
    shape: str | Shape = "tiny",
    dtype: str = "f16",
    *,
    arch: str = "llama",
    active: float = 0.10,
    powerlaw: bool = False,
    alpha: float = 1.4,
    layers: int | None = None,
    hidden: int | None = None,
    predictor_dtype: str | None = None,
    predictor_noise: float = 0.2,
    threshold: float | None = None,
    calib_tokens: int = 256,
    seed: int = 0,
    stats: bool = True,
) -> Path:
    """Write a synthetic PWRI model (see the module docstring) and its activation statistics.

    Args:
        out: the model file (written atomically; statistics go to ``out.parent/activation``).
        shape: a name of ``ARCH_SHAPES[arch]`` ("tiny", "1b"; llama also "7b") or a ``Shape``;
            ``layers``/``hidden`` override its depth and predictor size.
        dtype: "f32", "f16", "q8_0" or "q4_0" for 2-D weights (``predictor_dtype`` for fc1/fc2).
        arch: "llama", "falcon" or "opt".
        active: mean active fraction per token; ``powerlaw``/``alpha``: power-law hot neurons.
        predictor_noise: relative std of the deciding rows' part the predictor cannot see.
        threshold: write ``powerinfer.sparse_threshold``.
        calib_tokens, seed: calibration states and RNG seed.
        stats: write ``activation/activation_{i}.pt``.

    Raises:
        ValueError: bad arguments, or not enough disk space.
    """
    if not 0.0 < active < 1.0:
        raise ValueError(f"active must be in (0, 1), got {active}")
    plan, shape_name = plan_for(arch, shape, dtype, predictor_dtype)
    if layers is not None:
        plan.shape = replace(plan.shape, n_layer=layers)
    if hidden is not None:
        plan.shape = replace(plan.shape, hidden=hidden)
    s = plan.shape
    if s.hidden < 3 or (plan.ptype not in (GGMLType.F32, GGMLType.F16) and s.hidden % 32):
        raise ValueError(
            f"predictor hidden size {s.hidden} must be >= 3 (a multiple of 32 "
            "for quantized predictors)"
        )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    infos = tensor_infos(plan)
    total = sum(tensor_nbytes(tuple(reversed(shp)), t) for _, shp, t in infos)
    free = shutil.disk_usage(out.parent).free
    if total * 1.05 + (1 << 26) > free:
        raise ValueError(f"{out}: needs {total / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free")
    log.info(
        "%s %s %s: %d layers, n_embd %d, n_ff %d, H %d, %.2f GiB -> %s",
        arch, shape_name, dtype, s.n_layer, s.n_embd, s.n_ff, s.hidden, total / 2**30, out,
    )  # fmt: skip

    prefix = "powerpy-synthetic" if arch == "llama" else f"powerpy-synthetic-{arch}"
    name = f"{prefix}-{shape_name}-{dtype}"
    writer = GGUFStreamWriter(out, key_values(plan, name, threshold), infos, magic=b"PWRI")
    types = {n: t for n, _, t in infos}
    t0 = time.time()
    act_stats: list[torch.Tensor] = []
    try:
        for tensor_name, w in generate(
            plan,
            active=active,
            powerlaw=powerlaw,
            alpha=alpha,
            predictor_noise=predictor_noise,
            calib_tokens=calib_tokens,
            seed=seed,
            stats=act_stats,
        ):
            writer.write(tensor_name, encode(w, types[tensor_name]))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    if stats:
        from powerpy.formats.stats import save_activation_stats

        act_dir = out.parent / "activation"
        save_activation_stats(act_dir, act_stats)
        log.info("wrote %d activation files to %s", len(act_stats), act_dir)
    log.info("done in %.1f s: %s (%.2f GiB)", time.time() - t0, out, out.stat().st_size / 2**30)
    return out
