"""The fused ops of the accelerator's step (``powerpy.model.gpu_kernels``) and the device budget.

Each op has two implementations, and both are checked (``impl``): the op itself (its torch
version on CPU tensors, the one the emulated accelerator runs; its Triton kernels on a GPU) and
the Triton kernels called directly (``triton_*``: on CPU tensors in Triton's interpreter,
``TRITON_INTERPRET=1`` set in conftest.py, the same code the GPU compiles). With a GPU they run
compiled on it (``tools/device_check.sh`` selects them with ``-m triton``). Each is compared with
the blocks decoded by ``gguf.quants`` (the reference dequantization) and a float64 product, or
a float64 attention.
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
from powerpy.model.gpu_kernels import DeviceQuantWeight
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
TYPES = [GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.MXFP4]


def _matrix(t: GGMLType, rows: int, cols: int, seed: int = 0):
    """(DeviceQuantWeight, its values as float64 (rows, cols) decoded by gguf.quants)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    if t == GGMLType.F16:
        raw = w.astype(np.float16).view(np.uint8)
    else:
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(t)))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t))).reshape(rows, cols)
    raw = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(rows, -1)
    return DeviceQuantWeight(raw.to(DEV), t, cols), torch.from_numpy(ref.astype(np.float64))


def _on(*ts):
    return [t.to(DEV) for t in ts]


@pytest.fixture(params=["op", "triton"])
def impl(request):
    return request.param


def _linear(fw, x, need=None, bucket=None, impl="op"):
    if impl == "op":
        return fw.linear(x, need, bucket)
    return gpu_kernels.triton_linear(fw.raw, x, fw._code, fw.cols, need, bucket)


def _rows_sum(fw, h, impl="op"):
    if impl == "op":
        return fw.rows_sum(h)
    return gpu_kernels.triton_block_rows_sum(fw.raw, h, fw._code, fw.cols)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_linear_and_rows_sum_equal_the_decoded_blocks(t, impl):
    fw, ref = _matrix(t, 37, 96)  # rows not a multiple of the tiles
    for T in (1, 3, 17):  # one token, a tile of 16 (padded), two tiles
        x = torch.randn(T, 96)
        got = _linear(fw, *_on(x), impl=impl).cpu().double()
        torch.testing.assert_close(got, x.double() @ ref.t(), atol=2e-5, rtol=1e-5)
        h = torch.randn(T, 37)
        h[:, ::3] = 0  # rows whose weight is 0 are skipped
        got = _rows_sum(fw, *_on(h), impl=impl).cpu().double()
        torch.testing.assert_close(got, h.double() @ ref, atol=2e-5, rtol=1e-5)


def test_mxfp4_blocks_of_every_code_and_subnormal_scales():
    """MXFP4 rows of random bytes (every code), exponents from 0 (ggml's subnormal scales) to
    2^12: the values gguf.quants decodes."""
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (19, 3, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(0, 140, (19, 3), dtype=np.uint8)
    raw[0, :, 0] = [0, 1, 2]
    ref = gguf.quants.dequantize(raw.reshape(19, -1), gguf.GGMLQuantizationType.MXFP4)
    fw = DeviceQuantWeight(torch.from_numpy(raw.reshape(19, -1)).to(DEV), GGMLType.MXFP4, 96)
    x = torch.randn(2, 96)
    want = x.double() @ torch.from_numpy(ref.astype(np.float64)).t()
    torch.testing.assert_close(fw.linear(*_on(x)).cpu().double(), want, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 3])
def test_linear_reads_only_the_needed_rows(impl, T):
    """``need`` (T, n_ff) and ``bucket`` (k,): row r of a stacked (2k, cols) gate/up matrix is
    computed only where its neuron bucket[r % k] is needed, else 0 (a block of rows no token
    needs runs no step)."""
    fw, ref = _matrix(GGMLType.Q4_0, 2 * 40, 64, seed=1)
    x = torch.randn(T, 64)
    need = torch.rand(T, 100) < 0.4
    bucket = torch.randperm(100)[:40]
    need[:, bucket[:16]] = False  # the first block of 16 rows: nothing needed
    keep = need[:, bucket[torch.arange(80) % 40]]
    got = _linear(fw, *_on(x, need, bucket), impl=impl).cpu().double()
    torch.testing.assert_close(got, (x.double() @ ref.t()) * keep, atol=2e-5, rtol=1e-5)


