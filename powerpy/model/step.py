"""What one forward runs (``Step``): its tokens in segments, one per session, each at its cache's
next positions; for a pooled decode step, the device tensors a plan fixes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from powerpy.model.cache import KVCache
from powerpy.model.device import Accelerator, move


@dataclass
class Step:
    """What one forward runs: T tokens in segments, each segment consecutive tokens of one
    session at its cache's next positions. One sequence (a prompt chunk or a decode step) is one
    segment; a server's decode step is B one-token segments, one per session.

    A decode step whose caches are ranges of one device pool (``cache.py``) is *pooled*: its
    attention reads each session's position and first pool row as data on the device (``pos``
    and ``base``, a plan's fixed buffers or sent by :meth:`rows`), and ``tables`` (set by a plan)
    are each layer's RoPE of every position on the device, ``cold`` the tasks of the layers with
    FFN rows on the host."""

    caches: list[KVCache]
    lengths: list[int]  # tokens of each segment, in order (sum: T)
    pos: Tensor | None = None  # (B,) int64 on the device: each session's position
    base: Tensor | None = None  # (B,) int64 on the device: each cache's first pool row
    tables: list[Tensor | None] | None = None  # per layer (positions, n_rot/2, 2) f32 (cos, sin)
    cold: object | None = None  # a plan's host_tasks.ColdTasks: host rows as stream tasks

    def positions(self) -> Tensor:
        """(T,) int64: each token's position in its own cache."""
        return torch.cat(
            [torch.arange(c.pos, c.pos + n) for c, n in zip(self.caches, self.lengths, strict=True)]
        )

    @property
    def pooled(self) -> bool:
        """One token per session, every cache in one device pool."""
        pool = self.caches[0].pool
        return (
            pool is not None
            and all(n == 1 for n in self.lengths)
            and all(c.pool is pool for c in self.caches)
        )

    def rows(self, accel: Accelerator | None) -> tuple[Tensor, Tensor]:
        """(pos, base) of a pooled step on the device, each (B,) int64 (sent once per step)."""
        if self.pos is None:
            dev = self.caches[0].device
            self.pos = move(accel, torch.tensor([c.pos for c in self.caches]), dev)
            self.base = move(accel, torch.tensor([c.base for c in self.caches]), dev)
        return self.pos, self.base

    def segments(self):
        """(cache, first token, tokens) per segment."""
        s = 0
        for c, n in zip(self.caches, self.lengths, strict=True):
            yield c, s, n
            s += n

    def advance(self) -> None:
        for c, n in zip(self.caches, self.lengths, strict=True):
            c.pos += n
