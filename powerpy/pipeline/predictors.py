"""The predictor directory (docs/formats.md#predictor-directory): ``model_{l}.pt`` per layer,
``config.json``, and the int8 pack that ships predictors inside the package. Its reader (for
``convert``) and its writer (for ``train``) live here together.

``model_{l}.pt`` is a state dict of exactly ``fc1.weight`` (H, n_embd) and ``fc2.weight``
(n_ff, H), loaded with ``weights_only=True``. ``config.json`` may hold ``sparse_threshold``
(PowerInfer reads it) and ``sparse_activation`` ("silu" marks a magnitude-sparsified model).
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from powerpy._fs import atomic_write, read_json
from powerpy.config import ACTIVATIONS, float_list, layer_list

PREDICTOR_FILE = "model_{l}.pt"
PREDICTOR_FILE_RE = re.compile(r"model_(\d+)\.pt")
PREDICTOR_CONFIG = "config.json"
STATS_SUBDIR = "activation"
CONFIG_THRESHOLD = "sparse_threshold"  # read by PowerInfer's convert.py
CONFIG_ACTIVATION = "sparse_activation"  # powerpy: "silu" marks a magnitude-sparsified model
PREDICTOR_KEYS = ("fc1.weight", "fc2.weight")
PACK_FILE = "predictors.q8.safetensors"


# ----------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class Predictors:
    """A validated predictor directory."""

    files: list[Path]  # model_{l}.pt in layer order
    hidden: list[int]  # H_l
    threshold: float | None  # config.json sparse_threshold
    activation: str | None  # config.json sparse_activation ("relu"/"silu")
    dense_layers: tuple[int, ...] = ()  # config.json powerpy.calibration.dense_layers
    down_thresholds: tuple[float, ...] = ()  # config.json ffn_down_threshold: per-layer cuts


def load_predictor_file(path: Path, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Load one ``model_{l}.pt`` safely (``weights_only=True``).

    Raises:
        ValueError: an unsafe pickle (refused), an unreadable file, or keys other than exactly
            ``fc1.weight`` and ``fc2.weight``; the message names the file.
    """
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"{path}: refused to load: not a plain tensor state dict, and unpickling it could run "
            f"arbitrary code ({first}); re-save it with torch.save(model.state_dict())"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, TypeError) as e:
        if mmap and "mmap" in str(e):  # legacy (non-zip) format cannot be mapped
            return load_predictor_file(path, mmap=False)
        raise ValueError(f"{path}: cannot read predictor ({e})") from None
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path}: expected a state dict of tensors, got {type(sd).__name__}")
    if sorted(sd) != sorted(PREDICTOR_KEYS):
        raise ValueError(
            f"{path}: a predictor must hold exactly fc1.weight and fc2.weight, found {sorted(sd)}"
        )
    return dict(sd)


def read_predictor_config(pred_dir: Path) -> tuple[float | None, str | None]:
    """``(sparse_threshold, sparse_activation)`` of ``PREDICTOR_DIR/config.json`` (None if absent).

    Raises:
        ValueError: invalid JSON, a threshold that is not a finite number, an unknown activation.
    """
    path = pred_dir / "config.json"
    if not path.is_file():
        return None, None
    cfg = read_json(path)
    thr = cfg.get("sparse_threshold")
    if thr is not None:
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not np.isfinite(thr):
            raise ValueError(f"{path}: sparse_threshold {thr!r} is not a finite number")
        thr = float(thr)
    act = cfg.get("sparse_activation")
    if act is not None and act not in ACTIVATIONS:
        raise ValueError(f"{path}: sparse_activation {act!r} is not one of {ACTIVATIONS}")
    return thr, act


