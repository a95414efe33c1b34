"""Figures of the hybrid runtime on a real GPU in one run: correctness, budget honesty, host syncs,
decode speed against a dense roofline.

Run by ``tools/device_check.sh`` (which also installs offline, builds the native kernels and runs
the CUDA tests); on its own::

    python tools/device_check.py --out OUTDIR            # CUDA, a 7B-shape F16 model (~3 min)
    python tools/device_check.py --dry-run --out OUTDIR  # emulated accelerator, tiny shapes

Sections, in order. Each catches its own exceptions (the error text goes into the JSON) and the
next one runs anyway; the results are rewritten after every section, so a run killed by its
timeout still leaves what it measured:

- ``env``: versions, the GPU, the native CPU kernels, Triton.
- ``workspace``: bytes the first matmul allocates (cuBLAS workspace) on the default stream and
  on a new stream.
- ``correctness``: hybrid vs CPU-only logits on small F16 and Q4_0 models at a third, two thirds
  and all of the model; exact activations and threshold -1e30 (every neuron active), so fp16
  rounding cannot flip a predictor decision. Largest |logit difference| and top-1 agreement
  over a prefill and 8 teacher-forced decode steps.
- ``roofline``: torch's dense decode of the same 7B shape in bf16 (per layer RMSNorm, q/k/v/o,
  SDPA over a static KV cache whose length is a tensor, ReGLU; then the output), eager and
  captured as a graph and replayed (``device_step.roofline``); and a device-to-device copy
  bandwidth.
- ``model``: writes the synthetic 7B-shape F16 PWRI model (random weights drawn on the device),
  loads it, calibrates the predictor threshold to ``--active`` predicted-active neurons and
  writes the activation statistics the placements are solved from.
- ``full``: the F16 model and a Q4_0 one (``device_step.write_q4_0``) with everything placed:
  decode tok/s in dense and sparse mode, the step replayed as a graph and run eagerly, with the
  host ms a step takes to queue its work and to wait for its logits.
- ``budgets``: CPU-only, then 4, 8, 12 GiB (scaled by the model's size when it is not the full
  7B) and the whole model. Per budget: ``memory`` (peak allocation over a prefill and 8 decode
  steps vs the budget), ``timing`` (tok/s with graphs and eagerly, and at a hybrid budget with
  the cold rows deferred a layer (``--defer-cold``); host ms per step, seconds per
  phase per token) and ``profile`` (kernels, copies and host syncs per decode step, the GPU's
  busy share).
- ``llamacpp``: llama.cpp's CUDA build (``tools/device_llama.py``) on the dense twin of the
  same model at the same budgets: as many layers offloaded as each holds, decode tok/s and the
  VRAM it took.
- ``kernels``: each fused op alone at the 7B sizes: microseconds and GB/s.
- ``targets``: the issue's targets as booleans.

``--dry-run`` runs the same code on the emulated accelerator (``Accelerator("cpu")``) with tiny
shapes: no ``torch.cuda`` call, memory figures null, the profiler on the CPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from powerpy._fs import atomic_write
from powerpy.api import LLM, load
from powerpy.formats.constants import GGMLType, Names
from powerpy.formats.gguf_types import tensor_nbytes
from powerpy.formats.gguf_writer import GGUFStreamWriter
from powerpy.formats.stats import save_activation_stats
from powerpy.generate import generate_step
from powerpy.model import kernels
from powerpy.model.device import Accelerator
from powerpy.model.options import SparsityStats
from powerpy.model.timing import PhaseTimer
from powerpy.placement.budget import GIB
from powerpy.placement.lifecycle import resolve_placement
from powerpy.placement.reserve import DeviceReserve
from powerpy.placement.runtime import HybridRuntime, build_hybrid
from powerpy.sampling import SamplingParams, make_sampler
from powerpy.testing import TinySpec, write_tiny_model
from powerpy.testing import synthetic as synth

TOOLS = Path(__file__).resolve().parent


def _import_tool(name: str):
    """A module of tools/ (not a package) by file name."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _import_tool("bench_hybrid")  # calibrate, decode_tps
llama_tool = _import_tool("device_llama")  # anchor: llama.cpp's CUDA build per budget
step_tool = _import_tool("device_step")  # roofline, step_rates, write_q4_0, kernel_rates

