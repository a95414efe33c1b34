"""The fused kernels of placed matrices (``powerpy.model.gpu_kernels``) and the device budget.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set in
conftest.py) on CPU tensors: the same code the GPU compiles. With one they run compiled on it
(``tools/device_check.sh`` selects them with ``-m triton``). Each is compared with the blocks
decoded by ``gguf.quants`` (the reference dequantization) and a float64 product.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from powerpy.config import ModelArgs
from powerpy.formats.constants import GGMLType
from powerpy.model import gpu_kernels
from powerpy.model.gpu_kernels import FusedWeight
from powerpy.placement.reserve import (
    ROWS_SUM_SPLIT,
    WORKSPACE_PER_STREAM,
    DeviceReserve,
    device_budget,
)
from powerpy.testing import TinySpec
from powerpy.testing.tiny import spec_args

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not gpu_kernels.available(), reason="needs triton"),
]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TYPES = [GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1]


def _matrix(t: GGMLType, rows: int, cols: int, seed: int = 0):
    """(FusedWeight, its values as float64 (rows, cols) decoded by gguf.quants)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    if t == GGMLType.F16:
        raw = w.astype(np.float16).view(np.uint8)
    else:
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(t)))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t))).reshape(rows, cols)
    raw = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(rows, -1)
    return FusedWeight(raw.to(DEV), t, cols), torch.from_numpy(ref.astype(np.float64))


def _on(*ts):
    return [t.to(DEV) for t in ts]


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_linear_and_rows_sum_equal_the_decoded_blocks(t):
    fw, ref = _matrix(t, 37, 96)  # rows not a multiple of the tiles
    x = torch.randn(3, 96)
    got = fw.linear(*_on(x)).cpu().double()
    torch.testing.assert_close(got, x.double() @ ref.t(), atol=2e-5, rtol=1e-5)
    h = torch.randn(2, 37)
    h[:, ::3] = 0  # rows whose weight is 0 are skipped
    got = fw.rows_sum(*_on(h)).cpu().double()
    torch.testing.assert_close(got, h.double() @ ref, atol=2e-5, rtol=1e-5)


def test_linear_reads_only_the_needed_rows():
    """``need`` (T, n_ff) and ``bucket`` (k,): row r of a stacked (2k, cols) gate/up matrix is
    computed only where its neuron bucket[r % k] is needed, else 0."""
    fw, ref = _matrix(GGMLType.Q4_0, 2 * 20, 64, seed=1)
    x = torch.randn(3, 64)
    need = torch.rand(3, 100) < 0.4
    bucket = torch.randperm(100)[:20]
    keep = need[:, bucket[torch.arange(40) % 20]]
    got = fw.linear(*_on(x, need, bucket)).cpu().double()
    torch.testing.assert_close(got, (x.double() @ ref.t()) * keep, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["swiglu", "reglu", "drelu"])
def test_glu_applies_the_activation_and_the_cut(variant):
    gu = torch.randn(2, 2 * 50)
    tau = torch.rand(50) * 0.3
    g, u = gu[:, :50], gu[:, 50:]
    want = {"swiglu": F.silu(g) * u, "reglu": F.relu(g) * u, "drelu": F.relu(g) * F.relu(u)}
    want = want[variant].masked_fill(want[variant].abs() < tau, 0.0)
    got = gpu_kernels.glu(*_on(gu, tau), variant).cpu()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    got = gpu_kernels.glu(*_on(gu), None, variant).cpu()
    torch.testing.assert_close(got[want != 0], want[want != 0], atol=1e-6, rtol=1e-5)


def test_rms_norm():
    x, w = torch.randn(3, 200), torch.randn(200)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    got = gpu_kernels.rms_norm_op(*_on(x, w), 1e-5).cpu()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_a_row_length_the_kernels_cannot_read_is_refused():
    with pytest.raises(ValueError, match="multiple of 32 values, not F16 rows of 20"):
        FusedWeight(torch.zeros(2, 40, dtype=torch.uint8), GGMLType.F16, 20)


# ----------------------------------------------------------------------------------- budget
def _args(**kw) -> ModelArgs:
    return spec_args(TinySpec(**kw))


def test_the_reserve_counts_workspaces_and_a_prefill_chunks_temporaries():
    assert ROWS_SUM_SPLIT == gpu_kernels.ROWS_SUM_SPLIT
    small = DeviceReserve.for_model(_args(n_embd=64, n_ff=256), n_ctx=64)
    big = DeviceReserve.for_model(_args(n_embd=64, n_ff=256), n_ctx=4096)
    assert small.workspace == big.workspace == 2 * WORKSPACE_PER_STREAM
    assert big.temporaries > small.temporaries > 0  # the scores and the KV prefix grow
    assert "cuBLAS workspaces 64.0 MiB" in small.describe()


def test_a_budget_beyond_free_memory_is_clamped():
    reserve = DeviceReserve(64 << 20, 36 << 20)
    assert device_budget(1 << 30, reserve, None)[0] == 1 << 30  # no device to ask
    assert device_budget(1 << 30, reserve, 2 << 30)[0] == 1 << 30  # fits
    placed, line = device_budget(1 << 30, reserve, 1 << 30)
    assert placed == (1 << 30) - reserve.total and "clamped" in line
    assert device_budget(1 << 30, reserve, 10 << 20)[0] == 0