def read_dense_layers(pred_dir: Path, n_layer: int) -> tuple[int, ...]:
    """The layers calibration left ungated (``config.json``: ``powerpy.calibration.dense_layers``,
    written by ``calibrate_predictors`` with a predictor cost), sorted; () if absent.

    Raises:
        ValueError: not a list of distinct layer numbers below ``n_layer``.
    """
    path = pred_dir / "config.json"
    if not path.is_file():
        return ()
    cal = read_json(path).get("powerpy", {}).get("calibration", {})
    layers = cal.get("dense_layers", []) if isinstance(cal, dict) else []
    return layer_list(layers, "powerpy.calibration.dense_layers", str(path), n_layer)


def read_cuts(pred_dir: Path, n_layer: int) -> tuple[float, ...]:
    """The per-layer cuts ``config.json: ffn_down_threshold`` (a computed neuron's down row is
    skipped where ``|h_j| · ‖ffn_down_t[j]‖`` is below its layer's value; the ``thresholds`` of
    a ``powerpy profile --target-sparsity Q`` run's ``profile.json`` fit here); () if absent.

    Raises:
        ValueError: not ``n_layer`` finite numbers >= 0.
    """
    path = pred_dir / "config.json"
    value = read_json(path).get("ffn_down_threshold") if path.is_file() else None
    return () if value is None else float_list(value, "ffn_down_threshold", str(path), n_layer)


def scan_predictors(pred_dir: str | os.PathLike[str], n_layer: int, n_embd: int, n_ff: int):
    """Check a predictor directory against the model's dimensions.

    Loads ``model_0.pt``, ``model_1.pt``, … up to the first missing index (memory-mapped when
    possible) and checks count and shapes.

    Args:
        pred_dir: the directory.
        n_layer, n_embd, n_ff: the model's dimensions.

    Returns:
        A ``Predictors`` record.

    Raises:
        FileNotFoundError: the directory does not exist.
        ValueError: wrong count, wrong shapes, or a refused file (message names file and numbers).
    """
    d = Path(pred_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"predictor directory {d} does not exist")
    files = []
    while (d / f"model_{len(files)}.pt").is_file():
        files.append(d / f"model_{len(files)}.pt")
    if len(files) != n_layer:
        others = sorted(p.name for p in d.iterdir() if PREDICTOR_FILE_RE.fullmatch(p.name))
        extra = f" (files: {', '.join(others[:6])}{' …' if len(others) > 6 else ''})"
        raise ValueError(
            f"{d}: found {len(files)} predictors model_0.pt … model_{len(files) - 1}.pt but the "
            f"model has {n_layer} layers{extra if others else ''}"
        )
    hidden = []
    for path in files:
        sd = load_predictor_file(path, mmap=True)
        fc1, fc2 = sd["fc1.weight"], sd["fc2.weight"]
        if fc1.dim() != 2 or fc1.shape[1] != n_embd:
            raise ValueError(
                f"{path}: fc1.weight has shape {tuple(fc1.shape)}, expected (H, {n_embd})"
            )
        h = fc1.shape[0]
        if fc2.dim() != 2 or tuple(fc2.shape) != (n_ff, h):
            raise ValueError(
                f"{path}: fc2.weight has shape {tuple(fc2.shape)}, expected ({n_ff}, {h}) "
                f"(n_ff {n_ff}, H {h} from fc1)"
            )
        if not (torch.isfinite(fc1).all() and torch.isfinite(fc2).all()):
            raise ValueError(f"{path}: predictor weights are not all finite")
        hidden.append(h)
    thr, act = read_predictor_config(d)
    return Predictors(files, hidden, thr, act, read_dense_layers(d, n_layer), read_cuts(d, n_layer))


# ----------------------------------------------------------------------------------- writing
def write_json(obj: object, path: Path) -> None:
    """``obj`` as indented JSON, written atomically."""
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")


def save_predictor(path: str | os.PathLike[str], fc1: Tensor, fc2: Tensor) -> None:
    """Write one ``model_{l}.pt``: a state dict of fp16 ``fc1.weight`` and ``fc2.weight``."""
    sd = {"fc1.weight": fc1.detach().half().contiguous(), "fc2.weight": fc2.detach().half()}
    with atomic_write(path) as tmp:
        torch.save({k: v.contiguous() for k, v in sd.items()}, tmp)