# ----------------------------------------------------------------------------------- shapes
BIG = synth.SHAPES["7b"]  # LLaMA-2-7B: n_embd 4096, 32 layers, n_ff 11008, 32 heads, H 1024
BIG_DRY = synth.Shape(
    n_embd=128, n_ff=1024, n_layer=2, n_head=4, n_head_kv=4, n_ctx=512, n_vocab=512, hidden=64
)
SMALL = TinySpec(n_embd=1024, n_layer=4, n_ff=4096, n_head=16, n_head_kv=4, n_pred_hidden=256)
SMALL_DRY = TinySpec(n_embd=64, n_layer=2, n_ff=256, n_head=4, n_head_kv=2, n_pred_hidden=32)
BUDGETS_GIB = (4, 8, 12)  # at the full 7B shape; scaled by model bytes otherwise
N_CTX = 512  # KV positions the placements reserve
SMALL_CTX = 64
PROMPT_LEN = 16
CORRECT_PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]  # prefill of the correctness runs
CORRECT_STEPS = 8  # decode steps after it
MEMORY_STEPS = 8
PROFILE_STEPS = 3
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def say(msg: str) -> None:
    """A progress line (the device tool shows the tail of stdout)."""
    print(f"[device_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------- report
class Report:
    """The results as one JSON-able dict, rewritten with its markdown after every section."""

    def __init__(
        self, out: Path, dry_run: bool, deadline: float, skip: frozenset[str] = frozenset()
    ) -> None:
        self.out = out
        self.skip = skip  # sections not to run (--skip)
        self.t0 = time.monotonic()
        self.deadline = deadline
        self.data: dict[str, Any] = {
            "tool": "tools/device_check.py",
            "dry_run": dry_run,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "seconds": 0.0,
            "env": {},
            "steps": [],  # filled in by tools/device_check.sh
            "sections": {},
            "correctness": [],
            "memory": {"workspace": None, "rows": []},
            "roofline": None,
            "model": None,
            "full": [],
            "kernels": [],
            "llamacpp": [],
            "timing": [],
            "profile": [],
            "targets": {},
        }

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.deadline - (time.monotonic() - self.t0)

    def run(self, name: str, fn: Callable[[], Any], *, need: float = 0.0) -> Any:
        """Run section ``fn``; its exception is recorded, not raised. Returns its result."""
        info: dict[str, Any] = {"ok": False, "seconds": 0.0, "error": None}
        self.data["sections"][name] = info
        if name in self.skip:
            info["error"] = "skipped: --skip"
            say(f"{name}: {info['error']}")
            return None
        if self.left() < need:
            info["error"] = f"skipped: {self.left():.0f} s left, it needs ~{need:.0f} s"
            say(f"{name}: {info['error']}")
            self.write()
            return None
        say(f"{name} ...")
        info["error"] = "did not finish (the process was killed?)"
        self.write()
        t0 = time.perf_counter()
        result = None
        try:
            result = fn()
            info["ok"], info["error"] = True, None
        except Exception:  # noqa: BLE001 - every section must run, whatever the one before did
            info["error"] = _error_text()
            say(f"{name} FAILED:\n{info['error']}")
        info["seconds"] = round(time.perf_counter() - t0, 3)
        say(f"{name} done in {info['seconds']:.1f} s")
        self.write()
        return result

    def write(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.t0, 3)
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in (
            ("device_check.json", json.dumps(self.data, indent=1, default=_json_default)),
            ("device_check.md", render_markdown(self.data)),
        ):
            with atomic_write(self.out / name) as tmp:
                tmp.write_text(text)


def _error_text(limit: int = 4000) -> str:
    text = traceback.format_exc()
    return text if len(text) <= limit else "...\n" + text[-limit:]


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return repr(o)


@contextlib.contextmanager
def guarded(row: dict, key: str) -> Iterator[None]:
    """Run the block; an exception ends it and goes to ``row["errors"][key]`` (not raised)."""
    try:
        yield
    except Exception:  # noqa: BLE001 - one failed measurement must not hide the others
        row.setdefault("errors", {})[key] = _error_text()
        say(f"{row.get('budget', '')} {key} FAILED:\n{row['errors'][key]}")


# ----------------------------------------------------------------------------------- context
@dataclasses.dataclass
class Big:
    """The 7B-shape model, loaded once on the host; each budget builds its hybrid from it."""

    path: Path
    llm: LLM  # CPU-only, options carry the calibrated threshold
    act_dir: Path
    model_bytes: int
    prompt: list[int]


@dataclasses.dataclass
class Ctx:
    args: argparse.Namespace
    dev: torch.device
    tmp: Path
    report: Report
    big: Big | None = None

    @property
    def cuda(self) -> bool:
        return self.dev.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def free(self) -> None:
        """Release dropped device tensors (call after deleting the last handle)."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.dev)
            torch.cuda.empty_cache()

    def allocated(self) -> int | None:
        return int(torch.cuda.memory_allocated(self.dev)) if self.cuda else None


# ----------------------------------------------------------------------------------- helpers
def model_bytes(llm: LLM) -> int:
    return sum(t.nbytes for t in llm.file.tensors.values())


def kv_bytes(llm: LLM, n_ctx: int) -> int:
    a = llm.model.args
    return 2 * a.n_layer * n_ctx * a.n_embd_gqa * 2  # K and V, f16


def hybrid(
    ctx: Ctx, base: LLM, budget: int, act_dir: Path, n_ctx: int, name: str
) -> tuple[LLM, HybridRuntime, dict]:
    """``base`` placed at ``budget`` bytes (GPU index solved afresh from ``act_dir``): a new
    handle on the hybrid model (``base`` is unchanged), its runtime and what was placed."""
    t0 = time.perf_counter()
    placement = resolve_placement(
        base.file,
        budget,
        n_ctx=n_ctx,
        activation_dir=act_dir,
        index_path=ctx.tmp / f"{name}.gpuidx",
        reset_gpu_index=True,  # threshold 0: the greedy solver, exact and fast (no ILP)
    )
    t1 = time.perf_counter()
    rt = build_hybrid(base.model, placement, Accelerator(ctx.dev), file=base.file)
    ctx.sync()
    t2 = time.perf_counter()
    a = base.model.args
    opts = dataclasses.replace(base.options, stats=SparsityStats.empty(a.n_layer, a.n_ff))
    llm = dataclasses.replace(base, model=rt.model, runtime=rt, options=opts)
    p = rt.placement
    info = {
        "used": p.used,
        "device_bytes": rt.device_bytes,
        "index_bytes": rt.index_bytes,
        "dense_tensors": len(p.gpu_tensors),
        "kv_on_device": p.kv_on_gpu,
        "hot_share": p.n_hot / (a.n_ff * a.n_layer),
        "place_s": round(t1 - t0, 3),
        "build_s": round(t2 - t1, 3),
    }
    return llm, rt, info


def cpu_handle(base: LLM) -> LLM:
    """A CPU-only handle on ``base``'s model with fresh statistics."""
    a = base.model.args
    opts = dataclasses.replace(base.options, stats=SparsityStats.empty(a.n_layer, a.n_ff))
    return dataclasses.replace(base, options=opts)


def greedy_steps(llm: LLM, prompt: list[int], n_ctx: int, opts=None) -> Iterator[int]:
    """Greedy decode after a prefill of ``prompt``: the first ``next`` runs the prefill."""
    cache = llm.model.new_cache(n_ctx)
    sampler = make_sampler(SamplingParams(temperature=0))
    return generate_step(llm.model, prompt, sampler, cache, opts or llm.options)


def teacher_forced(llm: LLM, prompt: list[int], n_steps: int, feed: list[int] | None = None):
    """Logits of the prefill (every position) then of ``n_steps`` one-token steps:
    ((len(prompt) + n_steps, n_vocab) f32 on the host, the tokens fed). The steps feed ``feed``
    or, when None, the argmax of the previous logits."""
    m = llm.model
    cache = m.new_cache(SMALL_CTX)
    rows = [m.forward(torch.tensor(prompt), cache, llm.options, all_logits=True)]
    fed: list[int] = []
    for i in range(n_steps):
        tok = feed[i] if feed is not None else int(rows[-1][-1].argmax())
        fed.append(tok)
        rows.append(m.forward(torch.tensor([tok]), cache, llm.options))
    return torch.cat([r.float().cpu() for r in rows]), fed


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


# ----------------------------------------------------------------------------------- sections
def sec_env(ctx: Ctx) -> dict:
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": str(ctx.dev),
        "emulated": not ctx.cuda,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    ctx.report.data["env"] = env
    if ctx.cuda:
        try:
            free, total = torch.cuda.mem_get_info(ctx.dev)
            env |= {
                "gpu": torch.cuda.get_device_name(ctx.dev),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(ctx.dev))),
                "gpu_free": free,
                "gpu_total": total,
            }
        except Exception as e:  # noqa: BLE001 - the rest of the environment still counts
            env["cuda_error"] = f"{type(e).__name__}: {e}"
    lib = kernels.library()
    env["cpu_kernels"] = None if lib is None else lib.simd
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001 - any failure means "no Triton"
        env["triton"] = f"unavailable: {e}"
    if importlib.util.find_spec("powerpy.model.gpu_kernels") is not None:
        from powerpy.model import gpu_kernels

        env["gpu_kernels"] = gpu_kernels.available()
    say(f"env: {env}")
    if "cuda_error" in env:
        raise RuntimeError(f"CUDA is not usable: {env['cuda_error']}")
    return env


