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
import logging
from collections.abc import Iterator

import torch
from torch import Tensor

log = logging.getLogger(__name__)

NO_CUDA_MESSAGE = "no CUDA GPU found: running everything on the CPU"
_said_no_cuda = False

HOST = torch.device("cpu")


class Accelerator:
    """One accelerator device and how to reach it.

    Attributes:
        device: the device (``cpu`` when emulated).
        gather_hot: decode gathers only the active hot rows. That needs ``nonzero``, a host
            sync on a GPU, so it is used only where the "device" is the CPU itself (there it
            reads fewer bytes: 1.5-6x faster than the masked dense pass). On CUDA the hot part
            is one masked dense pass with no host round trip.
    """

    def __init__(self, device: torch.device | str, *, gather_hot: bool | None = None) -> None:
        self.device = torch.device(device)
        self.gather_hot = self.device.type == "cpu" if gather_hot is None else gather_hot
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __repr__(self) -> str:
        return f"Accelerator({self.device}{', emulated' if self.emulated else ''})"

    @property
    def emulated(self) -> bool:
        """The accelerator is the CPU itself (for tests and demos)."""
        return self.device.type == "cpu"

    # --- choice
    @staticmethod
    def choose(device: str | torch.device | None = None) -> Accelerator | None:
        """The accelerator to place on: ``device`` as given, or CUDA when available, else None.

        Args:
            device: ``"cuda"``, ``"cuda:1"``, ``"cpu"`` (emulated) or None (auto).

        Returns:
            None when ``device`` is None and there is no CUDA GPU (logged once per process).

        Raises:
            ValueError: a CUDA device was asked for but none is available, or an unknown device.
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
            index = torch.cuda.current_device() if dev.index is None else dev.index
            return Accelerator(torch.device("cuda", index))
        if dev.type != "cpu":
            raise ValueError(f"unsupported accelerator {device!r}: use 'cuda[:N]' or 'cpu'")
        return Accelerator(dev)

    def free_memory(self) -> int | None:
        """Free bytes on the device (CUDA), or None where the notion does not apply."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(self.device)[0])

    # --- transfers and allocation
    def to_device(self, t: Tensor) -> Tensor:
        """A copy of host tensor ``t`` on the device (``t`` itself when emulated)."""
        return t.to(self.device)

    def to_host(self, t: Tensor) -> Tensor:
        """Device tensor ``t`` on the host (a device-to-host copy: it waits for ``t``)."""
        return t.to(HOST)

    def move(self, t: Tensor, device: torch.device) -> Tensor:
        """``t`` on ``device`` (the host or this accelerator); no copy when it is there."""
        if t.device == device:
            return t
        return self.to_host(t) if device.type == "cpu" else self.to_device(t)

    def zeros(self, *shape: int, dtype: torch.dtype) -> Tensor:
        """A zero-filled tensor allocated on the device."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    # --- overlap
    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        """Queue the enclosed device work on a side stream (CUDA) so the host goes on."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def join(self) -> None:
        """Make the main stream wait for the side stream's work."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)


def move(accel: Accelerator | None, t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device`` through ``accel`` (a CPU-only model has none and needs no moves)."""
    if t.device == device:
        return t
    assert accel is not None, (t.device, device)
    return accel.move(t, device)