def check_out_dir(out: Path, n_layer: int) -> None:
    """Refuse an output that is a file, or a directory with more layers' predictors."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"predictor output {out} exists and is not a directory")
    if out.is_dir():
        stale = [
            p.name
            for p in out.iterdir()
            if (m := PREDICTOR_FILE_RE.fullmatch(p.name)) and int(m.group(1)) >= n_layer
        ]
        if stale:
            raise ValueError(
                f"{out} holds predictors of another model ({', '.join(sorted(stale)[:4])} for a "
                f"{n_layer}-layer model); use an empty directory"
            )


def write_config(
    out: Path, threshold: float, activation: str | None = None, extra: Mapping[str, Any] = {}
) -> Path:
    """Write ``config.json``: ``sparse_threshold``, the SiLU marker (``sparse_activation``) and
    any further keys (training metadata), atomically."""
    cfg: dict[str, Any] = {CONFIG_THRESHOLD: float(threshold)}
    if activation is not None:
        cfg[CONFIG_ACTIVATION] = activation
    cfg.update(extra)
    path = out / PREDICTOR_CONFIG
    write_json(cfg, path)
    return path


# ----------------------------------------------------------------------------------- packing
def pack_predictors(pred_dir: str | os.PathLike[str], out_file: str | os.PathLike[str]) -> Path:
    """Store a predictor directory's weights compactly: int8 rows with one fp16 scale per row.

    The pack is a safetensors file (no pickle) with ``blk.{l}.fc{1,2}.q`` (int8) and
    ``blk.{l}.fc{1,2}.scale`` (fp16, ``absmax / 127`` per row); it halves the size of fp16
    ``model_{l}.pt`` files, for shipping predictors inside the package.

    Args:
        pred_dir: ``model_0.pt`` … (read with ``weights_only=True``).
        out_file: the pack (written atomically).

    Returns:
        The pack path.

    Raises:
        ValueError: no predictors, or an unsafe/malformed file (named).
    """
    from safetensors.torch import save_file

    src, out = Path(pred_dir), Path(out_file)
    tensors: dict[str, Tensor] = {}
    l = 0
    while (src / PREDICTOR_FILE.format(l=l)).is_file():
        sd = load_predictor_file(src / PREDICTOR_FILE.format(l=l))
        for key in ("fc1", "fc2"):
            w = sd[f"{key}.weight"].float()  # (rows, cols)
            scale = w.abs().amax(dim=1, keepdim=True) / 127.0  # (rows, 1)
            scale = scale.half().float().clamp_min(1e-12)
            tensors[f"blk.{l}.{key}.q"] = (w / scale).round().clamp(-127, 127).to(torch.int8)
            tensors[f"blk.{l}.{key}.scale"] = scale.squeeze(1).half()
        l += 1
    if l == 0:
        raise ValueError(f"{src}: no predictors (model_0.pt) to pack")
    with atomic_write(out) as tmp:
        save_file(tensors, str(tmp), metadata={"n_layer": str(l), "format": "powerpy-q8-rows"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates 0600 files
    return out


def unpack_predictors(pack: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> int:
    """Expand a pack written by :func:`pack_predictors` into fp16 ``model_{l}.pt`` files.

    Returns:
        The number of layers written.

    Raises:
        ValueError: the pack is malformed (missing layers or tensors).
    """
    from safetensors import safe_open

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with safe_open(str(pack), framework="pt") as f:
        meta = f.metadata() or {}
        try:
            n_layer = int(meta["n_layer"])
            for l in range(n_layer):
                w = {
                    k: f.get_tensor(f"blk.{l}.{k}.q").float()
                    * f.get_tensor(f"blk.{l}.{k}.scale").float()[:, None]
                    for k in ("fc1", "fc2")
                }
                save_predictor(out / PREDICTOR_FILE.format(l=l), w["fc1"], w["fc2"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise ValueError(f"{pack}: not a powerpy predictor pack ({e})") from None
    return n_layer
