"""The numerics of one forward call: native kernels or torch, llama.cpp's rounding or exact f32.

A call carries them as ``RunOptions.numerics`` (:class:`powerpy.model.options.RunOptions`), a
:class:`Numerics` (``native=...``, ``quantized_activations=...``). ``Model.forward`` installs
the call's :class:`Numerics` for its own duration (:func:`using`), and the weights' methods and
the llama.cpp float steps read them with :func:`current`. The state lives in a ``ContextVar``,
as torch's autocast state is thread-local: two sessions sharing one model, on one thread or
several, each compute with their own numerics, and nothing is set for the process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Numerics:
    """How a call computes.

    Attributes:
        native: use the native CPU kernels where they apply (False: torch code paths only).
        quantized_activations: quantized matmuls round their activations as llama.cpp does
            (ggml's ``vec_dot_type``: Q8_0 blocks for Q8_0/Q4_0/Q5_0, Q8_1 for Q4_1/Q5_1, Q8_K
            for K-quants) and take integer block dot products, and llama.cpp's float steps run
            (ggml's exp, RMSNorm, RoPE angles and f16-cache attention,
            ``powerpy.model.ggml_numerics``). False (``--exact-activations``): activations stay
            f32, RoPE angles are float64 and attention is torch's.
    """

    native: bool = True
    quantized_activations: bool = True


DEFAULT = Numerics()
_current: ContextVar[Numerics] = ContextVar("powerpy_numerics", default=DEFAULT)


def current() -> Numerics:
    """The numerics of the running call (the defaults outside one)."""
    return _current.get()


@contextmanager
def using(numerics: Numerics) -> Iterator[Numerics]:
    """Compute with ``numerics`` inside the block (this thread or task only), then restore."""
    token = _current.set(numerics)
    try:
        yield numerics
    finally:
        _current.reset(token)