def sec_workspace(ctx: Ctx) -> dict | None:
    """Bytes the first matmul of a stream allocates beyond its output (the cuBLAS workspace)."""
    if not ctx.cuda:
        return None
    dev, out = ctx.dev, {}
    ctx.sync()
    for dtype in (torch.float32, torch.float16):
        a = torch.randn(256, 256, device=dev, dtype=dtype)  # (256, 256)
        nb = a.numel() * a.element_size()  # each product's own bytes
        before = ctx.allocated()
        b = a @ a  # default stream
        ctx.sync()
        after_default = ctx.allocated()
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):
            c = a @ a
        stream.synchronize()
        after_new = ctx.allocated()
        out[str(dtype).removeprefix("torch.")] = {
            "allocated_before": before,
            "default_stream_first_mm": after_default - before - nb,
            "new_stream_first_mm": after_new - after_default - nb,
        }
        del a, b, c
    ctx.report.data["memory"]["workspace"] = out
    say(f"workspace: {out}")
    return out


def sec_correctness(ctx: Ctx) -> list[dict]:
    spec = SMALL_DRY if ctx.args.dry_run else SMALL
    rows = ctx.report.data["correctness"]
    act_dir = ctx.tmp / "small-activation"
    rng = np.random.default_rng(0)
    save_activation_stats(
        act_dir, [rng.pareto(1.0, spec.n_ff).astype(np.float32) for _ in range(spec.n_layer)]
    )
    # exact f32 activations on both sides (the hybrid keeps its base's numerics)
    for ggml_type in (GGMLType.F16, GGMLType.Q4_0):
        path = ctx.tmp / f"small-{ggml_type.name}.powerinfer.gguf"
        write_tiny_model(path, spec, sparse=True, seed=5, dtype=ggml_type)
        ref = load(path, threshold=-1e30, exact_activations=True)
        want, fed = teacher_forced(ref, CORRECT_PROMPT, CORRECT_STEPS)  # (16, n_vocab)
        mb = model_bytes(ref)
        budgets = {
            "third": mb // 3,
            "two thirds": 2 * mb // 3,
            "all": mb + kv_bytes(ref, SMALL_CTX) + GIB // 64,
        }
        for label, budget in budgets.items():
            row: dict[str, Any] = {"model": ggml_type.name, "budget": label, "bytes": budget}
            rows.append(row)
            with guarded(row, "run"):
                name = f"small-{ggml_type.name}-{label.replace(' ', '-')}"
                try:
                    compare(ctx, ref, budget, name, act_dir, want, fed, row)
                finally:
                    ctx.free()
            say(f"correctness {row}")
    errors = [r for r in rows if r.get("errors")]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(rows)} correctness runs failed (see rows)")
    return rows


def compare(
    ctx: Ctx,
    ref: LLM,
    budget: int,
    name: str,
    act_dir: Path,
    want: torch.Tensor,
    fed: list[int],
    row: dict,
) -> None:
    """Hybrid logits of ``ref``'s model placed at ``budget``, fed the tokens ``fed``, against
    ``want`` (the CPU-only logits, (T, n_vocab)); the figures go into ``row``."""
    llm, _, info = hybrid(ctx, ref, budget, act_dir, SMALL_CTX, name)
    row |= info
    got, _ = teacher_forced(llm, CORRECT_PROMPT, CORRECT_STEPS, fed)
    plan = llm.model.plans.get(llm.model, llm.options, 1)
    row["graph"] = plan is not None and plan.device is not None and plan.device.graph is not None
    if row["graph"]:  # the replayed step against the same step run eagerly
        eager = dataclasses.replace(llm, options=dataclasses.replace(llm.options, graphs=False))
        again, _ = teacher_forced(eager, CORRECT_PROMPT, CORRECT_STEPS, fed)
        row["graph_vs_eager"] = float((got - again).abs().max())
    diff, scale = float((got - want).abs().max()), float(want.abs().max())
    top1 = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    row |= {
        "max_abs_diff": diff,
        "ref_max_abs": scale,
        "top1_agree": top1,
        "ok": top1 == 1.0 and diff <= 0.05 * max(1.0, scale),
    }


def sec_roofline(ctx: Ctx) -> dict:
    """torch's dense decode of the big shape (bf16 on CUDA, f32 when emulated), eager and as a
    replayed graph, and the device's copy bandwidth."""
    dtype, n_tok = (torch.bfloat16, 32) if ctx.cuda else (torch.float32, 2)
    out = step_tool.roofline(_big_shape(ctx), ctx.dev, dtype, n_tok)
    ctx.free()  # its weights
    out["tokens"] = n_tok
    out["copy_gb_s"] = copy_bandwidth(ctx)
    ctx.free()
    ctx.report.data["roofline"] = out
    say(f"roofline: {out}")
    return out


