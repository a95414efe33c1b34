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

A mixture of experts' layer is the same five steps, its router's choice (the experts and their
weights) copied out beside the input, the worker summing each routed expert's cold neurons.

On CUDA the host functions are ``cudaLaunchHostFunc`` nodes (of the captured graph); on the
emulated accelerator the ``powerpy::host_call`` op calls them, in the order the stream would, and
the emulated graph replays them with the rest; on fake CUDA they are counted.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from torch import Tensor

from powerpy.model import kernels, layer_record, moe
from powerpy.model.options import RunOptions

_p, _i64, _i32, _u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint64


class HostRowsError(ValueError):
    """A layer's host rows that no cold task can run (the plan keeps the per-layer path)."""


class ColdTask(ctypes.Structure):
    """``struct ColdTask`` of ``csrc/host_tasks.h`` (its layout is checked against the C one)."""

    _fields_ = [
        ("worker", _p),
        ("rec", _p),
        ("x", _p),
        ("mask", _p),
        ("cold", _p),
        ("y", _p),
        ("kept", _p),
        ("ids", _p),
        ("wts", _p),
        ("T", _i64),
        ("k", _i64),
        ("act", _i32),
        ("nthreads", _i32),
        ("status", _i32),
        ("state", _i32),
        ("ran_on", _u64),
    ]


# the library's exports of this module (set on first use; kernels.py binds the others)
_SIGNATURES = {
    "pp_worker_new": ([_i32], _p),
    "pp_worker_free": ([_p], None),
    "pp_worker_serve": ([_p, _i64], _i32),
    "pp_host_submit": ([_p], None),
    "pp_host_wait": ([_p], None),
    "pp_cold_run": ([_p], _i32),
    "pp_cold_task_layout": ([_p], None),
}


def check_layout(lib: kernels.KernelLibrary) -> None:
    """Bind this module's exports; raise ``KernelBuildError`` when the library's ColdTask is
    not :class:`ColdTask`."""
    for name, (args, restype) in _SIGNATURES.items():
        fn = getattr(lib.cdll, name)
        fn.argtypes, fn.restype = args, restype
    got = (ctypes.c_int64 * (len(ColdTask._fields_) + 1))()
    lib.cdll.pp_cold_task_layout(got)
    want = [getattr(ColdTask, f).offset for f, _ in ColdTask._fields_] + [ctypes.sizeof(ColdTask)]
    if list(got) != want:
        raise kernels.KernelBuildError(f"ColdTask layout {list(got)}, expected {want}")


def entry(lib: kernels.KernelLibrary, name: str) -> int:
    """The address of an exported C function (a host function for the stream)."""
    return ctypes.cast(getattr(lib.cdll, name), ctypes.c_void_p).value


class Worker:
    """The native queue of a plan's cold tasks (freed with this object), run by a thread of its
    own, or (``served``) by the thread that calls :meth:`serve` (``csrc/host_tasks.h``)."""

    def __init__(self, lib: kernels.KernelLibrary, served: bool = False) -> None:
        self.lib, self.served = lib, served
        self.ptr = lib.cdll.pp_worker_new(int(served))
        if not self.ptr:
            raise MemoryError("pp_worker_new: no worker")
        weakref.finalize(self, lib.cdll.pp_worker_free, self.ptr)

    def serve(self, n: int) -> None:
        """Run the next ``n`` tasks on this thread as the stream submits them."""
        st = self.lib.cdll.pp_worker_serve(self.ptr, n)
        if st:
            what = "did not come" if st == 7 else f"status {st}"
            raise RuntimeError(f"the step's cold tasks {what}")


def hosted(blk, accel) -> bool:
    """Whether a layer keeps FFN rows (or expert neurons) on the host of ``accel``: its step
    has a cold task."""
    if blk.moe is not None:
        return blk.moe.hot is None or blk.moe.hot.n_cold > 0
    if accel.holds(blk.ffn_up.storage):  # a mixture's leading dense layer, placed whole
        return False
    return blk.hot is None or blk.hot.cold_idx.numel() > 0


