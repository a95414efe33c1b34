"""Activation statistics: ``activation/activation_{i}.pt``, one 1-D tensor of n_ff per layer.

Format: ``docs/formats.md#activation-statistics`` (a ``torch.save`` of a 1-D tensor of
per-neuron activation counts or frequencies; the file naming and upstream's ordering bug #247).

powerpy pairs files with layers by the **number** in the name and requires exactly
``activation_0.pt … activation_{n_layer-1}.pt``. Files are read with
``torch.load(weights_only=True)``, so a pickle that would run code is refused.

This module imports torch (at import time); the solver package stays torch-free by receiving
the numpy arrays returned here.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from powerpy._fs import atomic_write
from powerpy.errors import StatsError

logger = logging.getLogger(__name__)

__all__ = [
    "ACTIVATION_FILE_RE",
    "activation_file_name",
    "find_activation_files",
    "lexicographic_pairing",
    "load_activation_stats",
    "load_stats_file",
    "save_activation_stats",
]

ACTIVATION_FILE_RE = re.compile(r"activation_(\d+)\.pt")  # full match only
_MAX_LISTED = 8  # names listed in an error message before "and N more"


def activation_file_name(layer: int) -> str:
    """``activation_{layer}.pt``."""
    return f"activation_{layer}.pt"


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def find_activation_files(directory: str | os.PathLike[str], n_layer: int) -> list[Path]:
    """The statistics files of a model, in layer (numeric) order.

    Names must full-match ``activation_(\\d+)\\.pt``; other names (``activation_3.pt.bak``,
    temporary files) are ignored. The numbers must be exactly ``0 … n_layer-1``.

    Args:
        directory: the activation directory.
        n_layer: the model's layer count.

    Returns:
        ``n_layer`` paths; entry ``i`` is ``activation_{i}.pt``.

    Raises:
        FileNotFoundError: the directory does not exist.
        StatsError: the path is not a directory, files are missing for some layers, extra
            layer numbers, or two names for one layer (``activation_1.pt`` and
            ``activation_01.pt``); the message names them.
    """
    d = Path(directory)
    if not d.exists():
        raise FileNotFoundError(
            f"activation directory {d} does not exist (expected activation_0.pt … "
            f"activation_{n_layer - 1}.pt there); pass --activation DIR"
        )
    if not d.is_dir():
        raise StatsError(f"activation directory {d} is not a directory")
    by_layer: dict[int, list[str]] = {}
    for entry in d.iterdir():
        m = ACTIVATION_FILE_RE.fullmatch(entry.name)
        if m and entry.is_file():
            by_layer.setdefault(int(m.group(1)), []).append(entry.name)
    dup = sorted(n for names in by_layer.values() if len(names) > 1 for n in names)
    if dup:
        raise StatsError(f"{d}: several files name the same layer: {_listing(dup)}")
    missing = [activation_file_name(i) for i in range(n_layer) if i not in by_layer]
    extra = [by_layer[i][0] for i in sorted(by_layer) if i >= n_layer]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_listing(missing)}")
        if extra:
            parts.append(f"unexpected {_listing(extra)}")
        raise StatsError(
            f"{d}: activation statistics do not match the {n_layer}-layer model "
            f"(need activation_0.pt … activation_{n_layer - 1}.pt): {'; '.join(parts)}"
        )
    return [d / by_layer[i][0] for i in range(n_layer)]


def lexicographic_pairing(n_layer: int) -> list[int]:
    """Which file upstream's exporter pairs with each layer (bug #247).

    Upstream sorts the file names as strings and gives layer ``j`` the ``j``-th name, so for 32
    layers the order is 0, 1, 10 … 19, 2, 20 … 29, 3, 30, 31, 4 … 9.

    Args:
        n_layer: layer count.

    Returns:
        ``pairing[j]`` = the number of the file whose statistics upstream exports for layer j.
    """
    names = sorted(activation_file_name(i) for i in range(n_layer))
    return [int(ACTIVATION_FILE_RE.fullmatch(n).group(1)) for n in names]  # type: ignore[union-attr]


def load_stats_file(path: str | os.PathLike[str], n_ff: int) -> npt.NDArray[np.generic]:
    """Read one ``activation_{i}.pt`` safely and check it.

    Args:
        path: the file.
        n_ff: expected length.

    Returns:
        A 1-D numpy array of length ``n_ff`` (the file's dtype; bfloat16 becomes float32, bool
        becomes int32).

    Raises:
        StatsError: the file is not a plain tensor (an unsafe or foreign pickle is refused), is
            not 1-D of length ``n_ff``, or holds a value that is not finite or is negative; the
            message names the file and the value.
    """
    p = Path(path)
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights only" in str(e).lower() or "weights_only" in str(e):
            raise StatsError(
                f"{p}: refused to load: it is not a plain tensor file and loading it would "
                f"unpickle arbitrary objects ({first}); re-save it with torch.save(tensor)"
            ) from None
        raise StatsError(f"{p}: not a torch.save file ({first})") from None
    except MemoryError:
        raise
    except Exception as e:  # any other pickle, zip or storage error: a corrupt file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise StatsError(
            f"{p}: cannot read activation statistics ({type(e).__name__}: {first[:200]}); "
            "re-save it with torch.save(tensor) or regenerate it with `powerpy profile`"
        ) from None
    if not isinstance(obj, torch.Tensor):
        raise StatsError(
            f"{p}: expected a 1-D tensor of {n_ff} activation counts, got {type(obj).__name__}"
        )
    t = obj.detach()
    kind = _unusual_kind(t)
    if kind:
        raise StatsError(
            f"{p}: holds a {kind} tensor; statistics must be a dense 1-D tensor of {n_ff} "
            "numbers: re-save it with torch.save(t.to_dense().float().cpu())"
        )
    if t.dim() != 1:
        raise StatsError(f"{p}: expected a 1-D tensor of {n_ff} values, got shape {tuple(t.shape)}")
    if t.numel() != n_ff:
        raise StatsError(f"{p}: holds {t.numel()} values but the model's n_ff is {n_ff}")
    if t.is_complex():
        raise StatsError(f"{p}: complex statistics ({t.dtype}) are not supported")
    if t.dtype == torch.bfloat16:
        t = t.float()  # numpy has no bfloat16; exact widening keeps the order
    elif t.dtype == torch.bool:
        t = t.int()
    try:
        arr = t.cpu().numpy().copy()
    except (TypeError, RuntimeError) as e:
        raise StatsError(f"{p}: statistics of dtype {t.dtype} are not supported ({e})") from None
    if arr.dtype.kind not in "iuf":
        raise StatsError(f"{p}: statistics of dtype {t.dtype} are not numbers")
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            j = int(bad[0])
            raise StatsError(f"{p}: value {arr[j]} at neuron {j} is not finite")
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        j = int(neg[0])
        raise StatsError(
            f"{p}: value {arr[j]} at neuron {j} is negative (statistics are activation counts "
            f"or frequencies)"
        )
    return arr


def _unusual_kind(t: torch.Tensor) -> str | None:
    """What makes ``t`` other than a dense tensor with data on the host, or None."""
    if t.is_nested:
        return "nested"
    if t.layout != torch.strided:
        return f"sparse ({t.layout})"
    if t.is_quantized:
        return f"quantized ({t.dtype})"
    if t.is_meta or t.device.type != "cpu":
        return f"{t.device.type} (data-less or off-host)"
    return None


def load_activation_stats(
    directory: str | os.PathLike[str],
    n_layer: int,
    n_ff: int,
    *,
    compat_lexicographic: bool = False,
) -> list[npt.NDArray[np.generic]]:
    """Load the per-layer activation statistics of a model.

    Args:
        directory: the directory holding ``activation_{i}.pt``.
        n_layer: the model's layer count; exactly ``0 … n_layer-1`` must be present.
        n_ff: neurons per layer; every file must hold that many values.
        compat_lexicographic: reproduce upstream bug #247: entry ``j`` is the statistics
            of the ``j``-th file in **string** order (layer 2 gets ``activation_10`` when
            ``n_layer >= 11``). Use it only for the **export** step (which neurons of a layer
            go to the GPU), to compare bytes with indexes upstream generated; the per-layer
            **counts** must still come from the numeric order, as upstream's solver loads by
            index. Off by default: numeric order is the correct pairing.

    Returns:
        ``n_layer`` 1-D arrays of length ``n_ff`` (see :func:`load_stats_file`).

    Raises:
        FileNotFoundError: the directory does not exist (the message names it).
        StatsError: missing, extra or malformed files (the message names them and the values).
    """
    paths = find_activation_files(directory, n_layer)
    stats = [load_stats_file(p, n_ff) for p in paths]
    logger.debug("loaded %d activation files from %s", len(stats), directory)
    if compat_lexicographic:
        return [stats[k] for k in lexicographic_pairing(n_layer)]
    return stats


def save_activation_stats(
    directory: str | os.PathLike[str], stats: Sequence[npt.ArrayLike | torch.Tensor]
) -> list[Path]:
    """Write ``activation_{i}.pt`` for each layer, each file atomically.

    Each tensor goes to a temporary file in the same directory (a name the loader ignores) that
    then replaces the target (``powerpy._fs.atomic_write``). Files of other layers already in the
    directory are left alone, so write into a fresh directory when the layer count changes.

    Args:
        directory: created if missing.
        stats: one 1-D array or tensor per layer (counts or frequencies, non-negative).

    Returns:
        The written paths in layer order.

    Raises:
        ValueError: an entry is not 1-D.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for i, s in enumerate(stats):
        t = s.detach().cpu() if isinstance(s, torch.Tensor) else torch.from_numpy(np.asarray(s))
        if t.dim() != 1:
            raise ValueError(f"layer {i}: statistics must be 1-D, got shape {tuple(t.shape)}")
        target = d / activation_file_name(i)
        with atomic_write(target) as tmp:
            torch.save(t.contiguous().clone(), tmp)
        out.append(target)
    logger.debug("wrote %d activation files to %s", len(out), d)
    return out