def copy_bandwidth(ctx: Ctx) -> float | None:
    """Device-to-device copy GB/s (bytes read + written) of a 1 GiB buffer, 5 times."""
    if not ctx.cuda:
        return None
    a = torch.empty(GIB, dtype=torch.uint8, device=ctx.dev)
    b = torch.empty_like(a)
    b.copy_(a)

    def copies() -> None:
        for _ in range(5):
            b.copy_(a)

    return 2 * 5 * GIB / step_tool.timed(ctx.dev, copies) / 1e9


def _big_shape(ctx: Ctx) -> synth.Shape:
    if ctx.args.dry_run:
        return BIG_DRY
    return dataclasses.replace(BIG, n_layer=ctx.args.layers or BIG.n_layer)


def write_big(path: Path, shape: synth.Shape, dev: torch.device, seed: int = 0) -> Path:
    """A random F16 PWRI model of ``shape``, drawn on ``dev`` tensor by tensor and streamed to
    ``path``: weights ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1²), and fc2 rows scaled by a power
    law (as ``bench_hybrid.write_synthetic``) so that a few neurons are predicted hot."""
    plan = synth.Plan(shape, GGMLType.F16, GGMLType.F16, GGMLType.F16)
    infos = synth.tensor_infos(plan)  # [(name, numpy shape, type)] in file order
    gen = torch.Generator(device=dev).manual_seed(seed)
    fc2 = Names.FC2.format(l=0).split(".", 2)[2]  # the names' suffixes: "fc2.weight"
    down = Names.FFN_DOWN_T.format(l=0).split(".", 2)[2]
    with GGUFStreamWriter(
        path, synth.key_values(plan, "device-check", None), infos, magic=b"PWRI"
    ) as w:
        for name, np_shape, ggml_type in infos:
            if len(np_shape) == 1:  # a norm (n_embd,)
                t = 1.0 + 0.1 * torch.randn(np_shape, generator=gen, device=dev)
                w.write(name, t.cpu().numpy())
                continue
            rows, cols = np_shape
            fan_in = rows if name.endswith(down) else cols  # down_t (n_ff, n_embd): y = h @ W
            t = torch.randn(rows, cols, generator=gen, device=dev).mul_(fan_in**-0.5)
            if name.endswith(fc2):  # (n_ff, hidden): a few large rows
                perm = torch.randperm(rows, generator=gen, device=dev)
                scale = (1.0 + perm.float()) ** -0.5
                t.mul_((scale / scale.mean())[:, None])
            w.write(name, t.half().cpu().numpy())
            assert ggml_type == GGMLType.F16
    return path


def sec_model(ctx: Ctx) -> dict:
    shape = _big_shape(ctx)
    path = ctx.tmp / f"synthetic-{shape.n_layer}l.powerinfer.gguf"
    t0 = time.perf_counter()
    write_big(path, shape, ctx.dev)
    t1 = time.perf_counter()
    base = load(path)
    t2 = time.perf_counter()
    rng = np.random.default_rng(0)
    calib = [1] + rng.integers(3, shape.n_vocab, 15 if ctx.cuda else 31).tolist()
    thr, counts = bench.calibrate(base, calib, ctx.args.active)
    act_dir = ctx.tmp / "activation"
    save_activation_stats(act_dir, counts)
    t3 = time.perf_counter()
    base.options = dataclasses.replace(base.options, threshold=thr)
    prompt = [1] + rng.integers(3, shape.n_vocab, PROMPT_LEN - 1).tolist()
    ctx.big = Big(path, base, act_dir, model_bytes(base), prompt)
    out = {
        "shape": dataclasses.asdict(shape),
        "bytes": ctx.big.model_bytes,
        "write_s": round(t1 - t0, 2),
        "write_gb_s": ctx.big.model_bytes / (t1 - t0) / 1e9,
        "load_s": round(t2 - t1, 2),
        "calibrate_s": round(t3 - t2, 2),
        "threshold": thr,
        "target_active": ctx.args.active,
    }
    ctx.report.data["model"] = out
    say(f"model: {out}")
    return out


def sec_full(ctx: Ctx) -> list[dict]:
    """Everything placed: the F16 model, then a Q4_0 one of the same shape, each in dense and
    sparse mode, its step replayed as a graph and run eagerly (``device_step.step_rates``)."""
    assert ctx.big is not None
    rows = ctx.report.data["full"]
    n, reps, shape = ctx.args.tokens, ctx.args.repeats, _big_shape(ctx)
    models = [("F16", ctx.big.llm, ctx.big.act_dir)]
    if not ctx.args.no_q4_0:
        path = ctx.tmp / f"synthetic-{shape.n_layer}l-q4_0.powerinfer.gguf"
        t0 = time.perf_counter()
        step_tool.write_q4_0(path, shape, ctx.dev)
        q4 = load(path)
        thr, counts = bench.calibrate(q4, ctx.big.prompt, ctx.args.active)
        act = ctx.tmp / "activation-q4_0"
        save_activation_stats(act, counts)
        q4.options = dataclasses.replace(q4.options, threshold=thr)
        say(f"Q4_0 model written, loaded and calibrated in {time.perf_counter() - t0:.1f} s")
        models.append(("Q4_0", q4, act))
    for name, base, act in models:
        budget = model_bytes(base) + kv_bytes(base, N_CTX) + GIB // 64
        for mode, sparse in (("dense", False), ("sparse", True)):
            row: dict[str, Any] = {"model": name, "mode": mode, "bytes": model_bytes(base)}
            rows.append(row)
            with guarded(row, "run"):
                llm, _, info = hybrid(ctx, base, budget, act, N_CTX, f"full-{name}")
                row["hot_share"] = info["hot_share"]
                r = step_tool.step_rates(llm, ctx.big.prompt, n, reps, sparse=sparse)
                row |= {f"{k}_{f}": v for k, fig in r.items() for f, v in fig.items()}
                row["weight_gb_s"] = row["bytes"] * row["graph_tok_s"] / 1e9
                if sparse and llm.sparsity is not None:
                    row["active"] = float(np.nanmean(llm.sparsity.active_fraction()))
                del llm
            ctx.free()
            say(f"full {row}")
            ctx.report.write()
    return rows


