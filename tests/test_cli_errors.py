"""``powerpy infer`` on mutated model files (issue 13): never a traceback; exit code 1 and a
message on stderr that names the file. The files come from ``powerpy.testing.fuzz``: the issue's
seed cases that break the model itself, plus generator cases that the library refuses."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from powerpy.testing import fuzz as fz

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time"  # what `powerpy infer` runs without -p
N_GENERATED = 6  # refused generator cases added to the seed cases
FAMILIES = ("kv", "hparams", "tokenizer", "tensors", "alignment", "predictor")


def _sample(root: Path) -> list[fz.Prepared]:
    """About 20 files that the library refuses (PowerpyError or NonFiniteError)."""
    logging.disable(logging.CRITICAL)
    out = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, (family, _) in sorted(fz.SEED_CASES.items()):
                if family != "stats":  # statistics are read only with --vram-budget
                    out.append(fz.prepare_seed_case(name, root / name))
            names = [m for f in FAMILIES for m in fz.families()[f]]
            for seed in range(200):
                name = names[seed % len(names)]
                p = fz.prepare(name, seed, root / f"gen{seed}")
                p.prompt = PROMPT  # the CLI's default prompt
                if not p.load and fz.run(p) != "ok":
                    out.append(p)
                if len(out) >= len(fz.SEED_CASES) - 5 + N_GENERATED:
                    break
    finally:
        logging.disable(logging.NOTSET)
    return out


def _infer(model: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("POWERPY_DEBUG",)}
    env.pop("LLAMA_SPARSE_PRED_THRESHOLD", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "powerpy", "infer", "-m", str(model), "-n", "2", "-s", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


@pytest.mark.slow
def test_infer_on_mutated_files_prints_one_clear_error(tmp_path):
    cases = _sample(tmp_path)
    assert len(cases) >= 20, [c.mutation for c in cases]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda c: _infer(c.model), cases))
    problems = []
    for case, r in zip(cases, runs, strict=True):
        what = f"{case.mutation} ({case.description})"
        out = r.stdout + r.stderr
        if "Traceback" in out:
            problems.append(f"{what}: traceback\n{r.stderr[-2000:]}")
        elif r.returncode != 1:
            problems.append(f"{what}: exit {r.returncode}\n{r.stderr[-500:]}")
        elif "internal error" in r.stderr:
            problems.append(f"{what}: reported as a bug\n{r.stderr[-500:]}")
        elif case.model.name not in r.stderr:
            problems.append(f"{what}: the file is not named\n{r.stderr[-500:]}")
        elif "powerpy infer: error:" not in r.stderr:
            problems.append(f"{what}: no error line\n{r.stderr[-500:]}")
    assert not problems, "\n\n".join(problems)


def test_verbose_shows_the_traceback(tmp_path):
    """POWERPY_DEBUG=1 (like --verbose) prints the traceback of the same user error."""
    p = fz.prepare_seed_case("head_count_0", tmp_path)
    env = dict(os.environ, POWERPY_DEBUG="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "powerpy", "infer", "-m", str(p.model), "-n", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "ModelConfigError" in r.stderr
    assert str(p.model) in r.stderr
