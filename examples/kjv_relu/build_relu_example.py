"""Build powerpy's PowerInfer-native example, ``models/kjv-relu/``, end to end.

Pipeline (each step a ``powerpy`` CLI command except training and the checks):

1. ``train_relu_model.py`` (beside this script): train the ReGLU LLaMA on the KJV train split
   (Genesis .. Philemon), export an HF llama dir (``hidden_act: relu``) and a dense GGUF with
   the tokenizer. Skipped when ``WORK/ckpt.pt`` already holds the finished run (``--retrain``
   forces it).
2. ``powerpy profile -m DENSE_GGUF --ffn-act relu --kjv train --dump-samples N``: activation
   counts (``activation_{i}.pt``) and predictor training samples. GGUF has no activation key
   for llama, so the dense file is run as ReGLU by ``--ffn-act relu``.
3. ``powerpy train-predictors --from-samples``: one predictor per layer
   (docs/architecture.md#predictor-training).
4. ``powerpy convert HF PREDICTORS --outtype f16``: the final ``kjv-relu.powerinfer.gguf``.
5. ``powerpy gen-gpuidx --vram-budget`` (a few MiB): ``.generated.gpuidx`` beside the model.
6. ``powerpy perplexity --kjv heldout`` (dense and sparse) and ``powerpy infer -p "And God said"``.
7. Checks in process: logits of the PWRI model at threshold -inf (and dense) against the
   training model, per-layer predictor recall and skipped share on held-out text, true sparsity.

Everything lands in ``--out`` (default ``models/kjv-relu``): the model, ``activation/``,
``predictor/``, ``tokenizer.model``, and ``build_report.json`` with every figure. Intermediate
files stay in ``--work`` (default ``build/kjv-relu``).

Usage::

    nice -n 10 python examples/kjv_relu/build_relu_example.py   # train (or reuse) + pipeline

The steps, their commands and the figures of the committed build are in this folder's
``README.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
MODEL_NAME = "kjv-relu.powerinfer.gguf"
PROMPT = "And God said"


# ------------------------------------------------------------------------------ helpers
def run(cmd: list[str], log: Path | None = None) -> str:
    """Run a command with the repo on PYTHONPATH; echo and return its stdout+stderr."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out = proc.stdout
    print(out.rstrip() + f"\n  [{time.perf_counter() - t0:.1f} s]", flush=True)
    if log is not None:
        log.write_text(out)
    if proc.returncode:
        raise SystemExit(f"command failed with exit code {proc.returncode}: {' '.join(cmd)}")
    return out


def powerpy(*args: str) -> list[str]:
    return [sys.executable, "-m", "powerpy", *args]