def sec_llamacpp(ctx: Ctx) -> list[dict]:
    """llama.cpp's CUDA build on the dense twin of the 7B-shape model at each budget of
    ``sec_budgets`` (``device_llama.anchor``: as many layers offloaded as the budget holds), in
    processes of their own; the ``targets`` compare them with powerpy's timing rows."""
    assert ctx.big is not None
    ctx.free()
    rows = ctx.report.data["llamacpp"]
    rows += llama_tool.anchor(
        ctx.big.path,
        big_budgets(ctx),
        ctx.tmp,
        threads=ctx.args.threads or torch.get_num_threads(),
        prompt=ctx.big.prompt,
        tokens=ctx.args.tokens,
        repeats=ctx.args.repeats,
        deadline=ctx.report.left() - 10,
        log=say,
    )
    failed = [r["budget"] for r in rows if r.get("error")]
    if failed:
        raise RuntimeError(f"llama.cpp failed or was skipped at: {failed}")
    return rows


def sec_kernels(ctx: Ctx) -> list[dict]:
    rows = step_tool.kernel_rates(_big_shape(ctx), ctx.dev, 20 if ctx.cuda else 1)
    ctx.report.data["kernels"] = rows
    ctx.free()
    return rows


def big_budgets(ctx: Ctx) -> list[tuple[str, str, int | None]]:
    """(key, label, bytes) per configuration: CPU-only (None), the GiB budgets scaled by the
    model's size relative to the full 7B, and the whole model with its KV cache. The targets'
    configurations come first (CPU-only, 4 GiB, all), in case time runs out."""
    assert ctx.big is not None
    mb = ctx.big.model_bytes
    plan = synth.Plan(BIG, GGMLType.F16, GGMLType.F16, GGMLType.F16)
    full = sum(_nbytes(s, t) for _, s, t in synth.tensor_infos(plan))  # the 32-layer 7B
    scale = mb / full
    gib = {
        str(g): (
            f"{g} GiB" if abs(scale - 1) < 1e-9 else f"{g} GiB x {scale:.3g}",
            int(g * GIB * scale),
        )
        for g in BUDGETS_GIB
    }
    gib["all"] = ("all", mb + kv_bytes(ctx.big.llm, N_CTX) + GIB // 64)
    order = ["4", "all"] + [k for k in gib if k not in ("4", "all")]
    return [("cpu", "cpu-only", None)] + [(k, *gib[k]) for k in order]


def _nbytes(np_shape: tuple[int, ...], ggml_type: GGMLType) -> int:
    return tensor_nbytes(tuple(reversed(np_shape)), ggml_type)


def sec_budgets(ctx: Ctx) -> None:
    """Memory, timing and profile rows per configuration (one failure does not stop the rest)."""
    if ctx.big is None:
        raise RuntimeError("no model (the model section failed)")
    data = ctx.report.data
    need = 25.0 if ctx.cuda else 0.5  # seconds a configuration takes, about
    failed = []
    for key, label, budget in big_budgets(ctx):
        rows = [{"key": key, "budget": label, "bytes": budget} for _ in range(3)]
        mem, timing, prof = rows
        data["memory"]["rows"].append(mem)
        data["timing"].append(timing)
        data["profile"].append(prof)
        if ctx.report.left() < need:
            for row in rows:
                row["errors"] = {"skipped": f"{ctx.report.left():.0f} s left"}
        else:
            say(f"budget {label} ({budget} bytes)")
            with guarded(mem, "setup"):
                ctx.free()
                base = ctx.allocated()
                measure_budget(ctx, budget, base, mem, timing, prof)
                ctx.free()  # the runtime is gone with measure_budget's frame
                if ctx.cuda:
                    mem["leftover_after_free"] = ctx.allocated() - base
        for row in rows:
            say(f"{label}: {row}")
        failed += [label for row in rows if row.get("errors")]
        ctx.report.write()
    if failed:
        raise RuntimeError(f"measurements failed or were skipped at: {sorted(set(failed))}")


def measure_budget(
    ctx: Ctx, budget: int | None, base: int | None, mem: dict, timing: dict, prof: dict
) -> None:
    """Build one configuration (None: CPU-only) and measure it into the three rows."""
    assert ctx.big is not None
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.dev)
    if budget is None:
        llm = cpu_handle(ctx.big.llm)
    else:
        with guarded(mem, "build"):
            llm, _, info = hybrid(ctx, ctx.big.llm, budget, ctx.big.act_dir, N_CTX, mem["key"])
            mem |= info
            timing["hot_share"] = info["hot_share"]
        if mem.get("errors"):
            return
    with guarded(mem, "memory"):
        measure_memory(ctx, llm, base, budget, mem)
    with guarded(timing, "timing"):
        measure_timing(ctx, llm, timing)
    with guarded(prof, "profile"):
        measure_profile(ctx, llm, prof)


def measure_memory(ctx: Ctx, llm: LLM, base: int | None, budget: int | None, row: dict) -> None:
    """Peak device allocation over the build, a prefill and MEMORY_STEPS decode steps, above
    what was allocated before the build (the default stream's cuBLAS workspace included)."""
    assert ctx.big is not None
    steps = greedy_steps(llm, ctx.big.prompt, N_CTX)
    for _ in range(1 + (2 if ctx.args.dry_run else MEMORY_STEPS)):  # prefill, decode steps
        next(steps)
    ctx.sync()
    if not ctx.cuda:
        row |= {"peak": None, "persistent": None, "within_budget": None}
        return
    peak = int(torch.cuda.max_memory_allocated(ctx.dev)) - base
    reserve = DeviceReserve.for_model(llm.model.args, N_CTX).total
    row |= {
        "peak": peak,
        "persistent": ctx.allocated() - base,  # weights, hot rows, indexes; the cache is alive
        "reserve": reserve,
        "within_budget": None if budget is None else peak <= budget + reserve,
        "over_budget": None if budget is None else peak - budget,
    }