class ColdLayer:
    """One hybrid layer's task and its fixed buffers for a step of up to ``batch`` sessions
    (a mixture's: also its router's choice, and the neurons it added, for the statistics)."""

    def __init__(self, blk, args, opts: RunOptions, accel, worker: Worker, batch: int) -> None:
        ex = blk.moe
        if ex is None:
            part = layer_record.ffn_part(blk, args, opts, cold=True)
            n, hot, k = args.n_ff, blk.hot, 0
        else:
            part = moe.moe_cold_part(blk, opts)
            n, hot, k = ex.n_neurons, ex.hot, ex.n_used
        if part is None:
            raise HostRowsError(
                "host rows the native cold task cannot read (their types, or "
                "the experts' activation)"
            )
        self.part = part  # keeps the matrices and vectors the record points into
        self.record = layer_record.record(part)
        d = args.n_embd
        self.x = accel.pinned(batch, d, dtype=torch.float32)  # (B, n_embd) normed input
        self.mask = accel.pinned(batch, n if ex is None else 1, dtype=torch.bool)  # (B, n_ff)
        self.ids = accel.pinned(batch, max(k, 1), dtype=torch.int64)  # (B, k) routed experts
        self.wts = accel.pinned(batch, max(k, 1), dtype=torch.float32)  # (B, k) their weights
        self.y = accel.pinned(batch, d, dtype=torch.float32)  # (B, n_embd) the cold rows' sum
        self.y_dev = accel.zeros(batch, d, dtype=torch.float32)
        cold = torch.ones(n, dtype=torch.uint8) if hot is None else hot.cold.to(torch.uint8)
        self.cold = cold.contiguous()
        self.kept = accel.pinned(batch, dtype=torch.int64)  # (B,) neurons added per token
        self.kept.zero_()
        self.kept_dev = accel.zeros(batch, dtype=torch.int64) if ex is not None else None
        self.masked = ex is None and blk.gates(opts)  # the predictor's mask selects
        routed = (self.ids.data_ptr(), self.wts.data_ptr()) if ex is not None else (None, None)
        self.task = ColdTask(
            worker.ptr,
            ctypes.addressof(self.record),
            self.x.data_ptr(),
            self.mask.data_ptr() if self.masked else None,
            self.cold.data_ptr(),
            self.y.data_ptr(),
            self.kept.data_ptr(),
            *routed,
            batch,
            k,
            kernels.act_code(),
            torch.get_num_threads(),
            0,
            0,
            0,
        )
        self.ptr = ctypes.addressof(self.task)


