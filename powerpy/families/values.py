"""Values of GGUF keys as the hyperparameters take them, shared by ``powerpy.config`` and the
families: one number, a list of layers or of floats, and the layers a sliding window applies
to. Each refuses anything else with a ``ModelConfigError`` naming the file and the key."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from powerpy.errors import ModelConfigError, shown
from powerpy.families.base import Family
from powerpy.formats.constants import Keys


def windowed_layers(
    kv: Mapping[str, Any], fam: Family, n_layer: int, source: str
) -> tuple[int, ...]:
    """The layers of a file with a sliding window that use it, as llama.cpp picks them: the
    file's ``attention.sliding_window_pattern``, a period n (layer l iff n is 0 or
    l % n < n - 1) or a flag per layer (nonzero: windowed; layers beyond the flags are not),
    else the family's period.

    Raises:
        ModelConfigError: a pattern that is neither; the message names the source and the key.
    """
    key = Keys.SLIDING_WINDOW_PATTERN.format(arch=fam.arch)
    value = fam.swa_pattern
    if key in kv:
        value = kv[key]
    if hasattr(value, "__len__") and not isinstance(value, (str, bytes, Mapping)):
        flags = [f.item() if hasattr(f, "item") else f for f in value]  # numpy scalars
        if not all(isinstance(f, numbers.Integral) for f in flags):
            raise ModelConfigError(
                f"{source}: {key} must be a period or one flag per layer (booleans or integers), "
                f"got {shown(value)}; fix or remove the key"
            )
        return tuple(l for l, f in enumerate(flags[:n_layer]) if f)
    n = scalar(value, key, int, source)
    if not 0 <= n < 2**32:
        raise ModelConfigError(
            f"{source}: {key} is {n}, it must be a period between 0 and 2^32 - 1 (0: every layer "
            "is windowed); fix or remove the key"
        )
    return tuple(l for l in range(n_layer) if not n or l % n < n - 1)


def layer_list(value: Any, key: str, source: str, n_layer: int | None = None) -> tuple[int, ...]:
    """A key's array of distinct layer numbers (below ``n_layer`` when given), sorted.

    Raises:
        ModelConfigError: anything else; the message names the source and the key.
    """
    seq = hasattr(value, "__len__") and not isinstance(value, (str, bytes, Mapping))
    items = list(value) if seq else None  # a list, or the reader's numpy array
    top = n_layer if n_layer is not None else float("inf")
    ok = items is not None and all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and 0 <= v < top for v in items
    )
    if not ok or len(set(items)) != len(items):
        below = f" below {n_layer}" if n_layer is not None else ""
        raise ModelConfigError(
            f"{source}: {key} must be an array of distinct layer numbers{below}, got {shown(value)}"
        )
    return tuple(sorted(int(v) for v in items))


def float_list(value: Any, key: str, source: str, n: int | None = None) -> tuple[float, ...]:
    """A key's array of numbers as floats; with ``n``, exactly n finite values >= 0 (one per
    layer).

    Raises:
        ModelConfigError: anything else; the message names the source and the key.
    """
    seq = hasattr(value, "__len__") and not isinstance(value, (str, bytes, Mapping))
    items = list(value) if seq else None  # a list, or the reader's numpy array
    if items is None or not all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) for v in items
    ):
        raise ModelConfigError(f"{source}: {key} must be an array of numbers, got {shown(value)}")
    out = tuple(float(v) for v in items)
    if n is not None and (len(out) != n or not all(0 <= t < math.inf for t in out)):
        raise ModelConfigError(
            f"{source}: {key} must hold {n} finite values >= 0 (one per layer), found "
            f"{len(out)}: {list(out)[:4]}; fix the values or remove the key"
        )
    return out


def scalar(v: Any, key: str, kind: type, source: str) -> Any:
    """``v`` as one int (or finite-or-not float, or a bool for ``kind`` bool), refusing
    arrays, strings and bools where a number belongs, by name."""
    if isinstance(v, (list, tuple)) and len(v) == 1:
        v = v[0]
    if kind is bool:
        if isinstance(v, (bool, np.bool_)):
            return bool(v)
        raise ModelConfigError(
            f"{source}: key {key!r} must be a BOOL, got {shown(v)} ({type(v).__name__}); the "
            "file is corrupt: re-convert the model"
        )
    ok = isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
    if ok and kind is int:
        ok = float(v).is_integer() and abs(v) < 2**63
    if not ok:
        raise ModelConfigError(
            f"{source}: key {key!r} must be one {'integer' if kind is int else 'number'}, got "
            f"{shown(v)} ({type(v).__name__}); the file is corrupt: re-convert the model"
        )
    return kind(v)
