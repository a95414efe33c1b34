"""The KV cache: per-layer keys and values. It lives where its tensors are (host or device)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from powerpy.config import ModelArgs
from powerpy.model.device import Accelerator


@dataclass(frozen=True)
class KVPlacement:
    """Where a placement puts new caches: on the accelerator, while the live device caches
    hold at most ``max_ctx`` positions together (``serve --parallel N`` reserves N caches'
    worth)."""

    dtype: torch.dtype  # f16 or f32
    max_ctx: int
    live: weakref.WeakSet = field(default_factory=weakref.WeakSet, compare=False, repr=False)

    def in_use(self) -> int:
        """Positions of the live caches placed so far (a dropped cache gives its back)."""
        return sum(c.n_ctx for c in self.live)


class KVCache:
    """Per-layer keys and values for ``n_ctx`` positions.

    Attributes:
        k, v: ``(n_layer, n_ctx, n_head_kv, head_dim)`` on the host, or on ``accel``'s device.
        pos: positions filled so far.
    """

    def __init__(
        self,
        args: ModelArgs,
        n_ctx: int,
        dtype: torch.dtype = torch.float32,
        accel: Accelerator | None = None,
    ) -> None:
        shape = (args.n_layer, n_ctx, args.n_head_kv, args.head_dim)
        if accel is None:
            self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        else:
            self.k, self.v = accel.zeros(*shape, dtype=dtype), accel.zeros(*shape, dtype=dtype)
        self.n_ctx = n_ctx
        self.pos = 0

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def reset(self) -> None:
        self.pos = 0
