"""Per-phase wall-clock accounting for benchmarks (off unless a PhaseTimer is attached)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext


class PhaseTimer:
    """Accumulates seconds per named phase: ``with timer("attention"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Add seconds measured elsewhere (the native decode's phase clock) to a phase."""
        self.seconds[name] += seconds

    def reset(self) -> None:
        self.seconds.clear()


_NULL = nullcontext()


def phase(timer: PhaseTimer | None, name: str) -> AbstractContextManager[None]:
    """``timer(name)`` when timing, else a shared no-op context."""
    return _NULL if timer is None else timer(name)
