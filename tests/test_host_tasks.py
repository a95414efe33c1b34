"""A hybrid layer's cold rows as host tasks (``powerpy.model.host_tasks``, ``csrc/host_tasks.h``).

The two host functions a CUDA stream calls, ``pp_host_submit`` and ``pp_host_wait``, are called
here as the CUDA driver calls them: from a thread of its own, not the one that built the task.
The task's sum is checked against the same rows summed in float64; tasks in flight finish in any
wait order; a failed task reports its status, and a step raises it, without hanging.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
import tool_modules
import torch

from powerpy.api import load
from powerpy.formats.constants import GGMLType
from powerpy.formats.gpuidx import GpuIndex
from powerpy.model import kernels
from powerpy.model.device import Accelerator
from powerpy.model.host_tasks import ColdTask, ColdTasks, check_layout
from powerpy.model.options import RunOptions
from powerpy.placement.placement import Placement
from powerpy.placement.runtime import build_hybrid
from powerpy.testing import TinySpec, write_tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
SPEC = TinySpec(n_embd=64, n_layer=2, n_ff=256, n_head=4, n_head_kv=2)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks") / "m.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, seed=5, dtype=GGMLType.F16)
    llm = load(path, threshold=0.0, exact_activations=True)
    rng = np.random.default_rng(3)
    buckets = [np.sort(rng.choice(SPEC.n_ff, 100, replace=False)) for _ in range(SPEC.n_layer)]
    index = GpuIndex.from_buckets(buckets, SPEC.n_ff, vram_capacity=0)
    placement = Placement.for_model(llm.file, 1 << 40, index, n_ctx=32)
    model = build_hybrid(llm.model, placement, Accelerator("cpu"), file=llm.file).model
    return llm, model


def _tasks(llm, model, batch=2) -> ColdTasks:
    from powerpy.model import numerics

    opts = RunOptions(threshold=0.0, numerics=llm.options.numerics)
    with numerics.using(opts.numerics):
        return ColdTasks(model, opts, batch)


def _want(blk, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The cold, predicted rows of a ReGLU FFN summed in float64: (T, n_embd)."""
    g = blk.ffn_gate.dequantize().double()
    u = blk.ffn_up.dequantize().double()
    d = blk.ffn_down_t.dequantize().double()
    h = torch.relu(x.double() @ g.T) * (x.double() @ u.T)  # (T, n_ff)
    keep = mask & blk.hot.cold
    return (h * keep) @ d


def _fill(c, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, SPEC.n_embd, generator=g)
    mask = torch.rand(T, SPEC.n_ff, generator=g) < 0.4
    c.x[:T].copy_(x)
    c.mask[:T].copy_(mask)
    c.task.T = T
    return x, mask


def _fill_layers(tasks: ColdTasks, model) -> dict[int, torch.Tensor]:
    """Two tokens' inputs and masks in every layer's task; each layer's expected sum."""
    want = {}
    for l, c in tasks.layers.items():
        x, mask = _fill(c, 2, seed=l)
        want[l] = _want(model.weights.blk[l], x, mask)
    return want


def test_the_task_layout_is_the_libraries():
    check_layout(kernels.library())
    assert ctypes.sizeof(ColdTask) == 112


