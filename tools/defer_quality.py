"""What deferring the cold rows (``--defer-cold``, ``RunOptions.defer_cold``) costs in quality.

A hybrid decode step may add each layer's cold rows to the residual stream one layer late, so
that the CPU's task overlaps the device's next layer. That changes what the model computes.
This script measures by how much, on the project's natively sparse model (``models/kjv-relu``)
and held-out text (the KJV's last books), on the emulated accelerator: every figure is a
value, not a speed, so the emulated device gives the CUDA step's numbers.

For each VRAM budget the model is placed afresh (a GPU index solved from the file's activation
statistics, in a temporary copy: the repository's index is not touched), and the text is
decoded teacher-forced, one token per step through the decode plan: mean NLL and perplexity of
the next token, undeferred and deferred, and between the two the top-1 agreement and the
largest |Δlogit|. CPU-only is the reference row.

Examples:
    python tools/defer_quality.py                 # 512 tokens, four budgets
    python tools/defer_quality.py --tokens 64 --budgets 2.5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import tempfile
from pathlib import Path

import torch

from powerpy._fs import atomic_write
from powerpy.api import load
from powerpy.pipeline.corpus import kjv_text

MODEL = Path(__file__).resolve().parents[1] / "models" / "kjv-relu" / "kjv-relu.powerinfer.gguf"
PROMPT = 8  # tokens before the first scored step (one prefill)


def teacher_forced(llm, ids: list[int], opts) -> torch.Tensor:
    """Logits (len(ids) - PROMPT, n_vocab) predicting ids[PROMPT:], each from a decode step
    (the first from the prompt's prefill)."""
    model = llm.model
    cache = model.new_cache(len(ids) + 1)
    rows = [model.forward(torch.tensor(ids[:PROMPT]), cache, opts)]
    rows += [model.forward(torch.tensor([t]), cache, opts) for t in ids[PROMPT:-1]]
    return torch.cat(rows)


def nll(logits: torch.Tensor, targets: list[int]) -> float:
    """Mean negative log-likelihood (nats) of ``targets`` under ``logits``."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    return float(-lp[torch.arange(len(targets)), torch.tensor(targets)].mean())


def measure(model_path: Path, budgets: list[float], n_tokens: int) -> dict:
    """Rows of the table (see the module doc)."""
    with tempfile.TemporaryDirectory(prefix="powerpy-defer-") as tmp:
        path = Path(tmp) / model_path.name
        shutil.copy(model_path, path)
        act = model_path.parent / "activation"
        if act.is_dir():
            shutil.copytree(act, Path(tmp) / "activation")
        cpu = load(path)
        ids = cpu.tokenize(kjv_text("heldout"), add_bos=True)[: n_tokens + PROMPT]
        targets = ids[PROMPT:]
        ref = teacher_forced(cpu, ids, cpu.options)
        rows = [{"budget_mib": None, "hot_share": None, "nll": nll(ref, targets)}]
        for mib in budgets:
            llm = load(
                path, vram_budget=mib / 1024, device="cpu", reset_gpu_index=True, n_ctx=len(ids) + 1
            )
            model = llm.model
            plain = dataclasses.replace(llm.options, stats=None)
            base = teacher_forced(llm, ids, plain)
            deferred = teacher_forced(llm, ids, dataclasses.replace(plain, defer_cold=True))
            dev = model.plans.get(model, model._options(plain), 1).device
            later = model.plans.get(model, dataclasses.replace(plain, defer_cold=True), 1)
            hot = [b.hot for b in model.weights.blk]
            n_hot = sum(0 if h is None else h.k for h in hot)
            rows.append(
                {
                    "budget_mib": mib,
                    "hot_share": n_hot / (model.args.n_layer * model.args.n_ff),
                    "device_step": dev is not None,
                    "deferred": later.device is not None and later.device.deferred,
                    "nll": nll(base, targets),
                    "nll_deferred": nll(deferred, targets),
                    "top1_agree": float((base.argmax(-1) == deferred.argmax(-1)).double().mean()),
                    "max_dlogit": float((base - deferred).abs().max()),
                }
            )
    return {"model": str(model_path), "tokens": len(targets), "rows": rows}


def table(res: dict) -> str:
    out = [
        f"{res['tokens']} held-out KJV tokens, teacher-forced decode, {Path(res['model']).name}",
        "",
        "| budget | hot share | PPL | PPL deferred | top-1 agreement | max abs dlogit |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if r["budget_mib"] is None:
            out.append(f"| CPU only | - | {math.exp(r['nll']):.3f} | - | - | - |")
            continue
        if not r["device_step"]:
            out.append(f"| {r['budget_mib']:g} MiB | - | (no device step) | | | |")
            continue
        out.append(
            f"| {r['budget_mib']:g} MiB | {r['hot_share']:.0%} | {math.exp(r['nll']):.3f} | "
            f"{math.exp(r['nll_deferred']):.3f} | {r['top1_agree']:.3f} | "
            f"{r['max_dlogit']:.3f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--tokens", type=int, default=512, help="scored tokens (default 512)")
    ap.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[2.5, 3.0, 3.5],
        help="VRAM budgets in MiB (default: 2.5 3 3.5, kjv-relu's hybrid range at 520 positions)",
    )
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    if not a.model.is_file():
        ap.error(f"--model {a.model}: no such file")
    if a.tokens < 1 or not all(b > 0 for b in a.budgets):
        ap.error("--tokens must be >= 1 and every budget > 0 MiB")
    res = measure(a.model, a.budgets, a.tokens)
    print(table(res))
    if a.json:
        with atomic_write(a.json) as tmp:
            tmp.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