class ColdTasks:
    """A plan's cold tasks: one :class:`ColdLayer` per layer with FFN rows on the host, the
    worker that runs them and the two host functions' addresses.

    ``defer`` (``RunOptions.defer_cold``): a layer's FFN returns its hot rows alone and its
    task stays in flight; :meth:`settle`, after the next layer's block, waits for it and adds
    its sum to the residual stream (and, given no layer, what is left before the head).

    ``served`` (a step replayed as a graph on a device whose host functions run on a thread of
    the driver's, CUDA): the step's caller runs the tasks (:meth:`serve`) once the step is
    queued, with the thread team of its other native calls. Otherwise the worker has a thread
    of its own: the emulated device's stream calls the host functions inline, and an eager
    step's caller is busy queueing the step's work while the stream reaches them."""

    def __init__(
        self, model, opts: RunOptions, batch: int, defer: bool = False, served: bool = False
    ) -> None:
        lib = kernels.library()
        if lib is None:
            raise HostRowsError("the native kernels are unavailable")
        check_layout(lib)
        self.lib, self.accel = lib, model.accel
        self.worker = Worker(lib, served=served and model.accel.host_funcs_elsewhere)
        self.served = self.worker.served
        self.submitted = 0  # tasks the step being built has submitted
        self.submit, self.wait = entry(lib, "pp_host_submit"), entry(lib, "pp_host_wait")
        self.defer = defer
        # deferred tasks of the step being built, in submission order:
        # (layer, its ColdLayer, tokens, statistics, routed hot neurons (T,) or None)
        self.pending: list[tuple[int, ColdLayer, int, object, Tensor | None]] = []
        self.layers: dict[int, ColdLayer] = {}
        for l, blk in enumerate(model.weights.blk):
            if hosted(blk, model.accel):
                try:
                    self.layers[l] = ColdLayer(
                        blk, model.args, opts, model.accel, self.worker, batch
                    )
                except HostRowsError as e:
                    raise HostRowsError(f"layer {l}: {e}") from None

    def serve(self, n: int) -> None:
        """Run a step's ``n`` submitted tasks on this thread (a served worker; else nothing)."""
        if self.served and n:
            self.worker.serve(n)

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
        (T, n_embd) f32 on the device, the cold rows' sum added (deferred: not yet)."""
        c, T = self.layers[l], x.shape[0]
        self.accel.copy_out(c.x[:T], x)
        if c.masked and act is not None:
            self.accel.copy_out(c.mask[:T], act)
        return self._finish(l, c, x, hot_part, None, None)

    def run_moe(
        self, l: int, x: Tensor, ids: Tensor, w: Tensor, hot_part, stats=None, routed=None
    ) -> Tensor:
        """A mixture's layer ``l`` in the stream: x (T, n_embd) the normed input, ids and w
        (T, k) its router's choice, on the device; ``hot_part()`` queues the hot neurons (None:
        none) -> (T, n_embd) f32 the routed experts' sum, on the device (deferred: its hot
        neurons' alone). ``stats`` (or None) is given the neurons added per token, the host's
        plus ``routed`` (T,) (the hot ones), once the host's are known."""
        c, T = self.layers[l], x.shape[0]
        self.accel.copy_out(c.x[:T], x)
        self.accel.copy_out(c.ids[:T], ids)
        self.accel.copy_out(c.wts[:T], w)
        return self._finish(l, c, x, hot_part, stats, routed)

    def _finish(self, l: int, c: ColdLayer, x: Tensor, hot_part, stats, routed) -> Tensor:
        """Submit ``c``, queue the hot part, and wait for ``c`` unless deferring."""
        T = x.shape[0]
        self.accel.host_func(self.submit, c.ptr, c.x)
        self.submitted += 1
        y_hot = hot_part()
        if self.defer:
            self.pending.append((l, c, T, stats, routed))
            return x.new_zeros((T, c.y.shape[1]), dtype=torch.float32) if y_hot is None else y_hot
        y = self._collect(l, c, T, stats, routed)
        return y if y_hot is None else y_hot + y

    def _collect(self, l: int, c: ColdLayer, T: int, stats, routed) -> Tensor:
        """Wait for ``c``'s task in the stream: its sum (T, n_embd) f32 on the device (and its
        counts given to ``stats``)."""
        self.accel.host_func(self.wait, c.ptr, c.y)
        self.accel.copy_in(c.y_dev[:T], c.y[:T])
        if c.kept_dev is not None:
            self.accel.copy_in(c.kept_dev[:T], c.kept[:T])
            if stats is not None:
                kept = c.kept_dev[:T]
                stats.record_counts(l, kept if routed is None else kept + routed)
        return c.y_dev[:T]

    def settle(self, l: int | None, x: Tensor) -> Tensor:
        """After layer ``l``'s block: x (T, n_embd) the residual stream plus the sums of the
        deferred tasks of earlier layers (none when not deferring; ``l`` None: of every layer,
        before the head)."""
        while self.pending and (l is None or self.pending[0][0] < l):
            x = x + self._collect(*self.pending.pop(0))
        return x
