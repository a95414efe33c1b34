"""Write a synthetic PowerInfer (PWRI) llama model with random weights and working predictors.

The file has the keys and tensors of ``docs/formats.md#powerinfer-model-file`` (llama arch, ReGLU
FFN, ffn_down_t, fc1/fc2) plus a byte-level SPM vocabulary (<unk>, <s>, </s>, 256 byte tokens, then
unused filler tokens up to the shape's vocabulary size), and ``activation/activation_{i}.pt`` beside
it holding each neuron's expected activation frequency.

How the sparsity is made (so that the predictor is meaningful, not just random):
- Residual dimension 0 is a constant ``C``: every token embedding has ``C`` there, and no layer
  writes to it (row 0 of attn_output and column 0 of ffn_down_t are zero).
- fc1 row 0 is ``e_0 / C``, so hidden unit 0 is always 1 and fc2 column 0 acts as a bias. The
  other hidden units come in pairs ``relu(u_k·x)``, ``relu(-u_k·x)`` whose difference is the
  linear ``u_k·x``; so ``logit_j = b_j + a_j·(U x)`` exactly.
- ffn_gate row j is ``(b_j / C) e_0 + a_j U`` (the same linear function, so ``logit_j >= 0``
  iff ``gate_j·x_pred >= 0``: after the positive RMSNorm scaling, iff relu(gate) is active) plus
  an independent part the predictor cannot see (``--predictor-noise``, relative std), so the
  predictor's recall is realistic rather than perfect.
- The offsets ``b_j`` are calibrated layer by layer on real hidden states (a batch of
  single-token sequences run through the layers generated so far) so that neuron j is active
  with probability ``p_j``: with ``--powerlaw``, ``p_j ∝ rank^-alpha`` (capped, hot neurons at
  random positions), otherwise ``p_j`` is spread mildly around ``--active``; the mean is
  ``--active`` either way.
- Sublayer outputs are rescaled so each adds about ``0.5 / sqrt(n_layer)`` of the embedding
  RMS: the residual stream stays bounded.

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
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from powerpy.formats.constants import GGMLType, GGUFValueType, Keys, Names
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
DTYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}
FILE_TYPE = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q4_0: 2, GGMLType.Q8_0: 7}

C = 4.0  # the constant residual dimension; the largest element of its Q4_0/Q8_0 block
SIGMA_E = 1.0  # embedding std in the other dimensions
RMS_EPS = 1e-5


# ---- encoding ------------------------------------------------------------------------------------


def encode(w: torch.Tensor, ggml_type: GGMLType) -> np.ndarray:
    """f32 tensor -> the array written to the file (typed for floats, raw blocks for quants)."""
    return encode_array(w.detach().float().contiguous().numpy(), ggml_type)


# ---- model pieces --------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    return y if w is None else y * w


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
    shape: Shape
    wtype: GGMLType  # 2-D weights
    ptype: GGMLType  # predictors
    otype: GGMLType  # output


def tensor_infos(plan: Plan) -> list[tuple[str, tuple[int, ...], GGMLType]]:
    s = plan.shape
    hd = s.n_embd // s.n_head
    gqa = hd * s.n_head_kv
    infos = [(Names.TOKEN_EMBD, (s.n_vocab, s.n_embd), plan.wtype)]
    for l in range(s.n_layer):
        infos += [
            (Names.ATTN_NORM.format(l=l), (s.n_embd,), GGMLType.F32),
            (Names.ATTN_Q.format(l=l), (s.n_embd, s.n_embd), plan.wtype),
            (Names.ATTN_K.format(l=l), (gqa, s.n_embd), plan.wtype),
            (Names.ATTN_V.format(l=l), (gqa, s.n_embd), plan.wtype),
            (Names.ATTN_OUTPUT.format(l=l), (s.n_embd, s.n_embd), plan.wtype),
            (Names.FFN_NORM.format(l=l), (s.n_embd,), GGMLType.F32),
            (Names.FFN_GATE.format(l=l), (s.n_ff, s.n_embd), plan.wtype),
            (Names.FFN_UP.format(l=l), (s.n_ff, s.n_embd), plan.wtype),
            (Names.FFN_DOWN_T.format(l=l), (s.n_ff, s.n_embd), plan.wtype),
            (Names.FC1.format(l=l), (s.hidden, s.n_embd), plan.ptype),
            (Names.FC2.format(l=l), (s.n_ff, s.hidden), plan.ptype),
        ]
    infos += [
        (Names.OUTPUT_NORM, (s.n_embd,), GGMLType.F32),
        (Names.OUTPUT, (s.n_vocab, s.n_embd), plan.otype),
    ]
    return infos


def key_values(plan: Plan, name: str, threshold: float | None) -> dict:
    """The file's key/values (``ModelArgs.to_gguf_kv``, the byte vocabulary, file type)."""
    s = plan.shape
    spec = TinySpec(s.n_embd, s.n_layer, s.n_ff, s.n_head, s.n_head_kv, s.hidden, n_ctx=s.n_ctx)
    kv = spec_args(spec, s.n_vocab).to_gguf_kv(name=name)
    kv[Keys.FILE_TYPE] = (FILE_TYPE[plan.wtype], GGUFValueType.UINT32)
    if threshold is not None:
        kv[Keys.SPARSE_THRESHOLD] = (float(threshold), GGUFValueType.FLOAT32)
    kv.update(vocab_kv(s.n_vocab))
    kv[Keys.ADD_BOS] = (True, GGUFValueType.BOOL)
    return kv


