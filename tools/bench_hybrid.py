"""Decode tok/s of the hybrid runtime at VRAM budgets of 0, half the model and all of it.

For each budget the model is loaded afresh, placed (``resolve_placement``: dense pass, then a GPU
index generated in process from activation statistics) and built (``build_hybrid``), then
greedy decode is timed after a prefill. A CPU-only run (no runtime at all) is the baseline.

The accelerator is CUDA when present, else the **emulated** accelerator (``--device cpu``): the
"device" part then runs on the same CPU cores, so its figures measure the split/merge overhead
of the hybrid code path (dense masked pass over hot rows + sparse cold rows), not a GPU speedup.
The report says which one ran.

Model: ``--model PATH`` (statistics from ``dirname/activation`` if present, else measured on a
calibration prompt), or a synthetic PWRI model written to a temporary directory
(``--shape small|1b``; F16, random weights, predictor rows scaled by a power law so a few
neurons are hot, threshold calibrated to ``--active`` predicted-active neurons). A synthetic
model from ``tools/make_synthetic_model.py`` can be passed with ``--model``.

Examples:
    python tools/bench_hybrid.py                          # synthetic "small", auto device
    python tools/bench_hybrid.py --shape 1b --tokens 16   # a 1B-shape model (2.2 GB F16)
    python tools/bench_hybrid.py --model m.powerinfer.gguf --device cpu --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from powerpy._fs import fmt_bytes
from powerpy.api import LLM, load
from powerpy.formats.constants import GGMLType, Names
from powerpy.formats.gguf_writer import write_gguf
from powerpy.formats.stats import load_activation_stats, save_activation_stats
from powerpy.generate import generate_step
from powerpy.model.device import Accelerator
from powerpy.model.ffn import predict
from powerpy.model.options import RunOptions
from powerpy.placement.budget import GIB
from powerpy.placement.lifecycle import resolve_placement
from powerpy.placement.runtime import build_hybrid
from powerpy.sampling import SamplingParams, make_sampler
from powerpy.testing import TinySpec, tiny_kv, tiny_tensors

HOT_MODES = {"auto": None, "dense": False, "gated": True}  # Accelerator(gather_hot=...)

SHAPES = {
    "small": TinySpec(n_embd=1024, n_layer=8, n_ff=4096, n_head=16, n_head_kv=4, n_pred_hidden=256),
    "1b": TinySpec(n_embd=2048, n_layer=16, n_ff=8192, n_head=32, n_head_kv=4, n_pred_hidden=512),
}
N_CTX = 512


# ----------------------------------------------------------------------------------- model
def write_synthetic(path: Path, spec: TinySpec, seed: int = 0) -> Path:
    """A random F16 PWRI model whose predictor rows have power-law norms (hot neurons)."""
    spec = TinySpec(**{**spec.__dict__, "n_ctx": 4096})
    t = tiny_tensors(spec, sparse=True, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for layer in range(spec.n_layer):
        name = Names.FC2.format(l=layer)
        scale = (1.0 + rng.permutation(spec.n_ff)) ** -0.5  # (n_ff,) a few large rows
        t[name] = t[name] * (scale / scale.mean())[:, None].astype(np.float32)
    out = []
    for name in list(t):
        arr = t.pop(name)
        out.append(
            (name, arr.astype(np.float16), GGMLType.F16)
            if arr.ndim == 2
            else (name, arr, GGMLType.F32)
        )
    write_gguf(path, tiny_kv(spec), out, magic=b"PWRI")
    return path


def calibrate(llm: LLM, tokens: list[int], active: float | None) -> tuple[float, list]:
    """Run ``tokens`` on the CPU recording predictor logits; return (threshold, per-layer counts).

    The threshold is the ``1 - active`` quantile of all logits (None: keep the model's), and the
    counts are how often each neuron is predicted active: the activation statistics.
    """
    m = llm.model
    logits: list[list[torch.Tensor]] = [[] for _ in range(m.args.n_layer)]

    def recorder(l, ffn_inp, h):
        blk = m.weights.blk[l]
        logits[l].append(predict(ffn_inp, blk.fc1, blk.fc2))  # (T, n_ff)

    opts = RunOptions(sparse=False, observer=recorder)
    m.forward(torch.tensor(tokens), m.new_cache(len(tokens)), opts)
    per_layer = [torch.cat(z) for z in logits]  # (T, n_ff) each
    thr = llm.options.threshold
    if active is not None:
        thr = float(torch.quantile(torch.cat([z.flatten() for z in per_layer])[::7], 1 - active))
    # counts, plus a tiny mass from the mean logit so never-seen neurons still rank (and fill
    # a budget that holds the whole model)
    counts = [
        ((z >= thr).sum(0) + 1e-3 * torch.sigmoid(z.mean(0))).numpy().astype(np.float32)
        for z in per_layer
    ]
    return thr, counts


# ----------------------------------------------------------------------------------- timing
def decode_tps(llm: LLM, prompt: list[int], n_tokens: int, repeats: int) -> float:
    """Best-of-``repeats`` greedy decode tokens/s after a prefill of ``prompt`` (and one warm
    decode step)."""
    sampler = make_sampler(SamplingParams(temperature=0))
    best = 0.0
    for _ in range(repeats):
        cache = llm.model.new_cache(len(prompt) + n_tokens + 2)
        steps = generate_step(llm.model, prompt, sampler, cache, llm.options)
        next(steps)  # prefill + first token
        next(steps)  # one warm decode step
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            next(steps)
        best = max(best, n_tokens / (time.perf_counter() - t0))
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="PowerInfer model (default: synthetic --shape)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--device", help="cuda[:N] or cpu (emulated); default: CUDA if present")
    ap.add_argument("--hot-mode", choices=sorted(HOT_MODES), default="auto", help="hot-row pass")
    ap.add_argument("--active", type=float, default=0.1, help="synthetic: active neuron share")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    chosen = Accelerator.choose(args.device) or Accelerator("cpu")
    accel = Accelerator(chosen.device, gather_hot=HOT_MODES[args.hot_mode])
    dev = accel.device
    kind = "cuda" if dev.type == "cuda" else "cpu (EMULATED accelerator: same CPU cores)"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "no GPU"

    with tempfile.TemporaryDirectory(prefix="bench_hybrid_") as tmp:
        tmp = Path(tmp)
        path = args.model
        if path is None:
            path = write_synthetic(
                tmp / f"synthetic-{args.shape}.powerinfer.gguf", SHAPES[args.shape]
            )
        base = load(path)
        a = base.model.args
        rng = np.random.default_rng(0)
        calib = [1] + rng.integers(3, a.n_vocab, 63).tolist()
        act_dir = path.parent / "activation"
        synthetic = args.model is None
        thr, counts = calibrate(base, calib, args.active if synthetic else None)
        if act_dir.is_dir() and not synthetic:
            counts = load_activation_stats(act_dir, a.n_layer, a.n_ff)
        else:
            act_dir = tmp / "activation"
            save_activation_stats(act_dir, counts)
        prompt = [1] + rng.integers(3, a.n_vocab, 15).tolist()
        model_bytes = sum(t.nbytes for t in base.file.tensors.values())
        kv = 2 * a.n_layer * N_CTX * a.n_embd_gqa * 2
        everything = model_bytes + kv + GIB // 64  # plus slack for rounding
        budgets = {"0": 0, "half model": model_bytes // 2, "all model": everything}
        print(
            f"model {path.name}: {a.n_layer} layers, n_embd {a.n_embd}, n_ff {a.n_ff}, "
            f"{fmt_bytes(model_bytes)}; threshold {thr:.4g}; device {kind} ({name}), hot rows "
            f"{args.hot_mode}; {torch.get_num_threads()} CPU threads"
        )

        # Build every configuration first, then time them interleaved (best of --repeats), so
        # that load from other processes and page-cache warm-up hit all of them alike.
        cpu = load(path, threshold=thr)
        configs: list[tuple[dict, LLM]] = [({"budget": "cpu-only", "bytes": 0}, cpu)]
        for label, budget in budgets.items():
            llm = load(path, threshold=thr)
            placement = resolve_placement(
                llm.file,
                budget,
                n_ctx=N_CTX,
                activation_dir=act_dir,
                index_path=tmp / f"{label.replace(' ', '_')}.gpuidx",
                reset_gpu_index=True,
            )
            rt = build_hybrid(llm.model, placement, accel, file=llm.file)
            llm.model, p = rt.model, rt.placement
            row = {
                "budget": label,
                "bytes": budget,
                "used": p.used,
                "dense_tensors": len(p.gpu_tensors),
                "kv_on_device": p.kv_on_gpu,
                "hot_share": p.n_hot / (a.n_ff * a.n_layer),
            }
            configs.append((row, llm))
        for row, _ in configs:
            row["tok_s"] = 0.0
        for _ in range(args.repeats):
            for row, llm in configs:
                row["tok_s"] = max(row["tok_s"], decode_tps(llm, prompt, args.tokens, 1))
        active = float(np.nanmean(cpu.sparsity.active_fraction()))
        rows = [row for row, _ in configs]
        for row in rows:
            row["ratio"] = row["tok_s"] / rows[0]["tok_s"]
        del configs, cpu

    print(f"predicted-active neurons (CPU-only run): {100 * active:.1f}%")
    print(
        f"{'budget':<11} {'bytes':>11} {'used':>11} {'dense':>6} {'KV':>4} {'hot %':>6} "
        f"{'tok/s':>8} {'vs CPU':>7}"
    )
    for r in rows:
        extra = ("", "", "", "", "")
        if "used" in r:
            extra = (
                fmt_bytes(r["bytes"]),
                fmt_bytes(r["used"]),
                str(r["dense_tensors"]),
                "yes" if r["kv_on_device"] else "no",
                f"{100 * r['hot_share']:.1f}",
            )
        print(
            f"{r['budget']:<11} {extra[0]:>11} {extra[1]:>11} {extra[2]:>6} {extra[3]:>4} "
            f"{extra[4]:>6} {r['tok_s']:>8.2f} {r['ratio']:>6.2f}x"
        )
    if dev.type == "cpu":
        print("device is the EMULATED accelerator: ratios show the hybrid code path's overhead")
    if args.json:
        meta = {"device": kind, "gpu": name, "hot_mode": args.hot_mode, "active": active}
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
