"""The accelerator behind one small object: device choice, transfers, allocation, side stream.

The model's forward and the split FFN never call ``.to(device)`` or ``torch.cuda`` themselves:
every host <-> device move, every device allocation and the overlap stream go through an
:class:`Accelerator`. One code path then serves three devices:

- ``cpu``: the emulated accelerator (same placement, same split and merge; for CI and demos);
- ``cuda``: a real GPU; the hot FFN part runs on a side stream that overlaps the CPU part;
- a fake CUDA device in tests (``torch._subclasses.FakeTensorMode``): a subclass overrides the
  transfers, so a CPU-only machine can check that device-side ops stay on the device, that the
  bytes placed fit the budget and that the device part makes no host sync.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)

NO_CUDA_MESSAGE = "no CUDA GPU found: running everything on the CPU"
_said_no_cuda = False

HOST = torch.device("cpu")
RING = 4  # pinned staging buffers per (shape, dtype): copies in flight before one must wait
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream_of(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of a CUDA device (each stream costs a cuBLAS workspace)."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class Accelerator:
    """One accelerator device and how to reach it.

    Two kinds of transfer:

    - :meth:`to_device`: a persistent copy (weights at placement), blocking;
    - :meth:`send` / :meth:`fetch`: the per-step copies of a forward. They go through pinned
      host buffers, reused across steps (a ring of :data:`RING` per shape and dtype, each
      guarded by an event), as non-blocking copies on the current stream. ``send`` never waits
      for the device; ``fetch`` waits once, on an event, for all the tensors it copies: the only
      host waits of a decode step (:attr:`waits` counts them).

    A plan (``powerpy.model.plan``) copies through fixed buffers instead: :meth:`pinned`,
    :meth:`copy_in`, :meth:`copy_out`, :meth:`record` and :meth:`wait`, at the same addresses
    every step, as a captured CUDA graph needs.

    Attributes:
        device: the device (``cpu`` when emulated).
        gather_hot: decode gathers only the active hot rows. That needs ``nonzero``, a host
            sync on a GPU, so no device takes it unless asked (tests): the hot part is one
            masked pass with no host round trip, on CUDA and on the emulated device alike.
        fused: placed matrices run in the fused ops (``gpu_kernels``): one launch each on CUDA
            (with Triton), their torch versions on the emulated device.
        waits: host waits on the device so far (each ``fetch`` is one).
    """

    def __init__(
        self, device: torch.device | str, *, gather_hot: bool | None = None, fused=None
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.gather_hot = False if gather_hot is None else gather_hot
        if fused is None:  # the emulated device runs the fused ops' torch versions
            from powerpy.model import gpu_kernels

            fused = self.device.type == "cpu" or gpu_kernels.available()
        self.fused = fused
        self._stream = side_stream_of(self.device) if self.device.type == "cuda" else None
        self._rings: dict[tuple, list] = {}
        self._turn: dict[tuple, int] = {}
        self._placed: set[int] = set()  # emulated: the storages placed on the "device"
        self.waits = 0

    def __repr__(self) -> str:
        return f"Accelerator({self.device}{', emulated' if self.emulated else ''})"

    @property
    def emulated(self) -> bool:
        """The accelerator is the CPU itself (for tests and demos)."""
        return self.device.type == "cpu"

    @property
    def host_funcs_elsewhere(self) -> bool:
        """:meth:`host_func`'s functions run on a thread of the device driver's, when the
        stream reaches them (CUDA), not inline on the caller's (the emulated device)."""
        return not self.emulated

    # --- choice
    @staticmethod
    def choose(device: str | torch.device | None = None) -> Accelerator | None:
        """The accelerator to place on: ``device`` as given, or CUDA when available, else None.

        Args:
            device: ``"cuda"``, ``"cuda:1"``, ``"cpu"`` (emulated) or None (auto).

        Returns:
            None when ``device`` is None and there is no CUDA GPU (logged once per process).

        Raises:
            ValueError: a CUDA device was asked for but none is available (or not that index),
                or an unknown device.
        """
        global _said_no_cuda
        if device is None:
            if torch.cuda.is_available():
                return Accelerator.choose("cuda")
            if not _said_no_cuda:
                log.warning("%s", NO_CUDA_MESSAGE)
                _said_no_cuda = True
            return None
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"unknown device {device!r}: use 'cuda[:N]' or 'cpu'") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {device!r} was asked for but no CUDA GPU is available")
            n = torch.cuda.device_count()
            index = torch.cuda.current_device() if dev.index is None else dev.index
            if index >= n:
                raise ValueError(f"device {device!r}: this machine has {n} CUDA device(s)")
            return Accelerator(torch.device("cuda", index))
        if dev.type != "cpu":
            raise ValueError(f"unsupported accelerator {device!r}: use 'cuda[:N]' or 'cpu'")
        return Accelerator(dev)

    def free_memory(self) -> int | None:
        """Free bytes on the device (CUDA), or None where the notion does not apply."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(self.device)[0])

    # --- persistent copies and allocation
    def to_device(self, t: Tensor) -> Tensor:
        """A persistent copy of host tensor ``t`` on the device (``t`` itself when emulated,
        remembered as placed: :meth:`holds`)."""
        if self.emulated:
            self._placed.add(t.untyped_storage().data_ptr())
            return t
        return t.to(self.device)

    def adopt(self, t: Tensor) -> Tensor:
        """``t``, made on the device from placed tensors (a stack of them), as placed."""
        if self.emulated:
            self._placed.add(t.untyped_storage().data_ptr())
        return t

    def holds(self, t: Tensor) -> bool:
        """Whether ``t`` lives on this device (emulated: was placed by :meth:`to_device`)."""
        if self.emulated:
            return t.untyped_storage().data_ptr() in self._placed
        return t.device == self.device

    def graph_kind(self) -> str | None:
        """How a plan replays a step here (``powerpy.model.graphs``): "cuda", "emulated" or
        None (eager only)."""
        return "emulated" if self.emulated else "cuda"

    def zeros(self, *shape: int, dtype: torch.dtype) -> Tensor:
        """A zero-filled tensor allocated on the device."""
        out = torch.zeros(shape, dtype=dtype, device=self.device)
        if self.emulated:
            self._placed.add(out.untyped_storage().data_ptr())
        return out

    # --- per-step copies
    def send(self, t: Tensor) -> Tensor:
        """Host tensor ``t`` on the device, copied through a pinned buffer without a host wait
        (``t`` itself when emulated)."""
        if self.emulated:
            return t
        slot, buf = self._staging(t)
        buf.copy_(t)
        out = self._h2d(buf)
        self._record(slot)
        return out

    def fetch(self, ts: Sequence[Tensor]) -> list[Tensor]:
        """Device tensors ``ts`` on the host: non-blocking copies into pinned buffers, then one
        wait. The results are views of those buffers: valid until :data:`RING` more copies of
        the same dtype and size class (copy what must live longer)."""
        if self.emulated:
            return list(ts)
        staged = [self._staging(t) for t in ts]
        for t, (_, buf) in zip(ts, staged, strict=True):
            self._d2h(t, buf)
        for slot, _ in staged:
            self._record(slot)
        self._wait(staged[-1][0])
        return [buf for _, buf in staged]

    def move(self, t: Tensor, device: torch.device) -> Tensor:
        """``t`` on ``device`` (the host or this accelerator) by a per-step copy; no copy when
        it is there. A tensor fetched to the host is a copy of its own."""
        if t.device == device:
            return t
        if device.type == "cpu":
            return self.fetch([t])[0].clone()
        return self.send(t)

    # --- a plan's fixed buffers
    def pinned(self, *shape: int, dtype: torch.dtype) -> Tensor:
        """A zeroed host buffer that device copies read or write without staging (page-locked
        on CUDA; a plain tensor when emulated)."""
        if self.emulated:
            return torch.zeros(shape, dtype=dtype)
        with torch.inference_mode(False):
            return torch.zeros(shape, dtype=dtype, pin_memory=True)

    def copy_in(self, dst: Tensor, src: Tensor) -> None:
        """Device tensor ``dst`` <- pinned host ``src``, queued on the current stream."""
        dst.copy_(src, non_blocking=True)

    def copy_out(self, dst: Tensor, src: Tensor) -> None:
        """Pinned host ``dst`` <- device tensor ``src``, queued on the current stream."""
        dst.copy_(src, non_blocking=True)

    def record(self):
        """An event at this point of the current stream (None when emulated)."""
        if self.emulated:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event) -> None:
        """The host waits for ``event`` (:meth:`record`); counted in :attr:`waits`."""
        self.waits += 1
        if event is not None:
            event.synchronize()

    def host_func(self, fn: int, arg: int, dep: Tensor) -> None:
        """Queue the C host function ``fn(arg)`` (``void (*)(void*)``) on the current stream,
        after the work before it and before the work after it: CUDA's ``cudaLaunchHostFunc``
        (a node of a graph being captured); on the emulated device the ``powerpy::host_call``
        op, which the emulated graph replays in order. ``dep``: the buffer it reads or writes."""
        if self.emulated:
            host_call(dep, fn, arg)
            return
        stream = torch.cuda.current_stream(self.device).cuda_stream
        err = _cudart().cudaLaunchHostFunc(
            ctypes.c_void_p(stream), ctypes.c_void_p(fn), ctypes.c_void_p(arg)
        )
        if err:
            raise RuntimeError(f"cudaLaunchHostFunc failed (cudaError {err})")

    # --- overlap
    @contextlib.contextmanager
    def side_stream(self, *inputs: Tensor | None) -> Iterator[None]:
        """Queue the enclosed device work on the side stream (CUDA) so the host goes on;
        ``inputs``, made on the main stream, stay allocated until the side stream is done."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in inputs:
            if t is not None and t.device == self.device:
                t.record_stream(self._stream)
        with torch.cuda.stream(self._stream):
            yield

    def join(self, *outputs: Tensor) -> None:
        """Make the main stream wait for the side stream's work (no host wait); ``outputs``,
        made on the side stream, are then used on the main stream."""
        if self._stream is None:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_stream(self._stream)
        for t in outputs:
            t.record_stream(main)

    # --- staging buffers and events (FakeCuda overrides these)
    def _staging(self, t: Tensor) -> tuple[list, Tensor]:
        """The next pinned host buffer for ``t`` (a ring per dtype and power-of-two size, so
        prompts of any length reuse a few buffers), once its last copy is done: (its slot
        [flat buffer, event], a view of ``t``'s shape)."""
        n = max(t.numel(), 1)
        key = (t.dtype, 1 << (n - 1).bit_length())
        ring = self._rings.setdefault(key, [])
        turn = self._turn.get(key, 0)
        self._turn[key] = (turn + 1) % RING
        if turn == len(ring):
            ring.append([self._pinned_empty(key[1], t.dtype), None])
        slot = ring[turn]
        if slot[1] is not None:
            slot[1].synchronize()  # a copy RING uses old: long done
        return slot, slot[0][: t.numel()].view(t.shape)

    def _pinned_empty(self, n: int, dtype: torch.dtype) -> Tensor:
        with torch.inference_mode(False):
            return torch.empty(n, dtype=dtype, pin_memory=True)

    def _h2d(self, buf: Tensor) -> Tensor:
        return buf.to(self.device, non_blocking=True)

    def _d2h(self, t: Tensor, buf: Tensor) -> None:
        buf.copy_(t, non_blocking=True)

    def _record(self, slot: list) -> None:
        """Mark the end of the copy through ``slot``, queued on the current stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        slot[1] = event

    def _wait(self, slot: list) -> None:
        """The host waits for the copy through ``slot`` (and all the stream queued before)."""
        self.waits += 1
        slot[1].synchronize()


_CUDART: list = []


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch loaded (for ``cudaLaunchHostFunc``, which torch does not
    wrap): the ``libcudart`` mapped into this process, else the one the linker finds."""
    if not _CUDART:
        torch.cuda.init()
        path = None
        with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
            path = next((ln.split()[-1] for ln in maps if "libcudart.so" in ln), None)
        path = path or ctypes.util.find_library("cudart")
        if path is None:
            raise RuntimeError("no CUDA runtime library (libcudart) is loaded or installed")
        lib = ctypes.CDLL(path)
        lib.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaLaunchHostFunc.restype = ctypes.c_int
        _CUDART.append(lib)
    return _CUDART[0]


def move(accel: Accelerator | None, t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device`` through ``accel`` (a CPU-only model has none and needs no moves)."""
    if t.device == device:
        return t
    assert accel is not None, (t.device, device)
    return accel.move(t, device)


class OnDevices:
    """A tensor used on several devices in one step: ``on(device)`` moves it there once, and
    later calls reuse that copy (an activation read by matrices placed on different devices,
    the rotations of every device's RoPE)."""

    def __init__(self, accel: Accelerator | None, t: Tensor) -> None:
        self.tensor = t  # where it was made
        self._accel = accel
        self._at = {t.device: t}

    def __call__(self, device: torch.device) -> Tensor:
        if device not in self._at:
            self._at[device] = move(self._accel, self.tensor, device)
        return self._at[device]


# ------------------------------------------------------------- the emulated stream's host call
@torch.library.custom_op("powerpy::host_call", mutates_args=("dep",))
def host_call(dep: Tensor, fn: int, arg: int) -> None:
    """Call the C host function ``fn(arg)`` in the emulated stream's order; ``dep`` is the
    buffer it reads or writes (so that the op is ordered with the copies around it)."""
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)(arg)


@host_call.register_fake
def _(dep, fn, arg):
    return None
