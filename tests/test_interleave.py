"""Q4_K, Q4_0 and MXFP4 matrices with their rows interleaved 8 at a time
(``powerpy.model.interleave``, ``csrc/q4_k_x8.h``, ``csrc/q4_0_x8.h``, ``csrc/mxfp4_x8.h``): the
layout holds the same blocks, its products are the ones llama.cpp's repacked kernels compute
(``test_ggml_vec_dot``, and the oracle tests: every Q4_K_M and Q4_0 file, and GPT-OSS's MXFP4
experts, are bit-identical), and the rows they were built from stay readable.

- Packing and unpacking give back every byte of random blocks (all scale bit patterns).
- The GEMM's token groups: 4 tokens in the GEMM's order, the last T % 4 each in the GEMV's, so a
  prompt's tail token equals that token alone; its values agree with the row layout's within
  the two orders' rounding.
- With f32 activations the products are the row layout's own, bit for bit.
- Only whole-matrix products take the layout: a row gather is refused with a clear error.
- Interleaving hands the source rows' pages back to the kernel without losing them.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from quant_fixtures import random_blocks

from powerpy.formats.constants import TYPE_TRAITS, GGMLType
from powerpy.model import interleave, kernels, numerics
from powerpy.model.matrices import QuantWeight

AVX2_FLAGS = ("-O2", "-march=x86-64-v3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


@pytest.fixture(scope="module")
def lib():
    lib = kernels.built()
    if lib is None or lib.simd not in ("AVX2", "AVX-512"):
        pytest.skip("needs the native kernels on an AVX2 (or wider) build")
    return lib


def _weight(rows: int, cols: int, seed: int = 0, t: GGMLType = GGMLType.Q4_K) -> QuantWeight:
    raw = random_blocks(np.random.default_rng(seed), t, rows, cols // TYPE_TRAITS[t].block_size)
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(raw)), t, cols)


@pytest.mark.parametrize(
    ("t", "ld"),
    [
        (GGMLType.Q4_K, 3 * interleave.X8_SB),
        (GGMLType.Q4_0, 24 * interleave.X8Q40_B),
        (GGMLType.MXFP4, 24 * interleave.X8MX_B),
    ],
)
def test_pack_unpack_round_trip(lib, t, ld):
    w = _weight(48, 768, t=t)
    want = w.raw.clone()
    x8 = w.dense_kernel()[1]
    assert x8.code != w.kernel()[1].code and x8.nrows == 48 and x8.ld == ld
    assert torch.equal(interleave.rows_of(lib, x8), want)
    assert torch.equal(w.raw, want)  # the source rows: handed back, not lost
    every = lib.dequant_rows(w.kernel()[1], None)
    assert torch.equal(lib.dequant_rows(x8, torch.arange(48)), every)


def test_token_groups_and_agreement(lib):
    w = _weight(64, 512, seed=1)
    x8, rows = w.dense_kernel()[1], w.kernel()[1]
    x = torch.randn(7, 512)
    got = lib.gemm(x8, x)  # tokens 0-3: the GEMM's order; 4-6: the GEMV's, each alone
    for t in (4, 5, 6):
        assert torch.equal(got[t], lib.gemm(x8, x[t : t + 1])[0])
    want = lib.gemm(rows, x)
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))
    assert not torch.equal(got, want)  # two orders: the last bits differ somewhere


@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q4_0, GGMLType.MXFP4])
def test_f32_activations_are_the_row_layouts(lib, t):
    w = _weight(32, 512, seed=2, t=t)
    x = torch.randn(512)
    with numerics.using(numerics.Numerics(quantized_activations=False)):
        want = lib.gather_gemv(w.kernel()[1], x, torch.arange(32))
        got = lib.gather_gemv(w.dense_kernel()[1], x, None)
        assert torch.equal(got, want)
        assert torch.equal(w.linear(x[None])[0], want)  # linear keeps the rows for f32


def test_mxfp4_products_are_the_same_bits_without_vnni(lib):
    """MXFP4's interleaved products sum each block's integers in 32-bit lanes (VNNI) or in
    16-bit pairs first (AVX2 alone): the same integers, so the AVX2 build's bits are the native
    build's, every token count."""
    if kernels.find_compiler() is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a compiler on x86-64")
    avx2 = kernels.build(flags=AVX2_FLAGS)  # test_kernels' AVX2 variant (cached)
    raw = random_blocks(np.random.default_rng(9), GGMLType.MXFP4, 24, 1024 // 32)
    rows = kernels.Matrix.of_quant(torch.from_numpy(raw), GGMLType.MXFP4, 1024)
    mats = [interleave.interleaved(k, rows, release=False) for k in (lib, avx2)]
    for T in (1, 3, 6):
        x = 3 * torch.randn(T, 1024, generator=torch.Generator().manual_seed(T))
        assert torch.equal(lib.gemm(mats[0], x), avx2.gemm(mats[1], x)), T


def test_only_whole_matrix_products(lib):
    w = _weight(16, 256, seed=3)
    x8 = w.dense_kernel()[1]
    with pytest.raises(ValueError, match="invalid arguments"):
        lib.gather_gemv(x8, torch.randn(256), torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="invalid arguments"):
        lib.gather_axpy(x8, torch.ones(2), torch.tensor([3, 1]))


@pytest.mark.parametrize(
    ("rows", "t"),
    [(12, GGMLType.Q4_K), (12, GGMLType.Q4_0), (16, GGMLType.Q6_K), (16, GGMLType.Q8_0)],
)
def test_other_matrices_keep_their_rows(lib, rows, t):
    w = _weight(rows, 256, seed=4, t=t)  # 12 rows: not a multiple of 8
    assert w.dense_kernel()[1] is w.kernel()[1]


def _gguf_with(path, raw: np.ndarray) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("w", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_release_keeps_every_byte(tmp_path):
    """A file read into memory (the default load): the released pages become the file's same
    bytes; once the file has changed, they stay as they are."""
    from powerpy.formats.gguf_reader import GGUFFile

    raw = random_blocks(np.random.default_rng(6), GGMLType.Q4_K, 256, 4)  # 576 KiB
    _gguf_with(tmp_path / "m.gguf", raw)
    f = GGUFFile(tmp_path / "m.gguf", in_memory=True)
    view = f.raw("w")
    ptr = view.ctypes.data
    assert f.pages is not None and f.pages.range(ptr, view.nbytes) is not None
    interleave.release_pages(ptr, view.nbytes, f.pages)
    assert np.array_equal(view.reshape(raw.shape), raw)
    (tmp_path / "m.gguf").write_bytes((tmp_path / "m.gguf").read_bytes())  # same bytes, new mtime
    assert f.pages.range(ptr, view.nbytes) is None  # changed since read: pages stay
    interleave.release_pages(ptr, view.nbytes, f.pages)
    assert np.array_equal(view.reshape(raw.shape), raw)
    f.close()


def test_gathered_rows_stay_in_place(lib, tmp_path, monkeypatch):
    """A sparse file's gate and up are read row by row: a dense run interleaves them but keeps
    their rows where they are (no page release), and the sparse run after it gives the same
    logits as a fresh load's."""
    import powerpy
    from powerpy.model.options import RunOptions
    from powerpy.testing.synthetic import write_synthetic_model

    released = []
    monkeypatch.setattr(interleave, "release_pages", lambda p, n, f=None: released.append(p))
    path = write_synthetic_model(tmp_path / "m.powerinfer.gguf", "tiny", "q4_0", stats=False)
    ours, fresh = powerpy.load(path), powerpy.load(path)
    blk = ours.model.weights.blk[0]
    assert blk.ffn_up.gathered and blk.ffn_gate.gathered and not blk.attn_q.gathered
    tok = torch.tensor([5])

    def step(llm, sparse: bool) -> torch.Tensor:
        return llm.model.forward(tok, llm.model.new_cache(4), RunOptions(sparse=sparse))

    step(ours, sparse=False)
    # the whole-matrix layouts
    assert blk.ffn_up.interleaved and blk.ffn_gate.interleaved and blk.attn_q.interleaved
    kept = {w.raw.data_ptr() for w in (blk.ffn_up, blk.ffn_gate)}
    assert released and not kept & set(released)  # attention's rows went back, the FFN's stay
    assert torch.equal(step(ours, sparse=True), step(fresh, sparse=True))


def test_a_sparse_q4_0_step_keeping_every_neuron_is_the_dense_step(lib, tmp_path):
    """A sparse Q4_0 file's FFN block whose predictor keeps every neuron (a threshold of -1e30):
    its gathered gate and up rows are multiplied in the interleaved layout's order (``x8.h``
    ``x8_rows_*``), so the block's output is the dense block's bits (gate and up interleaved).
    The blocks are compared, not the logits: each next product rounds its input to 8 bits,
    which hides a last-bit difference."""
    import powerpy
    from powerpy.model import stack_decode
    from powerpy.model.options import RunOptions
    from powerpy.testing import TinySpec, write_tiny_model

    path = tmp_path / "m.powerinfer.gguf"
    spec = TinySpec(n_embd=256, n_ff=512, n_layer=2, n_head=4, n_head_kv=2)
    write_tiny_model(path, spec, dtype=GGMLType.Q4_0, seed=4)  # random weights, random d
    model = powerpy.load(path).model
    outs = []
    for sparse in (True, False):
        plan = stack_decode.plan_for(model, RunOptions(sparse=sparse))
        rec = plan.records[1]
        r = torch.randn(spec.n_embd, generator=torch.Generator().manual_seed(1))
        out, k = lib.ffn_decode(rec, spec.norm_eps, -1e30, r)
        assert k == spec.n_ff
        outs.append(out)
    assert model.weights.blk[1].ffn_up.interleaved  # the dense record's gate and up are interleaved
    assert torch.equal(outs[0], outs[1])
