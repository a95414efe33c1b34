"""The GPU machine's one-command check (tools/device_check.sh) in its dry run.

The dry run takes the same code path as on a GPU, on the emulated accelerator with tiny shapes,
so a session lent a GPU for a few minutes does not spend them on a broken script. What the dry
run cannot check is anything CUDA-specific (the profiler's CUDA events, memory figures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = (
    "env",
    "workspace",
    "correctness",
    "roofline",
    "model",
    "full",
    "budgets",
    "kernels",
    "targets",
)
KEYS = (
    "env",
    "steps",
    "sections",
    "correctness",
    "memory",
    "roofline",
    "model",
    "full",
    "kernels",
    "timing",
    "profile",
    "targets",
)


def test_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "device_check.sh"), "--dry-run", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = proc.stdout[-4000:] + proc.stderr[-2000:]
    data = json.loads((out / "device_check.json").read_text())
    assert all(k in data for k in KEYS), (sorted(data), log)
    assert data["dry_run"] is True
    for name in SECTIONS:  # every section ran to its end, without an error
        info = data["sections"][name]
        assert info["ok"] and info["error"] is None, (name, info["error"])

    steps = {s["name"]: s for s in data["steps"]}
    for name in ("env", "kernels", "measure"):  # the fake-CUDA test's result is its own business
        assert steps[name]["status"] == "ok", (name, log)
    assert steps["install"]["status"] == "skipped" and "pytest_fake" in steps
    assert (out / "logs" / "measure.log").stat().st_size > 0

    assert [r["budget"] for r in data["correctness"]] == ["third", "two thirds", "all"] * 2
    assert all(r["ok"] for r in data["correctness"])
    assert [r["key"] for r in data["timing"]] == ["cpu", "4", "all", "8", "12"]
    assert all(r["tok_s"] > 0 and r["phase_ms"] for r in data["timing"])
    assert all(r["peak"] is None for r in data["memory"]["rows"])  # no CUDA: no figures
    assert set(data["targets"]) >= {"hybrid_4_2.5x_cpu", "full_within_2x_roofline", "q4_0_300"}

    md = (out / "device_check.md").read_text()
    assert "## Steps" in md and "## Decode timing" in md
    assert "| cpu-only |" in md and md.count("\n|") > 20
