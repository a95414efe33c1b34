"""What handing a hybrid layer's cold rows to the native worker costs (``csrc/host_tasks.h``).

In a hybrid decode step the CUDA stream calls two host functions per layer: ``pp_host_submit``
queues the layer's task on the plan's worker thread, ``pp_host_wait`` returns once the worker has
written the cold rows' sum. Each is a hand-off between two threads. This script times them on
the host, called as the driver calls them (one thread submits and waits; the worker runs the
task with the kernels' thread team), medians over ``--calls`` calls:

- ``empty``: a task with no token, submitted and waited for at once: the two hand-offs alone;
- ``in place``: a layer's cold task (a 7B-width FFN, F16, 30% of its rows on the device and 10%
  predicted active) run on the calling thread (``pp_cold_run``): the work itself;
- ``handed``: the same task submitted and waited for at once (the wait outlasts the work);
- ``after a gap``: submitted, then ``--gap`` µs of other work (the device's hot rows), then
  waited for;
- ``served``: as on CUDA, a thread standing for the driver's submits and waits while this one
  serves the task (``pp_worker_serve``) with its own thread team, the one ``in place`` used.

``handed`` (or ``served``) minus ``in place`` is what the hand-offs add to a layer whose CPU part
is its critical path.

Examples:
    python tools/bench_host_tasks.py
    python tools/bench_host_tasks.py --calls 200 --gap 100 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from powerpy._fs import atomic_write
from powerpy.api import load
from powerpy.formats.constants import GGMLType
from powerpy.formats.gpuidx import GpuIndex
from powerpy.model import numerics
from powerpy.model.device import Accelerator
from powerpy.model.host_tasks import ColdTasks
from powerpy.model.options import RunOptions
from powerpy.placement.placement import Placement
from powerpy.placement.runtime import build_hybrid
from powerpy.testing import TinySpec, write_tiny_model

SHAPES = {  # one layer's FFN at these widths (the task reads its cold rows)
    "7b": TinySpec(n_embd=4096, n_layer=1, n_ff=11008, n_head=32, n_head_kv=32),
    "small": TinySpec(n_embd=1024, n_layer=1, n_ff=4096, n_head=16, n_head_kv=4),
    "tiny": TinySpec(n_embd=64, n_layer=1, n_ff=256, n_head=4, n_head_kv=2),
}


def cold_task(spec: TinySpec, hot_share: float, active: float, tmp: Path):
    """A one-layer hybrid model's cold task (``hot_share`` of its rows on the emulated device),
    ``active`` of its rows predicted active (drawn)."""
    path = tmp / "layer.powerinfer.gguf"
    write_tiny_model(path, spec, sparse=True, seed=1, dtype=GGMLType.F16)
    llm = load(path, threshold=0.0)
    n_hot = int(hot_share * spec.n_ff)
    hot = np.sort(np.random.default_rng(0).choice(spec.n_ff, n_hot, replace=False))
    index = GpuIndex.from_buckets([hot], spec.n_ff, vram_capacity=0)
    placement = Placement.for_model(llm.file, 1 << 40, index, n_ctx=32)
    model = build_hybrid(llm.model, placement, Accelerator("cpu"), file=llm.file).model
    opts = RunOptions(threshold=0.0, numerics=llm.options.numerics)
    with numerics.using(opts.numerics):
        tasks = ColdTasks(model, opts, 1)
    c = tasks.layers[0]
    c.x[:1].copy_(torch.randn(1, spec.n_embd))
    c.mask.copy_(torch.rand(c.mask.shape, generator=torch.Generator().manual_seed(2)) < active)
    return tasks, c, int((c.cold.bool() & c.mask[0]).sum())


def median_us(fn, calls: int) -> float:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(out)


def served_us(tasks, c, calls: int) -> float:
    """Median µs from submit to the end of wait, seen by a thread standing for the driver's,
    while this thread serves each task."""
    from powerpy.model.host_tasks import Worker

    worker = Worker(tasks.lib, served=True)
    threaded, c.task.worker = c.task.worker, worker.ptr
    lib, times = tasks.lib.cdll, []

    def driver() -> None:
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            lib.pp_host_submit(c.ptr)
            lib.pp_host_wait(c.ptr)
            times.append((time.perf_counter_ns() - t0) / 1e3)

    th = threading.Thread(target=driver)
    th.start()
    for _ in range(calls):
        worker.serve(1)
    th.join()
    c.task.worker = threaded
    return statistics.median(times)


def measure(shape: str, calls: int, gap_us: float, hot_share: float, active: float) -> dict:
    spec = SHAPES[shape]
    with tempfile.TemporaryDirectory(prefix="powerpy-tasks-") as tmp:
        tasks, c, n_cold = cold_task(spec, hot_share, active, Path(tmp))
        lib = tasks.lib.cdll
        submit, wait, run = lib.pp_host_submit, lib.pp_host_wait, lib.pp_cold_run

        def handed() -> None:
            submit(c.ptr)
            wait(c.ptr)

        def after_gap() -> None:
            submit(c.ptr)
            end = time.perf_counter_ns() + gap_us * 1e3
            while time.perf_counter_ns() < end:
                pass
            wait(c.ptr)

        row_bytes = 3 * spec.n_embd * 2  # gate, up and down rows, F16
        out = {"shape": shape, "threads": torch.get_num_threads(), "cold_rows": n_cold}
        out["cold_mb"] = n_cold * row_bytes / 1e6
        run(c.ptr)  # warm
        out["in_place_us"] = median_us(lambda: run(c.ptr), calls)
        # served first: the worker's own thread, once it has run a task, keeps a second OpenMP
        # team (the throttling it causes is what serving avoids)
        out["served_us"] = served_us(tasks, c, calls)
        out["served_added_us"] = out["served_us"] - out["in_place_us"]
        c.task.T = 0
        out["empty_us"] = median_us(handed, calls)
        c.task.T = 1
        out["handed_us"] = median_us(handed, calls)
        out["gap_us"] = gap_us
        out["after_gap_us"] = median_us(after_gap, calls)
        out["added_us"] = out["handed_us"] - out["in_place_us"]
        if c.task.status:
            raise RuntimeError(f"the task failed (status {c.task.status})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="7b")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--gap", type=float, default=50.0, help="µs between submit and wait")
    ap.add_argument("--hot-share", type=float, default=0.3, help="rows on the device")
    ap.add_argument("--active", type=float, default=0.1, help="rows predicted active")
    ap.add_argument("--threads", type=int, default=0, help="the task's threads (0: torch's)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.calls < 1 or a.gap < 0 or not 0 <= a.hot_share < 1 or not 0 < a.active <= 1:
        ap.error("--calls >= 1, --gap >= 0, 0 <= --hot-share < 1 and 0 < --active <= 1")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    r = measure(a.shape, a.calls, a.gap, a.hot_share, a.active)
    print(
        f"{r['shape']}: {r['cold_rows']} cold rows predicted ({r['cold_mb']:.1f} MB), "
        f"{r['threads']} threads, medians of {a.calls} calls\n"
        f"  empty task, handed off:   {r['empty_us']:8.1f} us\n"
        f"  task in place:            {r['in_place_us']:8.1f} us\n"
        f"  task handed off:          {r['handed_us']:8.1f} us  (+{r['added_us']:.1f})\n"
        f"  after a {a.gap:g} us gap:      {r['after_gap_us']:8.1f} us\n"
        f"  served by this thread:    {r['served_us']:8.1f} us  (+{r['served_added_us']:.1f})"
    )
    if a.json:
        with atomic_write(a.json) as tmp:
            tmp.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