def train_finished(work: Path) -> bool:
    """Whether WORK holds a finished training run with its exports."""
    report = work / "train_report.json"
    return report.is_file() and (work / "hf" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------ checks
def load_training_model(work: Path):
    """The trained ``ReluLlama`` from WORK/ckpt.pt, and the trainer module (its neighbour in
    this folder, importable because Python puts a script's folder first on the module path)."""
    import torch
    import train_relu_model as mod

    state = torch.load(work / "ckpt.pt", weights_only=True)
    model = mod.ReluLlama(mod.Hparams(**state["hparams"]))
    model.load_state_dict(state["model"])
    return model.eval(), mod


def check_model(model_path: Path, work: Path, n_windows: int | None) -> dict:
    """Logit agreement with the training model, predictor recall and sparsity on held-out text.

    Returns figures for the report: max |logit diff| against the training model of the f16 PWRI
    model (dense, and gated at threshold -inf) and of the dense f32 GGUF run as ReGLU; per-layer
    recall (share of truly active neurons the predictor keeps), predicted-skipped share and true
    sparsity over
    ``n_windows`` held-out windows of n_ctx tokens (BOS + n_ctx - 1 text tokens; None: all).
    """
    import numpy as np
    import torch

    import powerpy
    from powerpy.model.ffn import predict
    from powerpy.model.options import RunOptions
    from powerpy.pipeline.corpus import kjv_text, windows

    ref_model, mod = load_training_model(work)
    n_ctx = ref_model.hp.n_ctx
    llm = powerpy.load(model_path, weight_format="f32")
    dense = powerpy.load(work / "kjv-relu.dense.gguf", weight_format="f32", ffn_act="relu")
    ids = llm.tokenize(kjv_text("heldout"), add_bos=False)
    bos = llm.tokenizer.bos_id
    m = llm.model
    n_layer, n_ff = m.args.n_layer, m.args.n_ff
    tp = np.zeros(n_layer)
    true_active = np.zeros(n_layer)
    pred_active = np.zeros(n_layer)
    tokens = 0
    diffs = {"pwri_f16_dense": 0.0, "pwri_f16_thr_-inf": 0.0, "dense_gguf_f32_relu": 0.0}

    def observer(l: int, x: torch.Tensor, h: torch.Tensor) -> None:
        # x: ffn_inp (T, n_embd), the predictor's input; h: true activation (T, n_ff)
        blk = m.weights.blk[l]
        act = predict(x, blk.fc1, blk.fc2) >= llm.options.threshold  # (T, n_ff)
        true = h != 0
        tp[l] += float((act & true).sum())
        true_active[l] += float(true.sum())
        pred_active[l] += float(act.sum())

    max_tokens = None if n_windows is None else (n_ctx - 1) * n_windows
    for i, w in enumerate(windows(ids, n_ctx - 1, max_tokens)):
        window = torch.tensor([bos, *w.tolist()])
        with torch.no_grad():
            ref = ref_model(window[None])[0][0]
        if i < 3:
            for key, (lm, thr) in {
                "pwri_f16_dense": (llm, None),
                "pwri_f16_thr_-inf": (llm, -math.inf),
                "dense_gguf_f32_relu": (dense, None),
            }.items():
                opts = RunOptions(sparse=thr is not None, threshold=thr)
                got = lm.model.forward(window, lm.model.new_cache(n_ctx), opts, all_logits=True)
                diffs[key] = max(diffs[key], float((got - ref).abs().max()))
        # true h from the dense FFN; the observer applies the predictor
        opts = RunOptions(sparse=False, observer=observer)
        m.forward(window, m.new_cache(n_ctx), opts, all_logits=True)
        tokens += len(window)
    recall = tp / np.maximum(true_active, 1)
    return {
        "max_abs_logit_diff_vs_training": diffs,
        "heldout_tokens_checked": tokens,
        "threshold": llm.options.threshold,
        "recall_per_layer": recall.tolist(),
        "recall_mean": float(recall.mean()),
        "predicted_skipped_per_layer": (1 - pred_active / (tokens * n_ff)).tolist(),
        "predicted_skipped_mean": float((1 - pred_active / (tokens * n_ff)).mean()),
        "true_sparsity_per_layer": (1 - true_active / (tokens * n_ff)).tolist(),
        "true_sparsity_mean": float((1 - true_active / (tokens * n_ff)).mean()),
    }


def parse_perplexity(out: str) -> dict:
    """{"dense": (ppl, skipped%), "sparse": ...} from `powerpy perplexity` output."""
    res = {}
    for line in out.splitlines():
        m = re.match(r"(dense|sparse)\s+([\d.]+)\s+(\S+)\s+(\S+)", line)
        if m:
            res[m.group(1)] = {"ppl": float(m.group(2)), "skipped": m.group(4)}
    return res


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two GGUF/PWRI files hold the same tensors (names, types and bytes)."""
    import numpy as np

    from powerpy.formats.gguf_reader import read_gguf

    with read_gguf(a) as fa, read_gguf(b) as fb:
        if set(fa.tensors) != set(fb.tensors):
            return False
        return all(
            fa.tensors[n].ggml_type == fb.tensors[n].ggml_type
            and np.array_equal(fa.raw(n), fb.raw(n))
            for n in fa.tensors
        )


def rel(path: Path) -> str:
    """``path`` relative to the repo when inside it (commands run from the repo root)."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "models" / "kjv-relu")
    p.add_argument("--work", type=Path, default=REPO / "build" / "kjv-relu")
    p.add_argument("--retrain", action="store_true", help="train even if a finished run exists")
    p.add_argument("--train-args", default="", help="extra arguments for the trainer")
    p.add_argument("--hidden", type=int, default=128, help="predictor hidden size")
    p.add_argument("--pred-threshold", type=float, default=0.0, help="runtime threshold")
    p.add_argument("--profile-tokens", type=int, default=400_000, help="train tokens to profile")
    p.add_argument("--samples", type=int, default=200_000, help="predictor samples per layer")
    p.add_argument("--vram-budget", default="0.002", help="GiB for gen-gpuidx (a few MiB)")
    p.add_argument("--check-windows", type=int, default=None, help="held-out windows (all)")
    args = p.parse_args(argv)
    work, out = args.work.resolve(), args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    times = {}

    # 1. train + export (or reuse)
    t0 = time.perf_counter()
    if args.retrain or not train_finished(work):
        cmd = [sys.executable, rel(HERE / "train_relu_model.py"), "--out", rel(work)]
        run(cmd + args.train_args.split(), work / "train.log")
    times["train_and_export"] = time.perf_counter() - t0
    train_report = json.loads((work / "train_report.json").read_text())
    hp = train_report["hparams"]
    n_ctx = str(hp["n_ctx"])
    hf, dense = rel(work / "hf"), rel(work / "kjv-relu.dense.gguf")

    # 2-3. profile the dense GGUF as ReGLU -> predictors
    t0 = time.perf_counter()
    prof, pred = work / "profile", work / "predictor"
    cmd = powerpy("profile", "-m", dense, "--ffn-act", "relu", "--kjv", "train", "-o", rel(prof))
    cmd += ["--ctx", n_ctx, "--tokens", str(args.profile_tokens)]
    run(cmd + ["--dump-samples", str(args.samples), "-t", "1"], work / "profile.log")
    cmd = powerpy("train-predictors", "--from-samples", rel(prof / "samples"), "-o", rel(pred))
    cmd += ["--hidden", str(args.hidden), "-t", "1"]
    run(cmd + ["--threshold", str(args.pred_threshold)], work / "train_predictors.log")
    times["profile_and_predictors"] = time.perf_counter() - t0

    # 4. the PWRI model (HF source; the tokenizer keys come from the dense GGUF)
    out.mkdir(parents=True, exist_ok=True)
    model = out / MODEL_NAME
    cmd = powerpy("convert", hf, rel(pred), "-o", rel(model), "--outtype", "f16")
    run(cmd + ["--vocab-gguf", dense, "--name", "kjv-relu"])
    from_gguf = work / "from-dense-gguf.powerinfer.gguf"
    run(powerpy("convert", dense, rel(pred), "-o", rel(from_gguf), "--outtype", "f16"))
    for sub, src, pattern in (("activation", prof, "activation_*.pt"), ("predictor", pred, "*")):
        dst = out / sub
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        for f in sorted(src.glob(pattern)):
            if f.is_file() and f.suffix in (".pt", ".json"):
                shutil.copy2(f, dst / f.name)
    shutil.copy2(work / "tokenizer.model", out / "tokenizer.model")

    # 5-6. GPU index, perplexity, a greedy sample
    cmd = powerpy("gen-gpuidx", "-m", rel(model), "--vram-budget", args.vram_budget)
    gpuidx_out = run(cmd + ["--ctx", n_ctx])
    t0 = time.perf_counter()
    cmd = powerpy("perplexity", "-m", rel(model), "--kjv", "heldout", "-c", n_ctx)
    ppl_out = run(cmd + ["-t", "1"], work / "perplexity.log")
    times["perplexity"] = time.perf_counter() - t0
    cmd = powerpy("infer", "-m", rel(model), "-p", PROMPT, "-n", "40", "--temp", "0", "-t", "1")
    infer_out = run(cmd)

    # 7. checks
    checks = check_model(model, work, args.check_windows)
    checks["hf_and_dense_gguf_sources_convert_identically"] = same_tensors(model, from_gguf)
    files = sorted(f for f in out.rglob("*") if f.is_file() and f.name != "build_report.json")
    sizes = {str(f.relative_to(out)): f.stat().st_size for f in files}
    keys = ("hparams", "train_config", "n_params", "train_seconds", "tokens_seen", "train_tokens")
    keys += ("heldout_tokens", "heldout", "export_checks", "greedy_sample")
    report = {
        "train": {k: train_report[k] for k in keys},
        "times_seconds": {**times, "total": time.perf_counter() - t_start},
        "perplexity_heldout": parse_perplexity(ppl_out),
        "checks": checks,
        "gen_gpuidx": gpuidx_out.strip().splitlines(),
        "infer": infer_out.strip().splitlines(),
        "files_bytes": sizes,
        "total_bytes": sum(sizes.values()),
    }
    (out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("perplexity_heldout", "checks", "total_bytes")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
