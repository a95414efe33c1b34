"""The decode step's own figures, for tools/device_check.py: a captured roofline, a fully placed
model's graph against its eager step, a 7B Q4_0 model, and the fused kernels' rates.

- :func:`roofline`: the 7B shape's dense decode in plain torch (bf16, per layer RMSNorm, q/k/v/o,
  SDPA over a static KV cache whose length is a tensor, ReGLU gate/up/down; then the output),
  gpt-fast's layout: run eagerly, then captured once as a graph (``powerpy.model.graphs``) and
  replayed. The graph's rate is what a step of these bytes can reach here.
- :func:`step_rates`: decode tok/s of a loaded model with its decode plan replayed as a graph and
  run eagerly (``RunOptions.graphs``), and a hybrid step replayed with its cold rows deferred
  (``RunOptions.defer_cold``), with the host milliseconds a step takes to queue its work, to run
  its served cold tasks and to wait for its logits (``DeviceStep.host_s``, ``serve_s``,
  ``wait_s``), and the CPU's busy share
  (this process's CPU seconds over every core's wall seconds: the cold rows' worker, spinning
  waits included).
- :func:`write_q4_0`: a random 7B-shape PWRI model in Q4_0 (the output in Q8_0, the predictors
  F16), quantized on the device with ggml's reference rounding.
- :func:`kernel_rates`: each fused op alone at the 7B shape's sizes: microseconds and GB/s.

On the emulated accelerator (``--dry-run``) the same code runs with tiny shapes on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from powerpy.formats.constants import GGMLType, Names
from powerpy.formats.gguf_writer import GGUFStreamWriter
from powerpy.generate import generate_step
from powerpy.model import gpu_kernels
from powerpy.model.device import HOST
from powerpy.model.graphs import CaptureError, StepGraph
from powerpy.sampling import SamplingParams, make_sampler
from powerpy.testing import synthetic as synth


# ----------------------------------------------------------------------------------- timing
def timed(dev: torch.device, fn, n: int = 1) -> float:
    """Seconds per call of ``fn`` over ``n`` calls: CUDA events on a GPU, else the clock."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


# ----------------------------------------------------------------------------------- roofline
@torch.inference_mode()
def roofline(shape: synth.Shape, dev: torch.device, dtype: torch.dtype, n_tok: int) -> dict:
    """The dense decode of ``shape`` in torch, eager and as a replayed graph (module doc)."""
    d, ff, H, Hkv = shape.n_embd, shape.n_ff, shape.n_head, shape.n_head_kv
    hd, P = d // H, 256 + n_tok + 8  # positions of the static cache

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.empty(rows, cols, device=dev, dtype=dtype).normal_(0.0, cols**-0.5)

    layers = [
        (w(d + 2 * Hkv * hd, d), w(d, d), w(2 * ff, d), w(d, ff)) for _ in range(shape.n_layer)
    ]
    out_w = w(shape.n_vocab, d)
    weight_bytes = sum(t.numel() * t.element_size() for ws in layers for t in ws)
    weight_bytes += out_w.numel() * out_w.element_size()
    K = torch.zeros(shape.n_layer, 1, Hkv, P, hd, device=dev, dtype=dtype)
    V = torch.zeros_like(K)
    x_in = torch.randn(1, d, device=dev, dtype=dtype)
    pos = torch.tensor([256], device=dev)  # the position, as data
    logits = torch.empty(1, shape.n_vocab, device=dev, dtype=torch.float32)
    cells = torch.arange(P, device=dev)

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)

    def body() -> None:
        x = x_in
        mask = (cells <= pos)[None, None, None, :]  # (1, 1, 1, P)
        for l, (wqkv, wo, wgu, wd) in enumerate(layers):
            q, k, v = F.linear(rms(x), wqkv).split([d, Hkv * hd, Hkv * hd], dim=1)
            K[l].index_copy_(2, pos, k.view(1, Hkv, 1, hd))
            V[l].index_copy_(2, pos, v.view(1, Hkv, 1, hd))
            a = F.scaled_dot_product_attention(
                q.view(1, H, 1, hd), K[l], V[l], attn_mask=mask, enable_gqa=H != Hkv
            )
            x = x + F.linear(a.reshape(1, d), wo)
            g, u = F.linear(rms(x), wgu).chunk(2, dim=1)
            x = x + F.linear(F.relu(g) * u, wd)
        logits.copy_(F.linear(rms(x), out_w).float())

    body()
    eager_s = timed(dev, body, n_tok)
    kind = "cuda" if dev.type == "cuda" else "emulated"
    out: dict[str, Any] = {
        "dtype": str(dtype).removeprefix("torch."),
        "weight_bytes": weight_bytes,
        "eager_ms_per_token": 1e3 * eager_s,
        "eager_tok_s": 1 / eager_s,
    }
    try:
        graph = StepGraph.capture(kind, body, dev)
        graph_s = timed(dev, graph.replay, n_tok)
        out |= {
            "ms_per_token": 1e3 * graph_s,
            "tok_s": 1 / graph_s,
            "weight_gb_s": weight_bytes / graph_s / 1e9,
        }
    except CaptureError as e:
        out |= {"graph_error": str(e), "ms_per_token": None, "tok_s": None}
    return out


