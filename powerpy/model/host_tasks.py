"""A hybrid layer's cold rows inside the device's step: host tasks the stream runs in order
(``csrc/host_tasks.h``).

In a decode plan's device step (``plan.DeviceStep``) a layer with FFN rows on the host does, on
the device's stream, with no Python between the steps and no host wait of its own:

1. copy the FFN's normed input and the predictor's mask into fixed pinned buffers;
2. a host function, ``pp_host_submit``: hand the layer's task to the plan's worker thread, which
   sums the predicted cold rows in the native kernels (one call, as the CPU-only FFN block);
3. the hot rows on the device, while the worker computes;
4. a host function, ``pp_host_wait``: return when the worker has written the cold rows' sum;
5. copy that sum to the device and add it to the hot rows'.

On CUDA the host functions are ``cudaLaunchHostFunc`` nodes (of the captured graph); on the
emulated accelerator the ``powerpy::host_call`` op calls them, in the order the stream would, and
the emulated graph replays them with the rest; on fake CUDA they are counted.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from torch import Tensor

from powerpy.model import kernels, layer_record
from powerpy.model.options import RunOptions

_p, _i64, _i32, _u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint64


class ColdTask(ctypes.Structure):
    """``struct ColdTask`` of ``csrc/host_tasks.h`` (its layout is checked against the C one)."""

    _fields_ = [
        ("worker", _p), ("rec", _p), ("x", _p), ("mask", _p), ("cold", _p), ("y", _p),
        ("kept", _p), ("T", _i64), ("act", _i32), ("nthreads", _i32), ("status", _i32),
        ("state", _i32), ("ran_on", _u64),
    ]  # fmt: skip


# the library's exports of this module (set on first use; kernels.py binds the others)
_SIGNATURES = {
    "pp_worker_new": ([], _p), "pp_worker_free": ([_p], None), "pp_host_submit": ([_p], None),
    "pp_host_wait": ([_p], None), "pp_cold_run": ([_p], _i32), "pp_cold_task_layout": ([_p], None),
}  # fmt: skip


def check_layout(lib: kernels.KernelLibrary) -> None:
    """Bind this module's exports; raise ``KernelBuildError`` when the library's ColdTask is
    not :class:`ColdTask`."""
    for name, (args, restype) in _SIGNATURES.items():
        fn = getattr(lib.cdll, name)
        fn.argtypes, fn.restype = args, restype
    got = (ctypes.c_int64 * 14)()
    lib.cdll.pp_cold_task_layout(got)
    want = [getattr(ColdTask, f).offset for f, _ in ColdTask._fields_] + [ctypes.sizeof(ColdTask)]
    if list(got) != want:
        raise kernels.KernelBuildError(f"ColdTask layout {list(got)}, expected {want}")


def entry(lib: kernels.KernelLibrary, name: str) -> int:
    """The address of an exported C function (a host function for the stream)."""
    return ctypes.cast(getattr(lib.cdll, name), ctypes.c_void_p).value


class Worker:
    """The native worker thread of a plan's cold tasks (freed with this object)."""

    def __init__(self, lib: kernels.KernelLibrary) -> None:
        self.ptr = lib.cdll.pp_worker_new()
        if not self.ptr:
            raise MemoryError("pp_worker_new: no worker thread")
        weakref.finalize(self, lib.cdll.pp_worker_free, self.ptr)


class ColdLayer:
    """One hybrid layer's task and its fixed buffers for a step of up to ``batch`` sessions."""

    def __init__(self, blk, args, opts: RunOptions, accel, worker: Worker, batch: int) -> None:
        part = layer_record.ffn_part(blk, args, opts, cold=True)
        if part is None:
            raise ValueError("the layer's host rows are not for the native kernels")
        self.part = part  # keeps the matrices and vectors the record points into
        self.record = layer_record.record(part)
        n_ff, d = args.n_ff, args.n_embd
        self.x = accel.pinned(batch, d, dtype=torch.float32)  # (B, n_embd) normed input
        self.mask = accel.pinned(batch, n_ff, dtype=torch.bool)  # (B, n_ff)
        self.y = accel.pinned(batch, d, dtype=torch.float32)  # (B, n_embd) the cold rows' sum
        self.y_dev = accel.zeros(batch, d, dtype=torch.float32)
        cold = (
            torch.ones(n_ff, dtype=torch.uint8) if blk.hot is None else blk.hot.cold.to(torch.uint8)
        )
        self.cold = cold.contiguous()
        self.kept = torch.zeros(batch, dtype=torch.int64)
        self.masked = blk.gates(opts)  # the predictor's mask selects (else every cold row)
        self.task = ColdTask(
            worker.ptr, ctypes.addressof(self.record), self.x.data_ptr(),
            self.mask.data_ptr() if self.masked else None, self.cold.data_ptr(),
            self.y.data_ptr(), self.kept.data_ptr(), batch, kernels.act_code(),
            torch.get_num_threads(), 0, 0, 0,
        )  # fmt: skip
        self.ptr = ctypes.addressof(self.task)


class ColdTasks:
    """A plan's cold tasks: one :class:`ColdLayer` per layer with FFN rows on the host, the
    worker that runs them and the two host functions' addresses."""

    def __init__(self, model, opts: RunOptions, batch: int) -> None:
        lib = kernels.library()
        if lib is None:
            raise ValueError("the native kernels are unavailable")
        check_layout(lib)
        self.lib, self.accel = lib, model.accel
        self.worker = Worker(lib)
        self.submit, self.wait = entry(lib, "pp_host_submit"), entry(lib, "pp_host_wait")
        self.layers = {
            l: ColdLayer(blk, model.args, opts, model.accel, self.worker, batch)
            for l, blk in enumerate(model.weights.blk)
            if blk.hot is None or blk.hot.cold_idx.numel()
        }

    def set_tokens(self, n: int) -> None:
        """The next step's sessions (the rows its tasks sum; padded ones are not)."""
        for c in self.layers.values():
            c.task.T = n

    def check(self) -> None:
        """Raise when a task of the last step failed (its status names the error)."""
        for l, c in self.layers.items():
            if c.task.status:
                what = "timed out" if c.task.status == 7 else f"status {c.task.status}"
                raise RuntimeError(f"layer {l}: the cold rows' task failed ({what})")

    def run(self, l: int, x: Tensor, act: Tensor | None, hot_part) -> Tensor:
        """Layer ``l``'s FFN in the stream: x (T, n_embd) the normed input and act (T, n_ff)
        the mask on the device; ``hot_part()`` queues the hot rows (None: no hot rows) ->
        (T, n_embd) f32 on the device, the cold rows' sum added."""
        c, accel, T = self.layers[l], self.accel, x.shape[0]
        accel.copy_out(c.x[:T], x)
        if c.masked and act is not None:
            accel.copy_out(c.mask[:T], act)
        accel.host_func(self.submit, c.ptr, c.x)
        y_hot = hot_part()
        accel.host_func(self.wait, c.ptr, c.y)
        accel.copy_in(c.y_dev[:T], c.y[:T])
        return c.y_dev[:T] if y_hot is None else y_hot + c.y_dev[:T]


# ----------------------------------------------------------------------------------- the op
@torch.library.custom_op("powerpy::host_call", mutates_args=("dep",))
def host_call(dep: Tensor, fn: int, arg: int) -> None:
    """Call the C host function ``fn(arg)`` in the emulated stream's order; ``dep`` is the
    buffer it reads or writes (so that the op is ordered with the copies around it)."""
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)(arg)


@host_call.register_fake
def _(dep, fn, arg):
    return None