def _attention_ref(q, k, v, base, pos, scale, softcap, window):
    """Float64 attention of one query per session over its rows of k, v (rows, n_kv, hd)."""
    B, n_head, hd = q.shape
    group = n_head // k.shape[1]
    out = torch.zeros(B, n_head, hd, dtype=torch.float64)
    for b in range(B):
        lo = max(0, int(pos[b]) - window + 1) if window else 0
        rows = slice(int(base[b]) + lo, int(base[b]) + int(pos[b]) + 1)
        for h in range(n_head):
            ks, vs = k[rows, h // group].double(), v[rows, h // group].double()
            sc = ks @ q[b, h].double() * scale
            if softcap:
                sc = torch.tanh(sc / softcap) * softcap
            out[b, h] = sc.softmax(0) @ vs
    return out.reshape(B, n_head * hd)


@pytest.mark.parametrize(
    "n_head, n_kv, hd, window, softcap",
    [(8, 2, 64, 0, 0.0), (4, 4, 80, 0, 0.0), (6, 2, 32, 5, 0.0), (8, 1, 64, 0, 30.0)],
)
def test_decode_attention_reads_each_session_up_to_its_position(
    impl, n_head, n_kv, hd, window, softcap
):
    """A layer of the pool (600 rows, f16) and three sessions at positions 0, a few and far
    into a cache of 300 rows: chunks past a position are skipped, one chunk holds them all or
    several do (ATTN_CHUNK = 256); GQA groups, a head size not a power of two, a window, a
    soft-cap."""
    g = torch.Generator().manual_seed(n_head + hd)
    k = torch.randn(600, n_kv, hd, generator=g).half()
    v = torch.randn(600, n_kv, hd, generator=g).half()
    q = torch.randn(3, n_head, hd, generator=g)
    base, pos = torch.tensor([0, 300, 599]), torch.tensor([7, 299, 0])
    scale = hd**-0.5
    want = _attention_ref(q, k, v, base, pos, scale, softcap, window)
    args = (*_on(q, k, v, base, pos), scale, softcap, window, 300)
    if impl == "op":
        got = gpu_kernels.decode_attention_op(*args)
    else:
        got = gpu_kernels.triton_decode_attention(*args)
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope_kv_turns_q_and_k_and_writes_the_pool(impl, neox, n_rot):
    """q and k turned by the table's row of each position (adjacent or NEOX pairs, all or part
    of the head), k and v written at each session's pool row in the pool's dtype, the other
    rows untouched; q, k and v read as strided views of one q/k/v projection."""
    from powerpy.model.gpu_kernels import _rotate

    B, n_head, n_kv, hd = 3, 4, 2, 64
    g = torch.Generator().manual_seed(n_rot + neox)
    qkv = torch.randn(B, (n_head + 2 * n_kv) * hd, generator=g)
    q, k, v = (t.view(B, -1, hd) for t in qkv.split([n_head * hd, n_kv * hd, n_kv * hd], 1))
    table = torch.randn(40, n_rot // 2, 2, generator=g)
    pos, rows = torch.tensor([0, 5, 39]), torch.tensor([9, 0, 4])
    kc = torch.full((10, n_kv, hd), 7.0, dtype=torch.float16)
    vc = kc.clone()
    args = (*_on(q, k, v, table, pos, rows, kc, vc), n_rot, neox)
    if impl == "op":
        got = gpu_kernels.rope_kv_op(*args)
    else:
        got = gpu_kernels.triton_rope_kv(*args)
    kc, vc = args[6].cpu(), args[7].cpu()
    cs = table.double()[pos]  # the reference turn, in float64
    torch.testing.assert_close(got.cpu().double(), _rotate(q.double(), cs, n_rot, neox))
    want_k = _rotate(k.double(), cs, n_rot, neox).half()
    assert torch.equal(kc[rows], want_k) and torch.equal(vc[rows], v.half())
    others = torch.ones(10, dtype=torch.bool)
    others[rows] = False
    assert (kc[others] == 7).all() and (vc[others] == 7).all()


@pytest.mark.parametrize("variant", ["swiglu", "reglu", "drelu"])
def test_glu_applies_the_activation_and_the_cut(variant, impl):
    gu = torch.randn(2, 2 * 50)
    tau = torch.rand(50) * 0.3
    g, u = gu[:, :50], gu[:, 50:]
    want = {"swiglu": F.silu(g) * u, "reglu": F.relu(g) * u, "drelu": F.relu(g) * F.relu(u)}
    want = want[variant].masked_fill(want[variant].abs() < tau, 0.0)
    op = (
        gpu_kernels.glu
        if impl == "op"
        else (lambda gu, tau, var: gpu_kernels.triton_glu(gu, tau, gpu_kernels.VARIANTS[var]))
    )
    got = op(*_on(gu, tau), variant).cpu()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    got = op(*_on(gu), None, variant).cpu()
    torch.testing.assert_close(got[want != 0], want[want != 0], atol=1e-6, rtol=1e-5)


def test_rms_norm(impl):
    x, w = torch.randn(3, 200), torch.randn(200)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    op = gpu_kernels.rms_norm_op if impl == "op" else gpu_kernels.triton_rms_norm
    got = op(*_on(x, w), 1e-5).cpu()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_a_row_length_the_kernels_cannot_read_is_refused():
    with pytest.raises(ValueError, match="multiple of 32 values, not F16 rows of 20"):
        DeviceQuantWeight(torch.zeros(2, 40, dtype=torch.uint8), GGMLType.F16, 20)


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