@torch.no_grad()
def write_synthetic_model(
    out: str | Path,
    shape: str = "tiny",
    dtype: str = "f16",
    *,
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
        shape: "tiny", "1b" or "7b" (``SHAPES``); ``layers``/``hidden`` override its depth and
            predictor size.
        dtype: "f32", "f16", "q8_0" or "q4_0" for 2-D weights (``predictor_dtype`` for fc1/fc2).
        active: mean active fraction per token; ``powerlaw``/``alpha``: power-law hot neurons.
        predictor_noise: relative std of the gate part the predictor cannot see.
        threshold: write ``powerinfer.sparse_threshold``.
        calib_tokens, seed: calibration states and RNG seed.
        stats: write ``activation/activation_{i}.pt``.

    Raises:
        ValueError: bad arguments, or not enough disk space.
    """
    if not 0.0 < active < 1.0:
        raise ValueError(f"active must be in (0, 1), got {active}")
    shape_name = shape
    shape_ = SHAPES[shape]
    if layers is not None:
        shape_ = replace(shape_, n_layer=layers)
    if hidden is not None:
        shape_ = replace(shape_, hidden=hidden)
    shape = shape_
    wtype = DTYPES[dtype]
    ptype = DTYPES[predictor_dtype] if predictor_dtype else wtype
    otype = GGMLType.Q8_0 if wtype == GGMLType.Q4_0 else wtype
    plan = Plan(shape, wtype, ptype, otype)
    s = shape
    if s.hidden < 3 or (ptype not in (GGMLType.F32, GGMLType.F16) and s.hidden % 32):
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
        "%s %s: %d layers, n_embd %d, n_ff %d, H %d, %.2f GiB -> %s",
        shape_name, dtype, s.n_layer, s.n_embd, s.n_ff, s.hidden, total / 2**30, out,
    )  # fmt: skip

    gen = torch.Generator().manual_seed(seed)
    d, hd = s.n_embd, s.n_embd // s.n_head
    beta = 0.5 / math.sqrt(s.n_layer)  # each sublayer adds this much of the embedding RMS

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen)

    name = f"powerpy-synthetic-{shape_name}-{dtype}"
    writer = GGUFStreamWriter(out, key_values(plan, name, threshold), infos, magic=b"PWRI")
    types = {n: t for n, _, t in infos}

    def put(tensor_name: str, w: torch.Tensor) -> None:
        writer.write(tensor_name, encode(w, types[tensor_name]))

    t0 = time.time()
    act_stats: list[torch.Tensor] = []
    try:
        # token embeddings: dims 1.. N(0, SIGMA_E), dim 0 = C, the block's largest magnitude
        emb = randn(s.n_vocab, d) * SIGMA_E
        emb[:, 1:32].clamp_(-0.95 * C, 0.95 * C)
        emb[:, 0] = C
        put(Names.TOKEN_EMBD, emb)
        # calibration states: the byte tokens and specials, as single-token sequences
        n_cal = min(calib_tokens, s.n_vocab)
        X = emb[torch.randperm(min(s.n_vocab, 259), generator=gen)[:n_cal]].clone()  # (M, d)
        if n_cal > 259:
            X = torch.cat([X, emb[259 : 259 + n_cal - X.shape[0]]])
        del emb
        r = (s.hidden - 1) // 2  # linear directions the predictor represents exactly
        for l in range(s.n_layer):
            f = {k: getattr(Names, k).format(l=l) for k in vars(Names) if k.isupper()}
            # -- attention: for one-token sequences its output is W_o · expand(W_v · x)
            attn_norm = 1.0 + 0.1 * randn(d)
            wq = randn(d, d) / math.sqrt(d)
            wk = randn(s.n_head_kv * hd, d) / math.sqrt(d)
            wv = randn(s.n_head_kv * hd, d) / math.sqrt(d)
            wo = randn(d, d) / math.sqrt(d)
            wo[0] = 0.0  # never write the constant dimension
            v = rms_norm(X, attn_norm) @ wv.T  # (M, n_kv * hd)
            v = v.view(-1, s.n_head_kv, hd).repeat_interleave(s.n_head // s.n_head_kv, dim=1)
            a = v.reshape(-1, d) @ wo.T  # (M, d)
            k_o = scaled_to(a, beta * SIGMA_E)
            wo *= k_o
            X = X + a * k_o
            for key, w in (
                ("ATTN_NORM", attn_norm),
                ("ATTN_Q", wq),
                ("ATTN_K", wk),
                ("ATTN_V", wv),
                ("ATTN_OUTPUT", wo),
            ):
                put(f[key], w)
            del wq, wk, wv, wo, v, a
            # -- predictor and gate (x_pred = X, the pre-norm FFN input)
            U = randn(r, d)
            U[:, 0] = 0.0
            U /= U.norm(dim=1, keepdim=True)
            A = randn(s.n_ff, r) / math.sqrt(r)
            lin = (X @ U.T) @ A.T  # (M, n_ff) the predictable part a_j·(U x)
            mu, sd = lin.mean(0), lin.std(0).clamp_min(1e-6)
            p = target_probs(s.n_ff, active, powerlaw, alpha, gen)
            z = torch.distributions.Normal(0.0, 1.0).icdf(p).float()
            b = -mu + sd * z  # logit offset: P(b + a_j·Ux >= 0) = p_j (Gaussian model)
            gate = A @ U  # (n_ff, d)
            gate[:, 0] = b / C
            E = randn(s.n_ff, d)
            E[:, 0] = 0.0
            e_sd = (X @ E.T).std(0).clamp_min(1e-6)
            E *= (predictor_noise * sd / e_sd)[:, None]
            gate += E
            del E
            scale = 1.0 / gate.norm(dim=1)  # unit-norm rows; the same positive scale on fc2
            gate *= scale[:, None]
            fc1 = torch.zeros(s.hidden, d)
            fc1[0, 0] = 1.0 / C
            fc1[1 : 1 + r] = U
            fc1[1 + r : 1 + 2 * r] = -U
            fc2 = torch.zeros(s.n_ff, s.hidden)
            fc2[:, 0] = b
            fc2[:, 1 : 1 + r] = A
            fc2[:, 1 + r : 1 + 2 * r] = -A
            fc2 *= scale[:, None]
            up = randn(s.n_ff, d) / math.sqrt(d)
            # -- FFN on the calibration states (ReGLU, ffn_norm = 1)
            xn = rms_norm(X)
            g = xn @ gate.T  # (M, n_ff)
            hmat = torch.relu(g) * (xn @ up.T)
            logits = torch.relu(X @ fc1.T) @ fc2.T
            pred, true = logits >= 0, g > 0
            recall = float((pred & true).sum() / true.sum().clamp_min(1))
            down_t = randn(s.n_ff, d)
            down_t[:, 0] = 0.0
            y = hmat @ down_t  # (M, d)
            k_d = scaled_to(y, beta * SIGMA_E)
            down_t *= k_d
            X = X + y * k_d
            for key, w in (
                ("FFN_NORM", torch.ones(d)),
                ("FFN_GATE", gate),
                ("FFN_UP", up),
                ("FFN_DOWN_T", down_t),
                ("FC1", fc1),
                ("FC2", fc2),
            ):
                put(f[key], w)
            act_stats.append(p.float())
            log.info(
                "layer %3d: predicted active %.3f (target %.3f), true active %.3f, recall %.3f, "
                "residual rms %.2f  [%.0f s]",
                l, float(pred.float().mean()), active, float(true.float().mean()), recall,
                float(X[:, 1:].pow(2).mean().sqrt()), time.time() - t0,
            )  # fmt: skip
            del gate, up, down_t, fc1, fc2, A, U, lin, g, hmat, logits, xn, y
        put(Names.OUTPUT_NORM, 1.0 + 0.1 * randn(d))
        put(Names.OUTPUT, randn(s.n_vocab, d) / math.sqrt(d))
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