def test_the_host_functions_run_from_another_thread_in_flight(hybrid):
    """Submit both layers' tasks from one thread, wait for them in the other order from
    another; each sum is the cold predicted rows', computed on the worker thread."""
    llm, model = hybrid
    tasks = _tasks(llm, model)
    lib = tasks.lib.cdll
    want, got = _fill_layers(tasks, model), {}

    def submit():
        for c in tasks.layers.values():
            lib.pp_host_submit(c.ptr)

    def wait():
        for l in sorted(tasks.layers, reverse=True):
            lib.pp_host_wait(tasks.layers[l].ptr)
            got[l] = tasks.layers[l].y[:2].clone()

    for fn in (submit, wait):
        th = threading.Thread(target=fn)
        th.start()
        th.join(timeout=30)
        assert not th.is_alive()
    tasks.check()
    for l in tasks.layers:
        torch.testing.assert_close(got[l].double(), want[l], atol=1e-5, rtol=1e-5)
    # the worker ran them, not the submitting thread: a synchronous run records another thread
    worker = {tasks.layers[l].task.ran_on for l in tasks.layers}
    c = tasks.layers[0]
    assert lib.pp_cold_run(c.ptr) == 0 and c.task.ran_on not in worker and len(worker) == 1
    torch.testing.assert_close(c.y[:2].double(), want[0], atol=1e-5, rtol=1e-5)


def test_a_served_worker_runs_the_tasks_on_the_serving_thread(hybrid):
    """On CUDA the driver's thread calls the host functions and the step's own thread serves
    the tasks (``pp_worker_serve``): here a thread plays the driver (submit, submit, wait,
    wait, as a deferred step orders them) while this one serves; the sums are the cold rows',
    and this thread ran them."""
    from powerpy.model import numerics

    llm, model = hybrid
    opts = RunOptions(threshold=0.0, numerics=llm.options.numerics)
    with numerics.using(opts.numerics):
        tasks = ColdTasks(model, opts, 2)
    tasks.worker = type(tasks.worker)(tasks.lib, served=True)
    for c in tasks.layers.values():
        c.task.worker = tasks.worker.ptr
    lib = tasks.lib.cdll
    want, got = _fill_layers(tasks, model), {}

    def driver():
        for c in tasks.layers.values():
            lib.pp_host_submit(c.ptr)
        for l, c in tasks.layers.items():
            lib.pp_host_wait(c.ptr)
            got[l] = c.y[:2].clone()

    th = threading.Thread(target=driver)
    th.start()
    tasks.worker.serve(len(tasks.layers))
    th.join(timeout=30)
    assert not th.is_alive()
    tasks.check()
    for l in tasks.layers:
        torch.testing.assert_close(got[l].double(), want[l], atol=1e-5, rtol=1e-5)
    c = tasks.layers[0]
    ran = {t.task.ran_on for t in tasks.layers.values()}
    assert lib.pp_cold_run(c.ptr) == 0 and ran == {c.task.ran_on}  # this thread's
    assert lib.pp_worker_serve(_tasks(llm, model).worker.ptr, 1) == 2  # a threaded one: refused


def test_a_failed_task_is_reported_not_hung(hybrid):
    llm, model = hybrid
    tasks = _tasks(llm, model)
    c = tasks.layers[1]
    _fill(c, 1, seed=9)
    bad = kernels.LayerRecord.from_buffer_copy(c.record)
    bad.variant = 99  # no such FFN variant
    c.task.rec = ctypes.addressof(bad)
    lib = tasks.lib.cdll
    lib.pp_host_submit(c.ptr)
    lib.pp_host_wait(c.ptr)
    assert c.task.status == 2  # PP_ERR_ARG
    with pytest.raises(RuntimeError, match=r"layer 1: the cold rows' task failed \(status 2\)"):
        tasks.check()
    lib.pp_host_wait(tasks.layers[0].ptr)  # never submitted: returns at once


def test_the_hand_off_benchmark_runs(tmp_path):
    """``tools/bench_host_tasks.py`` on a tiny layer: every figure measured, the served and the
    threaded hand-offs computing the same task (its status stays 0)."""
    import json

    tool = tool_modules.tool("bench_host_tasks")
    out = tmp_path / "r.json"
    assert tool.main(["--shape", "tiny", "--calls", "20", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["cold_rows"] > 0
    for key in ("empty_us", "in_place_us", "handed_us", "after_gap_us", "served_us"):
        assert r[key] > 0, key
    assert r["after_gap_us"] >= r["gap_us"]
