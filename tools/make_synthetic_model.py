"""Write a synthetic PowerInfer (PWRI) llama model with random weights and working predictors.

The file has the keys and tensors of spec section 5 (llama arch, ReGLU FFN, ffn_down_t, fc1/fc2)
plus a byte-level SPM vocabulary (<unk>, <s>, </s>, 256 byte tokens, then unused filler tokens
up to the shape's vocabulary size), and ``activation/activation_{i}.pt`` beside it holding each
neuron's expected activation frequency.

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

Examples:
    python tools/make_synthetic_model.py --shape tiny --dtype f16 -o /tmp/tiny/model.powerinfer.gguf
    python tools/make_synthetic_model.py --shape 7b --dtype q4_0 --powerlaw --layers 2 \\
        -o /tmp/m.gguf
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from powerpy.constants import (  # noqa: E402
    GGMLType,
    GGUFValueType,
    Keys,
    Names,
    TokenType,
)
from powerpy.gguf_io import GGUFStreamWriter, tensor_nbytes  # noqa: E402


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
    a = w.detach().float().contiguous().numpy()
    if ggml_type == GGMLType.F32:
        return a
    if ggml_type == GGMLType.F16:
        return a.astype(np.float16)
    from powerpy import quants

    fn = quants.quantize_q8_0 if ggml_type == GGMLType.Q8_0 else quants.quantize_q4_0
    return np.ascontiguousarray(fn(a))


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


def key_values(plan: Plan, name: str, threshold: float | None) -> list[tuple[str, tuple]]:
    """The file's key/values, typed for ``powerpy.gguf_io`` writers."""
    V = GGUFValueType
    s, a = plan.shape, "llama"
    kv: list[tuple[str, object, object]] = [
        (Keys.ARCHITECTURE, a, V.STRING),
        (Keys.NAME, name, V.STRING),
        (Keys.FILE_TYPE, FILE_TYPE[plan.wtype], V.UINT32),
        (Keys.CONTEXT_LENGTH.format(arch=a), s.n_ctx, V.UINT32),
        (Keys.EMBEDDING_LENGTH.format(arch=a), s.n_embd, V.UINT32),
        (Keys.BLOCK_COUNT.format(arch=a), s.n_layer, V.UINT32),
        (Keys.FEED_FORWARD_LENGTH.format(arch=a), s.n_ff, V.UINT32),
        (Keys.ROPE_DIMENSION_COUNT.format(arch=a), s.n_embd // s.n_head, V.UINT32),
        (Keys.ROPE_FREQ_BASE.format(arch=a), 10000.0, V.FLOAT32),
        (Keys.HEAD_COUNT.format(arch=a), s.n_head, V.UINT32),
        (Keys.HEAD_COUNT_KV.format(arch=a), s.n_head_kv, V.UINT32),
        (Keys.RMS_EPS.format(arch=a), RMS_EPS, V.FLOAT32),
    ]
    if threshold is not None:
        kv.append((Keys.SPARSE_THRESHOLD, float(threshold), V.FLOAT32))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    n_fill = s.n_vocab - len(tokens)
    if n_fill < 0:
        raise ValueError(f"vocabulary of {s.n_vocab} cannot hold the {len(tokens)} base tokens")
    tokens += [f"<unused{i}>" for i in range(n_fill)]
    types += [TokenType.UNUSED] * n_fill
    kv += [
        (Keys.TOKENIZER_MODEL, "llama", V.STRING),
        (Keys.TOKENS, tokens, V.STRING),
        (Keys.SCORES, np.zeros(len(tokens), np.float32), V.FLOAT32),
        (Keys.TOKEN_TYPE, np.array(types, np.int32), V.INT32),
        (Keys.BOS_ID, 1, V.UINT32),
        (Keys.EOS_ID, 2, V.UINT32),
        (Keys.UNK_ID, 0, V.UINT32),
        (Keys.ADD_BOS, True, V.BOOL),
    ]
    arrays = (Keys.TOKENS, Keys.SCORES, Keys.TOKEN_TYPE)
    return [(k, (v, V.ARRAY, t) if k in arrays else (v, t)) for k, v, t in kv]


def make_model(args: argparse.Namespace) -> None:
    shape = SHAPES[args.shape]
    if args.layers is not None:
        shape = replace(shape, n_layer=args.layers)
    if args.hidden is not None:
        shape = replace(shape, hidden=args.hidden)
    wtype = DTYPES[args.dtype]
    ptype = DTYPES[args.predictor_dtype] if args.predictor_dtype else wtype
    otype = GGMLType.Q8_0 if wtype == GGMLType.Q4_0 else wtype
    plan = Plan(shape, wtype, ptype, otype)
    s = shape
    if s.hidden < 3 or (ptype not in (GGMLType.F32, GGMLType.F16) and s.hidden % 32):
        raise SystemExit(
            f"predictor hidden size {s.hidden} must be >= 3 (a multiple of 32 "
            "for quantized predictors)"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    infos = tensor_infos(plan)
    total = sum(tensor_nbytes(tuple(reversed(shp)), t) for _, shp, t in infos)
    free = shutil.disk_usage(out.parent).free
    if total * 1.05 + (1 << 26) > free:
        raise SystemExit(f"{out}: needs {total / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free")
    print(
        f"{args.shape} {args.dtype}: {s.n_layer} layers, n_embd {s.n_embd}, n_ff {s.n_ff}, "
        f"H {s.hidden}, {total / 2**30:.2f} GiB -> {out}",
        flush=True,
    )

    gen = torch.Generator().manual_seed(args.seed)
    d, hd = s.n_embd, s.n_embd // s.n_head
    beta = 0.5 / math.sqrt(s.n_layer)  # each sublayer adds this much of the embedding RMS

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen)

    name = f"powerpy-synthetic-{args.shape}-{args.dtype}"
    writer = GGUFStreamWriter(out, key_values(plan, name, args.threshold), infos, magic=b"PWRI")
    types = {n: t for n, _, t in infos}

    def put(tensor_name: str, w: torch.Tensor) -> None:
        writer.write(tensor_name, encode(w, types[tensor_name]))

    t0 = time.time()
    stats: list[torch.Tensor] = []
    try:
        # token embeddings: dims 1.. N(0, SIGMA_E), dim 0 = C, the block's largest magnitude
        emb = randn(s.n_vocab, d) * SIGMA_E
        emb[:, 1:32].clamp_(-0.95 * C, 0.95 * C)
        emb[:, 0] = C
        put(Names.TOKEN_EMBD, emb)
        # calibration states: the byte tokens and specials, as single-token sequences
        n_cal = min(args.calib_tokens, s.n_vocab)
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
            p = target_probs(s.n_ff, args.active, args.powerlaw, args.alpha, gen)
            z = torch.distributions.Normal(0.0, 1.0).icdf(p).float()
            b = -mu + sd * z  # logit offset: P(b + a_j·Ux >= 0) = p_j (Gaussian model)
            gate = A @ U  # (n_ff, d)
            gate[:, 0] = b / C
            E = randn(s.n_ff, d)
            E[:, 0] = 0.0
            e_sd = (X @ E.T).std(0).clamp_min(1e-6)
            E *= (args.predictor_noise * sd / e_sd)[:, None]
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
            stats.append(p.float())
            print(
                f"layer {l:3d}: predicted active {float(pred.float().mean()):.3f} "
                f"(target {args.active:.3f}), true active {float(true.float().mean()):.3f}, "
                f"recall {recall:.3f}, residual rms {float(X[:, 1:].pow(2).mean().sqrt()):.2f}"
                f"  [{time.time() - t0:.0f} s]",
                flush=True,
            )
            del gate, up, down_t, fc1, fc2, A, U, lin, g, hmat, logits, xn, y
        put(Names.OUTPUT_NORM, 1.0 + 0.1 * randn(d))
        put(Names.OUTPUT, randn(s.n_vocab, d) / math.sqrt(d))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    if not args.no_stats:
        act_dir = out.parent / "activation"
        try:
            from powerpy.stats import save_activation_stats

            save_activation_stats(act_dir, stats)
        except ImportError:  # fallback when powerpy.stats is not there
            act_dir.mkdir(exist_ok=True)
            for i, st in enumerate(stats):
                tmp = act_dir / f".activation_{i}.pt.tmp"
                torch.save(st, tmp)
                os.replace(tmp, act_dir / f"activation_{i}.pt")
        print(f"wrote {len(stats)} activation files to {act_dir}")
    print(f"done in {time.time() - t0:.1f} s: {out} ({out.stat().st_size / 2**30:.2f} GiB)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny")
    ap.add_argument("--dtype", choices=list(DTYPES), default="f16")
    ap.add_argument("--active", type=float, default=0.10, help="mean active fraction per token")
    ap.add_argument("--powerlaw", action="store_true", help="power-law hot neurons")
    ap.add_argument(
        "--alpha",
        type=float,
        default=1.4,
        help="power-law exponent (1.4: the top 20%% of neurons get ~80%% of activations)",
    )
    ap.add_argument("--layers", type=int, help="override the layer count")
    ap.add_argument("--hidden", type=int, help="predictor hidden size H (default per shape)")
    ap.add_argument("--predictor-dtype", choices=list(DTYPES), help="default: as --dtype")
    ap.add_argument(
        "--predictor-noise",
        type=float,
        default=0.2,
        help="relative std of the gate part the predictor cannot see (0: exact predictor)",
    )
    ap.add_argument("--threshold", type=float, help="write powerinfer.sparse_threshold")
    ap.add_argument("--calib-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-stats", action="store_true", help="skip activation/activation_*.pt")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    if not 0.0 < args.active < 1.0:
        ap.error(f"--active must be in (0, 1), got {args.active}")
    torch.set_grad_enabled(False)
    make_model(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