def measure_timing(ctx: Ctx, llm: LLM, row: dict) -> None:
    """Best-of-repeats decode tok/s (bench_hybrid.decode_tps), then one more run with a
    PhaseTimer: host seconds per token of each phase (device work is asynchronous, so a
    device phase shows where the host waits for it)."""
    assert ctx.big is not None
    n, prompt = ctx.args.tokens, ctx.big.prompt
    r = step_tool.step_rates(llm, prompt, n, ctx.args.repeats)
    row |= {f"{k}_{f}": v for k, fig in r.items() for f, v in fig.items()}
    row["tok_s"] = max(r["graph"]["tok_s"], r["eager"]["tok_s"])
    row["ms_per_token"] = 1e3 / row["tok_s"]
    timer = PhaseTimer()
    steps = greedy_steps(
        llm, prompt, len(prompt) + n + 4, dataclasses.replace(llm.options, timer=timer)
    )
    next(steps)  # prefill and the first token
    next(steps)  # a warm step
    timer.reset()
    t0 = time.perf_counter()
    for _ in range(n):
        next(steps)
    wall = time.perf_counter() - t0
    row["phase_ms"] = {k: 1e3 * v / n for k, v in sorted(timer.seconds.items())}
    row["phase_wall_ms"] = 1e3 * wall / n
    if llm.sparsity is not None:
        row["active"] = float(np.nanmean(llm.sparsity.active_fraction()))


def measure_profile(ctx: Ctx, llm: LLM, row: dict) -> None:
    """Kernels, copies and host syncs of PROFILE_STEPS decode steps (torch.profiler), then
    torch's own sync detector (``set_sync_debug_mode``) over as many more steps."""
    assert ctx.big is not None
    n, n_layer = PROFILE_STEPS, llm.model.args.n_layer
    steps = greedy_steps(llm, ctx.big.prompt, N_CTX)
    next(steps)  # prefill
    next(steps)  # a warm step
    ctx.sync()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if ctx.cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            next(steps)  # ends with the logits on the host: the device is idle after it
        wall = time.perf_counter() - t0
    ctx.sync()
    names: Counter[str] = Counter()
    device_names: Counter[str] = Counter()
    device_spans: list[tuple[float, float]] = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            device_names[e.name] += 1
            device_spans.append((e.time_range.start, e.time_range.end))
        else:
            names[e.name] += 1
    kernels_n = sum(c for k, c in device_names.items() if not k.startswith(("Memcpy", "Memset")))
    copies = {k: c for k, c in device_names.items() if k.startswith("Memcpy")}
    memcpy_calls = sum(c for k, c in names.items() if k.startswith(("cudaMemcpy", "cuMemcpy")))
    syncs = {k: names.get(k, 0) for k in SYNC_CALLS}
    row |= {
        "steps": n,
        "n_layer": n_layer,
        "wall_ms_per_step": 1e3 * wall / n,
        "kernels_per_step": kernels_n / n,
        "kernels_per_layer": kernels_n / n / n_layer,
        "memcpy_calls_per_step": memcpy_calls / n,
        "memcpy_calls_per_layer": memcpy_calls / n / n_layer,
        "copies_per_step": {k: c / n for k, c in sorted(copies.items())},
        "pageable_copies_per_step": sum(c for k, c in copies.items() if "Pageable" in k) / n,
        "pinned_copies_per_step": sum(c for k, c in copies.items() if "Pinned" in k) / n,
        "syncs_per_step": {k: c / n for k, c in syncs.items()},
        "syncs_per_layer": sum(syncs.values()) / n / n_layer,
        "stream_waits_per_step": names.get("cudaStreamWaitEvent", 0) / n,
        "gpu_busy": union_us(device_spans) / (wall * 1e6) if ctx.cuda else None,
        "cpu_ops_per_step": sum(c for k, c in names.items() if k.startswith("aten::")) / n,
        "top_runtime_calls": dict(
            Counter({k: c for k, c in names.items() if k.startswith("cu")}).most_common(12)
        ),
        "top_kernels": {k[:100]: c for k, c in device_names.most_common(12)},
    }
    if ctx.cuda:  # torch's own detector: a warning per synchronizing op, with its Python line
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(n):
                    next(steps)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        found = [w for w in caught if "synchroniz" in str(w.message).lower()]
        where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in found)
        row["sync_debug_per_step"] = len(found) / n
        row["sync_debug_where"] = dict(where.most_common(12))


