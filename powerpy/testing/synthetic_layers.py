"""The tensors of a synthetic PWRI model, layer by layer: the family's layout (``layer_table``,
``tensor_infos``), the calibrated predictor and neurons (``neurons``) and the stream of tensors
(``generate``). How the sparsity is made is in ``powerpy.testing.synthetic``, which writes the
files."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from powerpy.families import Norm, Residual, Rope, family
from powerpy.formats.constants import GGMLType, Names, bias_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    """A synthetic model's dimensions."""

    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ctx: int
    n_vocab: int
    hidden: int  # predictor H


TIED_OUTPUT = frozenset({"opt"})  # archs written without output.weight (tied to token_embd)
C = 4.0  # the constant residual dimension; the largest element of its Q4_0/Q8_0 block
SIGMA_E = 1.0  # embedding std in the other dimensions
SIGMA_P = 0.5  # learned position embeddings' std (opt)
RMS_EPS = 1e-5
F32 = GGMLType.F32  # 1-D tensors (norms, biases)
LN_EPS = 1e-5  # LayerNorm's (falcon, opt): TinySpec's norm_eps, written to the file


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
    dims = {
        "n_embd": s.n_embd,
        "n_ff": s.n_ff,
        "n_embd_gqa": gqa,
        "n_embd_q": s.n_embd,
        "n_embd_qkv": s.n_embd + 2 * gqa,
    }
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
            l,
            pred,
            active,
            true,
            recall,
            float(X[:, 1:].pow(2).mean().sqrt()),
            time.time() - t0,
        )
    yield Names.OUTPUT_NORM, 1.0 + 0.1 * torch.randn(d, generator=gen)
    if fam.output_norm_bias:
        yield bias_name(Names.OUTPUT_NORM), 0.1 * torch.randn(d, generator=gen)
    if not plan.tied:
        yield Names.OUTPUT, torch.randn(s.n_vocab, d, generator=gen) / math.sqrt(d)