# ----------------------------------------------------------------------------------- a model's step
def step_rates(llm, prompt: list[int], n_tok: int, repeats: int, **opts) -> dict:
    """Decode tok/s of ``llm`` (RunOptions fields ``opts`` on top of its own) with graphs
    ("graph") and without ("eager"), and, where the replayed step has host tasks, replayed with
    its cold rows deferred a layer ("deferred", ``--defer-cold``); with each, the host ms of the
    last step's queueing, served tasks and waiting."""
    out: dict[str, Any] = {}
    modes = {
        "graph": {"graphs": True},
        "eager": {"graphs": False},
        "deferred": {"graphs": True, "defer_cold": True},
    }
    for key, mode in modes.items():
        if key == "deferred" and not out["graph"]["hybrid"]:
            break
        options = dataclasses.replace(llm.options, **(opts | mode))
        best, host, cpu_busy = 0.0, {}, 0.0
        for _ in range(repeats):
            cache = llm.model.new_cache(len(prompt) + n_tok + 4)
            sampler = make_sampler(SamplingParams(temperature=0))
            steps = generate_step(llm.model, prompt, sampler, cache, options)
            next(steps)  # the prompt and the first token
            next(steps)  # a warm step (the plan, its capture)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n_tok):
                next(steps)
            wall = time.perf_counter() - t0
            if n_tok / wall > best:  # this process's CPU seconds over the cores' wall seconds
                cpu_busy = (time.process_time() - c0) / (wall * (os.cpu_count() or 1))
            best = max(best, n_tok / wall)
            plan = llm.model.plans.get(llm.model, options, 1)
            step = None if plan is None else plan.device
            host = {
                "plan": "device step" if step is not None else (plan and plan.refusal),
                "captured": step is not None and step.graph is not None,
                "capture_error": None if step is None else step.reason,
                "hybrid": step is not None and step.cold is not None,
                "deferred": step is not None and step.deferred,
                "host_ms": None if step is None else 1e3 * step.host_s,
                "serve_ms": None if step is None else 1e3 * step.serve_s,
                "wait_ms": None if step is None else 1e3 * step.wait_s,
            }
        out[key] = {"tok_s": best, "ms_per_token": 1e3 / best, "cpu_busy": cpu_busy, **host}
    return out