def sec_targets(ctx: Ctx) -> dict:
    """The issue's targets from the rows above (None where a figure is missing)."""
    data = ctx.report.data
    timing = {r["key"]: r for r in data["timing"]}
    prof = {r["key"]: r for r in data["profile"]}
    cpu, full = (timing.get(k, {}).get("tok_s") for k in ("cpu", "all"))
    roof = (data.get("roofline") or {}).get("ms_per_token")
    targets: dict[str, Any] = {}
    for key, times in (("4", 2.5), ("8", 5.0), ("12", 8.0)):
        tok = timing.get(key, {}).get("tok_s")
        targets[f"hybrid_{key}_{times:g}x_cpu"] = {
            "rule": f"hybrid tok/s at {key} GiB (7B F16 shape) >= {times:g} x CPU-only sparse",
            "ratio": tok / cpu if tok and cpu else None,
            "value": tok >= times * cpu if tok and cpu else None,
        }
    slower = [
        k for k, r in timing.items() if k != "cpu" and r.get("tok_s") and cpu and r["tok_s"] < cpu
    ]
    targets["never_slower_than_cpu"] = {
        "rule": "every budget's tok/s >= CPU-only's",
        "ratio": None,
        "value": not slower if cpu and len(timing) > 1 else None,
    }
    anchor = data.get("llamacpp") or []
    ratios = {}
    for r in anchor:  # the same VRAM: powerpy's budget row against llama.cpp's best n_gpu_layers
        mine = timing.get(r.get("budget_key"), {}).get("tok_s")
        if mine and r.get("tok_s"):
            ratios[r["budget_key"]] = mine / r["tok_s"]
    partial = {k: v for k, v in ratios.items() if k not in ("all", "cpu")}
    targets["llamacpp_2x_partial"] = {
        "rule": ">= 2 x llama.cpp's CUDA build at the same VRAM, at every partial budget",
        "ratio": min(partial.values()) if partial else None,
        "value": all(v >= 2 for v in partial.values()) if partial else None,
    }
    full_ms = 1e3 / full if full else None
    targets["full_within_2x_roofline"] = {
        "rule": "ms/token with the whole model placed <= 2 x torch's dense bf16 decode (graph)",
        "ratio": full_ms / roof if full_ms and roof else None,
        "value": full_ms <= 2 * roof if full_ms and roof else None,
    }
    fr = {(r.get("model"), r.get("mode")): r for r in data.get("full", [])}
    f16d, f16s, q4d = (
        fr.get(k, {}) for k in (("F16", "dense"), ("F16", "sparse"), ("Q4_0", "dense"))
    )
    roof_tok = (data.get("roofline") or {}).get("tok_s")

    def at_least(value, bound):
        return None if value is None or bound is None else value >= bound

    d_tok, s_tok, q_tok = f16d.get("graph_tok_s"), f16s.get("graph_tok_s"), q4d.get("graph_tok_s")
    targets["f16_dense_250"] = {
        "rule": "7B F16, everything placed, dense mode: >= 250 tok/s (graph)",
        "ratio": d_tok / 250 if d_tok else None,
        "value": at_least(d_tok, 250),
    }
    targets["f16_dense_0.9_roofline"] = {
        "rule": "the same >= 0.9 x the captured bf16 roofline's tok/s",
        "ratio": d_tok / roof_tok if d_tok and roof_tok else None,
        "value": at_least(d_tok, 0.9 * roof_tok if roof_tok else None),
    }
    targets["f16_sparse_1.5_dense"] = {
        "rule": "7B F16, everything placed, sparse (10% predicted active): >= 1.5 x its dense",
        "ratio": s_tok / d_tok if s_tok and d_tok else None,
        "value": at_least(s_tok, 1.5 * d_tok if d_tok else None),
    }
    targets["q4_0_300"] = {
        "rule": "7B Q4_0, everything placed: >= 300 tok/s (graph)",
        "ratio": q_tok / 300 if q_tok else None,
        "value": at_least(q_tok, 300),
    }
    host = [r.get("graph_host_ms") for r in fr.values() if r.get("graph_host_ms") is not None]
    targets["host_1ms"] = {
        "rule": "host ms per token to queue a fully placed step (graph): <= 1",
        "ratio": max(host) if host else None,
        "value": max(host) <= 1.0 if host and ctx.cuda else None,
    }
    checked = {}
    base = prof.get("cpu", {}).get("syncs_per_step") or {}  # the profiler's own
    for key in ("4", "8", "12", "all"):
        syncs = prof.get(key, {}).get("syncs_per_step")
        if syncs is not None:
            extra = {k: v - base.get(k, 0) for k, v in syncs.items()}
            checked[key] = (
                extra["cudaDeviceSynchronize"] <= 0 and extra["cudaStreamSynchronize"] <= 1
            )
    targets["no_unexpected_syncs"] = {
        "rule": "per decode step, beyond the CPU-only run's (the profiler's own): no "
        "cudaDeviceSynchronize and at most one cudaStreamSynchronize (the logits' copy that "
        "ends the step); cudaEventSynchronize (per-layer waits) allowed; per hybrid budget",
        "per_budget": checked,
        "value": all(checked.values()) if checked and ctx.cuda else None,
    }
    targets["correctness"] = {
        "rule": "every hybrid run: top-1 agreement 1.0 and max |dlogit| <= 0.05 x max(1, |logit|)",
        "value": bool(data["correctness"]) and all(r.get("ok") for r in data["correctness"]),
    }
    budgets = [r for r in data["memory"]["rows"] if r.get("within_budget") is not None]
    targets["memory_within_budget"] = {
        "rule": "peak allocation - base <= budget + the modelled DeviceReserve (the placed "
        "bytes plus what the device needs besides) at every budget",
        "value": all(r["within_budget"] for r in budgets) if budgets else None,
    }
    data["targets"] = targets
    say(f"targets: { {k: v['value'] for k, v in targets.items()} }")
    return targets


