"""The GPU machine's one-command check (tools/device_check.sh) in its dry run.

The dry run takes the same code path as on a GPU, on the emulated accelerator with tiny shapes,
so a session lent a GPU for a few minutes does not spend them on a broken script. What the dry
run cannot check is anything CUDA-specific (the profiler's CUDA events, memory figures).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import tool_modules

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
    # llama.cpp's build here (the CPU oracle) runs the anchor's code path, offloading nothing
    *(("llamacpp",) if importlib.util.find_spec("llama_cpp") else ()),
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
    "llamacpp",
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
    hybrid = {r["key"]: r for r in data["timing"] if r.get("graph_hybrid")}
    assert set(hybrid) >= {"8", "12"}, [(r["key"], r.get("graph_plan")) for r in data["timing"]]
    assert all(r["deferred_tok_s"] > 0 and r["deferred_deferred"] for r in hybrid.values())
    if "llamacpp" in SECTIONS:
        anchor = data["llamacpp"]
        assert [r["budget_key"] for r in anchor] == ["cpu", "4", "all", "8", "12"]
        assert all(r["tok_s"] > 0 and r["n_gpu_layers"] == 0 for r in anchor), anchor
    assert all(r["peak"] is None for r in data["memory"]["rows"])  # no CUDA: no figures
    assert set(data["targets"]) >= {"hybrid_4_2.5x_cpu", "full_within_2x_roofline", "q4_0_300"}

    md = (out / "device_check.md").read_text()
    assert "## Steps" in md and "## Decode timing" in md
    assert "| cpu-only |" in md and md.count("\n|") > 20


def test_the_anchor_offloads_the_layers_a_budget_holds():
    tool = tool_modules.tool("device_llama")
    mib, reserve = 2**20, tool.RESERVE
    layers, output, kv = [100 * mib] * 4, 50 * mib, 8 * mib
    assert tool.fit_layers(layers, output, kv, None) == 0  # CPU-only
    assert tool.fit_layers(layers, output, kv, reserve + 107 * mib) == 0
    assert tool.fit_layers(layers, output, kv, reserve + 108 * mib) == 1
    assert tool.fit_layers(layers, output, kv, reserve + 4 * 108 * mib) == 4  # not the output
    assert tool.fit_layers(layers, output, kv, reserve + 4 * 108 * mib + output) == 5


def test_the_anchor_refuses_a_build_this_cpu_cannot_run():
    tool = tool_modules.tool("device_llama")
    info = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | "
    zen3 = "flags\t\t: fpu sse3 avx avx2 fma f16c\n"
    assert tool.missing_cpu_features(info, zen3) == [
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512dq",
        "avx512cd",
    ]
    zen4 = "flags\t\t: avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512cd\n"
    assert tool.missing_cpu_features(info, zen4) == []
    assert tool.missing_cpu_features(info.replace("AVX512 = 1", "AVX512 = 0"), zen3) == []


def test_the_moe_comparison_dry_run(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "device_moe.py"),
            "--dry-run",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    head, *rows = json.loads((tmp_path / "device_moe.json").read_text())
    assert head["budget_bytes"] < head["model_bytes"]
    configs = [(r["engine"], r["config"].split()[0]) for r in rows]
    assert configs[:3] == [
        ("powerpy", "cpu-only"),
        ("powerpy", "experts"),
        ("powerpy", "--n-cpu-moe"),
    ]
    assert (
        rows[1]["graph_plan"] == "device step" and rows[1]["placed_bytes"] <= head["budget_bytes"]
    )
    if importlib.util.find_spec("llama_cpp"):
        assert [c for c in configs[3:]] == [("llama.cpp", "cpu-only"), ("llama.cpp", "--n-cpu-moe")]
    assert all(r["tok_s"] > 0 for r in rows), rows
    assert rows[1]["deferred_tok_s"] > 0  # the experts' cold neurons a layer late


def test_a_skipped_section_does_not_run(tmp_path):
    module = tool_modules.tool("device_check")
    report = module.Report(tmp_path, True, 100.0, frozenset({"full"}))
    ran = []
    assert report.run("full", lambda: ran.append(1)) is None
    assert report.run("kernels", lambda: ran.append(2) or 7) == 7
    assert ran == [2]
    assert report.data["sections"]["full"] == {
        "ok": False,
        "seconds": 0.0,
        "error": "skipped: --skip",
    }
    assert report.data["sections"]["kernels"]["ok"]