# ----------------------------------------------------------------------------------- Q4_0 model
def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's reference Q4_0 rounding of x (rows, cols) f32, cols % 32 == 0, on x's device:
    d = (the block's value of largest magnitude) / -8, q = min(15, trunc(x / d + 8.5)) ->
    (rows, cols / 32 · 18) uint8 (f16 d, then 16 bytes: element j low, j + 16 high)."""
    rows, cols = x.shape
    b = x.reshape(rows, cols // 32, 32)
    big = b.gather(2, b.abs().argmax(2, keepdim=True))  # (rows, nb, 1) signed
    d = big / -8
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = (b * inv + 8.5).trunc().clamp_(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)  # (rows, nb, 16)
    dh = d.half().view(torch.uint8).reshape(rows, cols // 32, 2)
    return torch.cat([dh, qs], dim=2).reshape(rows, -1)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's reference Q8_0 rounding: d = max|x| / 127, q = round(x / d) -> (rows, cols / 32 ·
    34) uint8 (f16 d, then 32 int8)."""
    rows, cols = x.shape
    b = x.reshape(rows, cols // 32, 32)
    d = b.abs().amax(2, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    v = b * inv
    q = (v.sign() * (v.abs() + 0.5).floor()).to(torch.int8).view(torch.uint8)  # roundf
    dh = d.half().view(torch.uint8).reshape(rows, cols // 32, 2)
    return torch.cat([dh, q], dim=2).reshape(rows, -1)


def write_q4_0(path: Path, shape: synth.Shape, dev: torch.device, seed: int = 0) -> Path:
    """A random PWRI model of ``shape`` in Q4_0 (the output Q8_0, predictors F16, norms F32),
    drawn and quantized on ``dev``, streamed to ``path``; fc2 rows scaled by a power law so that
    a few neurons are predicted hot (as device_check's F16 model)."""
    plan = synth.Plan(shape, GGMLType.Q4_0, GGMLType.F16, GGMLType.Q8_0)
    infos = synth.tensor_infos(plan)
    gen = torch.Generator(device=dev).manual_seed(seed)
    fc2 = Names.FC2.format(l=0).split(".", 2)[2]
    down = Names.FFN_DOWN_T.format(l=0).split(".", 2)[2]
    with GGUFStreamWriter(
        path, synth.key_values(plan, "device-check-q4_0", None), infos, magic=b"PWRI"
    ) as w:
        for name, np_shape, ggml_type in infos:
            if len(np_shape) == 1:
                t = 1.0 + 0.1 * torch.randn(np_shape, generator=gen, device=dev)
                w.write(name, t.cpu().numpy())
                continue
            rows, cols = np_shape
            fan_in = rows if name.endswith(down) else cols
            t = torch.randn(rows, cols, generator=gen, device=dev).mul_(fan_in**-0.5)
            if name.endswith(fc2):
                perm = torch.randperm(rows, generator=gen, device=dev)
                scale = (1.0 + perm.float()) ** -0.5
                t.mul_((scale / scale.mean())[:, None])
            if ggml_type == GGMLType.F16:
                data = t.half().cpu().numpy()
            elif ggml_type == GGMLType.Q4_0:
                data = quantize_q4_0(t).cpu().numpy().reshape(-1)
            else:
                data = quantize_q8_0(t).cpu().numpy().reshape(-1)
            w.write(name, data, np_shape)
    return path


# ----------------------------------------------------------------------------------- kernels
def kernel_rates(shape: synth.Shape, dev: torch.device, reps: int) -> list[dict]:
    """Each fused op alone at ``shape``'s sizes (F16 and Q4_0 weights; one token, and 8): its
    microseconds per call and the GB/s of the bytes it must read."""
    d, ff = shape.n_embd, shape.n_ff
    hd, n_kv = d // shape.n_head, shape.n_head_kv
    rows: list[dict] = []

    def add(op: str, what: str, nbytes: int, fn, *args, **kw) -> None:
        call = functools.partial(fn, *args, **kw)
        call()  # compiles, warms
        s = timed(dev, call, reps)
        rows.append({"op": op, "case": what, "us": 1e6 * s, "gb_s": nbytes / s / 1e9})

    for qt, name in ((GGMLType.F16, "f16"), (GGMLType.Q4_0, "q4_0")):
        code = gpu_kernels.TYPES[qt]

        def blocks(w: torch.Tensor, qt=qt) -> torch.Tensor:
            return w.half().view(torch.uint8) if qt == GGMLType.F16 else quantize_q4_0(w)

        for r, c, label in ((d + 2 * n_kv * hd, d, "qkv"), (2 * ff, d, "gate_up")):
            raw = blocks(torch.randn(r, c, device=dev))
            for T in (1, 8):
                x = torch.randn(T, c, device=dev)
                add(
                    "linear",
                    f"{name} {label} {r}x{c} T={T}",
                    raw.numel(),
                    gpu_kernels.linear_op,
                    raw,
                    x,
                    code,
                    c,
                    None,
                    None,
                )
            need = torch.rand(1, ff, device=dev) < 0.1
            x = torch.randn(1, c, device=dev)
            every = torch.arange(ff, device=dev)
            add(
                "linear",
                f"{name} {label} 10% needed",
                raw.numel() // 10,
                gpu_kernels.linear_op,
                raw,
                x,
                code,
                c,
                need,
                every,
            )
        raw = blocks(torch.randn(ff, d, device=dev))
        for share in (1.0, 0.1):
            h = torch.randn(1, ff, device=dev) * (torch.rand(1, ff, device=dev) < share)
            add(
                "block_rows_sum",
                f"{name} down {ff}x{d} {share:.0%} nonzero",
                int(raw.numel() * share),
                gpu_kernels.block_rows_sum_op,
                raw,
                h,
                code,
                d,
            )
    for length in (256, 2048):
        k = torch.randn(length + 1, n_kv, hd, device=dev).half()
        q = torch.randn(1, shape.n_head, hd, device=dev)
        base = torch.zeros(1, dtype=torch.long, device=dev)
        pos = torch.tensor([length - 1], device=dev)
        add(
            "decode_attention",
            f"{length} positions",
            2 * length * n_kv * hd * 2,
            gpu_kernels.decode_attention,
            q,
            k,
            torch.randn_like(k),
            base,
            pos,
            scale=hd**-0.5,
            span=length,
        )
    rows += predictor_rates(shape, dev, reps)
    return rows


def predictor_rates(shape: synth.Shape, dev: torch.device, reps: int) -> list[dict]:
    """A layer's predictor (``fc2 · relu(fc1 · x)``, F16, one token) on the device and in the
    native CPU kernels with this process's threads: which side it pays to run on
    (docs/gpu.md, "Where the predictor runs"). Each call reads the next of enough copies to
    exceed the caches (256 MiB), as a step reads every layer's once."""
    from powerpy.model import kernels

    d, ff, H = shape.n_embd, shape.n_ff, shape.hidden
    nbytes = 2 * (H * d + ff * H)
    n_copies = max(1, -(-(256 << 20) // nbytes))
    fcs = [(torch.randn(H, d).half(), torch.randn(ff, H).half()) for _ in range(n_copies)]
    code = gpu_kernels.TYPES[GGMLType.F16]
    x = torch.randn(1, d)
    x_dev = x.to(dev)
    on_dev = [tuple(w.to(dev).view(torch.uint8) for w in pair) for pair in fcs]
    lib = kernels.library()
    on_host = [] if lib is None else [tuple(map(kernels.Matrix.of_dense, p)) for p in fcs]
    turn = iter(range(1 << 62))

    def device_call() -> torch.Tensor:
        w1, w2 = on_dev[next(turn) % n_copies]
        z = F.relu(gpu_kernels.linear_op(w1, x_dev, code, d, None, None))
        return gpu_kernels.linear_op(w2, z, code, H, None, None)

    def host_call() -> torch.Tensor:
        m1, m2 = on_host[next(turn) % n_copies]
        return lib.gather_gemv(m2, lib.gather_gemv(m1, x[0], None).relu_(), None)

    out = []
    what = f"f16 {H}x{d} + {ff}x{H}"
    sides = [("device", device_call, dev)] + ([("host", host_call, HOST)] if lib else [])
    for side, fn, where in sides:
        for _ in range(n_copies):  # compiles, warms (and faults every copy in)
            fn()
        s = timed(where, fn, max(reps, n_copies))
        row = {"op": "predictor", "case": f"{what} on the {side}", "us": 1e6 * s}
        out.append(row | {"gb_s": nbytes / s / 1e9, "threads": torch.get_num_threads()})
    return out
