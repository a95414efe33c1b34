"""A step captured once and replayed: a CUDA graph, or its emulation on the CPU.

``StepGraph.capture(accel, body)`` runs ``body`` (a function of fixed buffers: it reads its
inputs from tensors the caller fills and writes its outputs into others) under capture and
returns a graph whose ``replay()`` repeats every device operation of it, with no Python:

- **cuda**: ``torch.cuda.CUDAGraph``, after two warm-up runs on a side stream (Triton compiles,
  cuBLAS makes its handles), in one memory pool shared by every graph of the process.
- **emulated** (the CPU standing in for a device, ``Accelerator("cpu")``): every ATen and
  custom op the body runs is recorded with its tensors, and ``replay()`` runs them again in order,
  writing each result into the tensor the capture made. What a CUDA graph would miss, the
  emulation misses too: a value the body computed in Python, a branch it took on data, a native
  call outside the dispatcher (they are frozen at capture). So a step whose replay equals its
  eager run on the emulated device is one a CUDA graph can replay (``tests/test_plan.py``), and
  ops that make the host wait on the data (``nonzero``, ``item``) are refused during capture, as
  CUDA refuses them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from powerpy.errors import PowerpyError

log = logging.getLogger(__name__)

# ops whose output depends on data the host must read: no graph can hold them
HOST_SYNC_OPS = frozenset(
    {
        "nonzero",
        "_local_scalar_dense",
        "item",
        "masked_select",
        "unique",
        "_unique2",
        "unique_consecutive",
        "repeat_interleave",
        "bincount",
        "argwhere",
    }
)


class CaptureError(PowerpyError):
    """A step cannot be captured as a graph (the message says why)."""


class StepGraph:
    """A captured step: :meth:`replay` repeats it."""

    def replay(self) -> None:
        raise NotImplementedError

    @staticmethod
    def capture(
        kind: str,
        body: Callable[[], None],
        device: torch.device,
        after: Callable[[], None] | None = None,
    ) -> StepGraph:
        """Capture ``body`` on a device of ``kind`` ("cuda" or "emulated"). ``after``: called
        after each run of ``body`` that is not the capture's (CUDA's warm-ups; a decode
        plan serves the host tasks such a run submitted), even when it raised.

        Raises:
            CaptureError: the body cannot be captured (why, in one line).
        """
        if kind == "cuda":
            return CudaStepGraph(body, device, after)
        if kind == "emulated":
            return EmulatedStepGraph(body)
        raise CaptureError(f"no graphs on this device ({kind})")


_pool = None  # the memory pool of every CUDA graph of the process


class CudaStepGraph(StepGraph):
    def __init__(
        self, body: Callable[[], None], device: torch.device, after: Callable[[], None] | None
    ) -> None:
        global _pool
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile, make handles and workspaces, outside the capture
                    try:
                        body()
                    finally:
                        if after is not None:
                            after()
            torch.cuda.current_stream(device).wait_stream(side)
            if _pool is None:
                _pool = torch.cuda.graph_pool_handle()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=_pool, capture_error_mode="thread_local"):
                body()
        except Exception as e:  # any failure of the capture: the caller runs eagerly
            first = str(e).splitlines()[0] if str(e) else ""
            raise CaptureError(f"{type(e).__name__}: {first}") from e

    def replay(self) -> None:
        self.graph.replay()


class _Recorder(TorchDispatchMode):
    """Records every op with its arguments and results (refusing host syncs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_SYNC_OPS:
            raise CaptureError(f"{name} makes the host wait on the data: no graph can hold it")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class EmulatedStepGraph(StepGraph):
    """A CUDA graph's semantics on the CPU: the ops of one run, replayed into the same
    tensors."""

    def __init__(self, body: Callable[[], None]) -> None:
        rec = _Recorder()
        with rec:
            body()
        self.ops = rec.ops

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for was, now in zip(tree_flatten(out)[0], tree_flatten(new)[0], strict=True):
                if isinstance(was, Tensor) and isinstance(now, Tensor) and not _same(was, now):
                    was.copy_(now)


def _same(a: Tensor, b: Tensor) -> bool:
    """Two views of one memory (an in-place op's result, a view op's)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