# ----------------------------------------------------------------------------------- markdown
def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and abs(v) >= 1 << 30:
        return f"{v / (1 << 30):.2f} GiB"
    if isinstance(v, int) and abs(v) >= 1 << 20:
        return f"{v / (1 << 20):.1f} MiB"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items())
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    if not rows:
        return ["(none)", ""]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [_fmt(r.get(c)) for c in cols]
        if r.get("errors"):
            cells[-1] += " ERROR: " + ", ".join(r["errors"])
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def render_markdown(data: dict) -> str:
    """The results as markdown tables (the JSON holds everything, errors in full)."""
    env = data.get("env") or {}
    mode = "dry run (emulated accelerator)" if data.get("dry_run") else "CUDA"
    md = [
        f"# Device check: {env.get('gpu', env.get('device', '?'))}, {mode}",
        "",
        f"Started {data.get('started')}, {data.get('seconds', 0):.0f} s.",
        "",
    ]
    md += ["## Sections", ""]
    sec = [
        {"name": k, **v, "error": _last_line(v.get("error") or "")}
        for k, v in data.get("sections", {}).items()
    ]
    md += _table(sec, ["name", "ok", "seconds", "error"])
    md += ["## Environment", ""]
    md += _table([{"key": k, "value": v} for k, v in env.items()], ["key", "value"])
    md += ["## Targets", ""]
    md += _table(
        [{"target": k, **v} for k, v in (data.get("targets") or {}).items()],
        ["target", "value", "ratio", "rule"],
    )
    md += ["## Correctness (hybrid vs CPU-only logits)", ""]
    md += _table(
        data.get("correctness", []),
        [
            "model",
            "budget",
            "bytes",
            "hot_share",
            "kv_on_device",
            "graph",
            "graph_vs_eager",
            "max_abs_diff",
            "ref_max_abs",
            "top1_agree",
            "ok",
        ],
    )
    md += ["## Model", "", _fmt(data.get("model")), ""]
    roof = data.get("roofline")
    md += [
        "Roofline (torch dense decode, a replayed graph and eager): "
        + (_fmt(roof) if roof else "not measured"),
        "",
    ]
    md += ["## Everything placed (graph and eager)", ""]
    md += _table(
        data.get("full", []),
        [
            "model",
            "mode",
            "active",
            "graph_tok_s",
            "weight_gb_s",
            "graph_host_ms",
            "graph_wait_ms",
            "graph_captured",
            "eager_tok_s",
            "eager_host_ms",
            "graph_capture_error",
        ],
    )
    md += ["## Decode timing", ""]
    md += _table(
        data.get("timing", []),
        [
            "budget",
            "bytes",
            "hot_share",
            "active",
            "graph_tok_s",
            "eager_tok_s",
            "deferred_tok_s",
            "graph_host_ms",
            "graph_serve_ms",
            "graph_cpu_busy",
            "deferred_cpu_busy",
            "graph_plan",
            "phase_ms",
        ],
    )
    md += ["## llama.cpp's CUDA build at the same VRAM (dense twin)", ""]
    md += _table(
        data.get("llamacpp", []),
        ["budget", "bytes", "n_gpu_layers", "n_layer", "tok_s", "vram_bytes", "within_budget"],
    )
    md += ["## Fused kernels alone", ""]
    md += _table(data.get("kernels", []), ["op", "case", "us", "gb_s"])
    mem = data.get("memory") or {}
    md += ["## Memory", "", f"Workspace probe: {_fmt(mem.get('workspace'))}", ""]
    md += _table(
        mem.get("rows", []),
        [
            "budget",
            "bytes",
            "used",
            "device_bytes",
            "index_bytes",
            "peak",
            "persistent",
            "reserve",
            "within_budget",
            "over_budget",
            "build_s",
        ],
    )
    md += ["## Profile (per decode step)", ""]
    md += _table(
        data.get("profile", []),
        [
            "budget",
            "wall_ms_per_step",
            "kernels_per_step",
            "memcpy_calls_per_step",
            "pageable_copies_per_step",
            "pinned_copies_per_step",
            "syncs_per_step",
            "stream_waits_per_step",
            "sync_debug_per_step",
            "gpu_busy",
        ],
    )
    where = [r for r in data.get("profile", []) if r.get("sync_debug_where")]
    if where:
        md += ["Where torch's sync detector fired (Python line: count over the steps):", ""]
        md += [f"- {r['budget']}: {_fmt(r['sync_debug_where'])}" for r in where] + [""]
    md += ["## Errors (last line; the JSON has the tracebacks)", ""]
    errors = [
        "- "
        + " ".join(filter(None, (table, r.get("model"), r.get("budget"), key)))
        + f": {_last_line(text)}"
        for table, rows in (
            ("correctness", data.get("correctness", [])),
            ("full", data.get("full", [])),
            ("memory", mem.get("rows", [])),
            ("timing", data.get("timing", [])),
            ("profile", data.get("profile", [])),
        )
        for r in rows
        for key, text in (r.get("errors") or {}).items()
    ]
    md += (errors or ["none"]) + [""]
    return "\n".join(md) + "\n"


def _last_line(text: str) -> str:
    return "".join(text.strip().splitlines()[-1:])[:300]


# ----------------------------------------------------------------------------------- main
def shm_workdir(shape: synth.Shape) -> Path | None:
    """/dev/shm when it holds the model with 2 GiB to spare, else None (the temp directory):
    memory-backed, so the writer's fsync of a 13.5 GiB file costs nothing, whatever the disk."""
    plan = synth.Plan(shape, GGMLType.F16, GGMLType.F16, GGMLType.F16)
    need = sum(_nbytes(s, t) for _, s, t in synth.tensor_infos(plan)) + 2 * GIB
    shm = Path("/dev/shm")
    with contextlib.suppress(OSError):
        if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > need:
            return shm
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="writes device_check.json/.md here")
    ap.add_argument("--dry-run", action="store_true", help="emulated accelerator, tiny shapes")
    ap.add_argument("--device", help="default: cuda (cpu with --dry-run)")
    ap.add_argument("--layers", type=int, default=0, help="cut the 7B shape to N layers")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens timed per repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--active", type=float, default=0.1, help="predicted-active neuron share")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds for everything")
    ap.add_argument(
        "--workdir",
        type=Path,
        help="for the models (default: /dev/shm if it has room, else $TMPDIR)",
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="CPU threads (0: torch's default; 1 with --dry-run)"
    )
    ap.add_argument("--no-q4-0", action="store_true", help="skip the Q4_0 model (section full)")
    ap.add_argument(
        "--skip",
        default="",
        help="sections not to run, comma-separated (a second call for what the first had no "
        "time for; model is needed by full, budgets and llamacpp)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.dry_run:  # the code path only: few tokens, one thread (no OpenMP spinning on CI)
        args.tokens, args.repeats, args.threads = min(args.tokens, 2), 1, args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    report = Report(args.out, args.dry_run, args.deadline, frozenset(args.skip.split(",")) - {""})
    dev = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())  # tensors say cuda:0, not cuda
    workdir = args.workdir or shm_workdir(BIG_DRY if args.dry_run else BIG)
    with tempfile.TemporaryDirectory(prefix="device_check_", dir=workdir) as tmp:
        report.data["workdir"] = tmp
        ctx = Ctx(args, dev, Path(tmp), report)
        big_s = 5.0 if args.dry_run else 60.0  # rough needs, to skip rather than be killed
        report.run("env", lambda: sec_env(ctx))
        report.run("workspace", lambda: sec_workspace(ctx))
        report.run("correctness", lambda: sec_correctness(ctx), need=big_s / 2)
        report.run("roofline", lambda: sec_roofline(ctx), need=big_s / 3)
        report.run("model", lambda: sec_model(ctx), need=big_s)
        report.run("full", lambda: sec_full(ctx), need=big_s)
        report.run("budgets", lambda: sec_budgets(ctx), need=big_s / 2)
        report.run("llamacpp", lambda: sec_llamacpp(ctx), need=big_s / 2)
        report.run("kernels", lambda: sec_kernels(ctx), need=big_s / 6)
        report.run("targets", lambda: sec_targets(ctx))
        ctx.big = None
    failed = [k for k, v in report.data["sections"].items() if not v["ok"]]
    say(f"wrote {args.out}/device_check.json and .md; failed sections: {failed or 'none'}")
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
