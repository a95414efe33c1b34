"""The KV cache: per-layer keys and values. It lives where its tensors are (host or device).

Host caches are tensors of their own. Device caches are ranges of one pool per placement
(:class:`KVPlacement`), so a decode step of any sessions reads one pair of tensors at fixed
addresses, with each session's first row (``KVCache.base``) and length as data: what a
captured CUDA graph needs (``powerpy.model.plan``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from powerpy.config import ModelArgs
from powerpy.model.device import Accelerator


def _kv_tensors(
    args: ModelArgs, rows: int, dtype: torch.dtype, accel: Accelerator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed keys and values ``(n_layer, rows, n_head_kv, head_dim)`` on the host (``accel``
    None) or the accelerator. A latent cache (DeepSeek-2's MLA) is one tensor: its values are a
    view of the keys' first ``kv_lora_rank`` dims."""
    shape = (args.n_layer, rows, args.n_head_kv, args.head_dim)

    def zeros() -> torch.Tensor:
        if accel is None:
            return torch.zeros(shape, dtype=dtype)
        return accel.zeros(*shape, dtype=dtype)

    k = zeros()
    return k, (k.narrow(-1, 0, args.kv_lora_rank) if args.kv_lora_rank else zeros())


class KVCache:
    """Per-layer keys and values for ``n_ctx`` positions.

    Attributes:
        k, v: ``(n_layer, n_ctx, n_head_kv, head_dim)`` on the host, or on the device: then a
            view of rows ``base .. base + n_ctx`` of its placement's pool. A latent cache (MLA)
            has one head of the latent and RoPE dims in k, and v is a view of its first
            ``kv_lora_rank`` dims.
        pos: positions filled so far.
        base: the cache's first row in its pool (0 for a cache of its own).
        pool: the pool's ``(k, v)``, each ``(n_layer, rows, n_head_kv, head_dim)``, or None.
    """

    def __init__(
        self,
        args: ModelArgs,
        n_ctx: int,
        dtype: torch.dtype = torch.float32,
        accel: Accelerator | None = None,
    ) -> None:
        self.k, self.v = _kv_tensors(args, n_ctx, dtype, accel)
        self.n_ctx = n_ctx
        self.pos = 0
        self.base = 0
        self.pool: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def in_pool(cls, pool: tuple[torch.Tensor, torch.Tensor], base: int, n_ctx: int) -> KVCache:
        """The cache of pool rows ``base .. base + n_ctx``."""
        c = cls.__new__(cls)
        c.k, c.v = (t.narrow(1, base, n_ctx) for t in pool)
        c.n_ctx, c.pos, c.base, c.pool = n_ctx, 0, base, pool
        return c

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def latent(self) -> bool:
        """A latent cache (MLA): the values are a view of the keys' first dims, one tensor."""
        return self.v.data_ptr() == self.k.data_ptr()

    @property
    def nbytes(self) -> int:
        return (1 if self.latent else 2) * self.k.numel() * self.k.element_size()

    def reset(self) -> None:
        self.pos = 0


@dataclass
class KVPlacement:
    """Where a placement puts new caches: ranges of one device pool of ``max_ctx`` positions,
    which the live caches share (``serve --parallel N`` reserves N caches' worth).

    The pool is allocated with the first cache, with one row more: the scratch row that a
    padded batch's unused entries write to and read (``scratch``). A cache's range returns to
    the pool when the cache is dropped.
    """

    dtype: torch.dtype  # f16 or f32
    max_ctx: int
    _pool: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _free: list[tuple[int, int]] = field(default_factory=list, repr=False)  # (start, length)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._free = [(0, self.max_ctx)]

    @property
    def scratch(self) -> int:
        """The pool row no cache owns."""
        return self.max_ctx

    def in_use(self) -> int:
        """Positions of the live caches placed so far (a dropped cache gives its back)."""
        return self.max_ctx - sum(n for _, n in self._free)

    def allocate(self, args: ModelArgs, n_ctx: int, accel: Accelerator) -> KVCache | None:
        """A device cache of ``n_ctx`` positions, or None when no free range is that long."""
        with self._lock:
            at = next((i for i, (_, n) in enumerate(self._free) if n >= n_ctx), None)
            if at is None:
                return None
            start, n = self._free[at]
            self._free[at] = (start + n_ctx, n - n_ctx)
            self._free = [r for r in self._free if r[1]]
            if self._pool is None:
                self._pool = _kv_tensors(args, self.max_ctx + 1, self.dtype, accel)
        cache = KVCache.in_pool(self._pool, start, n_ctx)
        weakref.finalize(cache, self._release, start, n_ctx)
        return cache

    def _release(self, start: int, n: int) -> None:
        with self._lock:
            free = sorted([*self._free, (start, n)])
            merged: list[tuple[int, int]] = []
            for s, m in free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + m)
                else:
                    merged.append((s, m))
            self._free = merged
