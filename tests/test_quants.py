"""quants: dequantization and the Q8_0/Q4_0/Q4_1 quantizers are bit-identical to gguf.quants."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
from quant_fixtures import F16_FIELDS, random_blocks

from powerpy.formats import quants
from powerpy.formats.constants import DEQUANT_TYPES, TYPE_TRAITS, GGMLType
from powerpy.formats.gguf_reader import read_gguf

GQ = gguf.GGMLQuantizationType

BLOCK_TYPES = list(F16_FIELDS)
PLAIN_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16]


def _as_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bit_identical(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.array_equal(got, expected, equal_nan=True)
    assert np.array_equal(_as_bits(got), _as_bits(expected))  # -0.0 and NaN payloads too


@pytest.mark.parametrize("t", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_types_match_gguf(t):
    rng = np.random.default_rng(int(t))
    bs = TYPE_TRAITS[t].block_size
    raw = random_blocks(rng, t, rows=37, blocks_per_row=3)
    expected = gguf.quants.dequantize(raw, GQ(int(t)))
    assert_bit_identical(quants.dequantize(raw, t, (37, 3 * bs)), expected)
    # other shapes of the same bytes: 3-D and 1-D
    assert_bit_identical(
        quants.dequantize(raw.reshape(37, 3, -1), t, (37, 3, bs)), expected.reshape(37, 3, bs)
    )
    assert_bit_identical(
        quants.dequantize(raw.reshape(-1), t, (37 * 3 * bs,)), expected.reshape(-1)
    )


@pytest.mark.parametrize("t", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_types_fully_random_bytes(t):
    """inf/NaN scales too: same values (NaN == NaN), and no warnings."""
    rng = np.random.default_rng(100 + int(t))
    size, bs = TYPE_TRAITS[t].type_size, TYPE_TRAITS[t].block_size
    raw = rng.integers(0, 256, size=(64, 2 * size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        expected = gguf.quants.dequantize(raw, GQ(int(t)))
    with np.errstate(all="raise"):
        got = quants.dequantize(raw, t, (64, 2 * bs))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("t", PLAIN_TYPES, ids=lambda t: t.name)
def test_float_types_match_gguf_including_nan_inf(t):
    rng = np.random.default_rng(7)
    size = TYPE_TRAITS[t].type_size
    raw = rng.integers(0, 256, size=(16, 48 * size), dtype=np.uint8)  # random bits: NaN, inf, -0
    raw[0, :size] = 0
    raw[0, size - 1] = 0x80  # -0.0
    expected = gguf.quants.dequantize(raw, GQ.BF16 if t is GGMLType.BF16 else GQ(int(t)))
    expected = expected.reshape(16, 48)
    assert_bit_identical(quants.dequantize(raw, t, (16, 48)), expected)


@pytest.mark.parametrize(
    ("t", "dtype"), [(GGMLType.I8, np.int8), (GGMLType.I16, np.int16), (GGMLType.I32, np.int32)]
)
def test_integer_types(t, dtype):
    values = np.array([[-5, 0, 7], [100, -100, 1]], dtype=dtype)
    got = quants.dequantize(values.view(np.uint8), t, (2, 3))
    assert got.dtype == np.float32 and np.array_equal(got, values.astype(np.float32))


def test_non_contiguous_input_and_fresh_output():
    rng = np.random.default_rng(1)
    raw = random_blocks(rng, GGMLType.Q4_0, rows=10, blocks_per_row=2)
    every_other = raw[::2]  # non-contiguous rows
    expected = gguf.quants.dequantize(np.ascontiguousarray(every_other), GQ.Q4_0)
    assert_bit_identical(quants.dequantize(every_other, GGMLType.Q4_0, (5, 64)), expected)
    f32 = rng.standard_normal((3, 4)).astype(np.float32)
    out = quants.dequantize(f32.view(np.uint8), GGMLType.F32, (3, 4))
    assert out.flags.writeable and not np.shares_memory(out, f32)


def test_chunked_decode_of_many_blocks(monkeypatch):
    """Chunk boundaries that do not divide the block count change nothing."""
    rng = np.random.default_rng(2)
    raw = random_blocks(rng, GGMLType.Q6_K, rows=7, blocks_per_row=3)
    expected = gguf.quants.dequantize(raw, GQ.Q6_K)
    monkeypatch.setattr(quants, "_CHUNK_ELEMS", 256 * 4)  # 4 blocks per chunk, 21 blocks
    assert_bit_identical(quants.dequantize(raw, GGMLType.Q6_K, (7, 768)), expected)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="Q8_K is not supported"):
        quants.dequantize(np.zeros(292, np.uint8), GGMLType.Q8_K, (256,))
    with pytest.raises(ValueError, match="needs 34 bytes, got 33"):
        quants.dequantize(np.zeros(33, np.uint8), GGMLType.Q8_0, (32,))
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        quants.dequantize(np.zeros(36, np.uint8), GGMLType.Q4_0, (2, 16))
    with pytest.raises(ValueError, match="uint8"):
        quants.dequantize(np.zeros(8, np.float32), GGMLType.F32, (8,))
    with pytest.raises(ValueError, match="unknown ggml type"):
        quants.dequantize(np.zeros(4, np.uint8), 99, (1,))
    with pytest.raises(ValueError, match="multiple of 32"):
        quants.quantize_q8_0(np.zeros(31, np.float32))
    with pytest.raises(ValueError, match="Q6_K is not supported"):
        quants.quantize(np.zeros(256, np.float32), GGMLType.Q6_K)


def test_supported_types_cover_constants():
    assert DEQUANT_TYPES <= quants.SUPPORTED_TYPES


# --- quantizers ---------------------------------------------------------------------------------
def _quantizer_inputs() -> np.ndarray:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    x[1] *= 1e-3
    x[2] *= 1e4
    x[3, :32] = 0.0  # d = 0
    x[4, :32] = np.arange(32, dtype=np.float32) * 0.5 - 8  # exact halves: rounding ties
    x[5, :32] = -x[5, :32]  # sign of the largest magnitude
    x[6, :32] = 1.0
    x[6, 5] = -1.0  # +max and -max tie: the first one wins
    x[7, :64] = rng.integers(-127, 128, 64).astype(np.float32)  # integral values
    x[8] = np.float32(1e-8) * rng.standard_normal(256).astype(np.float32)  # subnormal fp16 d
    x[9, :32] = 65504.0 * 127  # d overflows to fp16 inf
    return x


@pytest.mark.parametrize(
    ("fn", "qt"),
    [
        (quants.quantize_q8_0, GQ.Q8_0),
        (quants.quantize_q4_0, GQ.Q4_0),
        (quants.quantize_q4_1, GQ.Q4_1),
        (quants.quantize_mxfp4, GQ.MXFP4),
    ],
)
def test_quantizers_match_gguf(fn, qt):
    x = _quantizer_inputs()
    with np.errstate(all="ignore"):  # the overflowing block warns inside gguf
        expected = gguf.quants.quantize(x, qt)
        got = fn(x)
    assert got.dtype == np.uint8 and got.shape == expected.shape
    assert np.array_equal(got, expected)
    with np.errstate(all="raise"):  # powerpy's quantizers never warn
        got3 = fn(x.reshape(4, 16, 256))
    assert got3.shape == (4, 16, expected.shape[-1])
    assert np.array_equal(got3.reshape(expected.shape), expected)


@pytest.mark.parametrize(
    ("t", "qt"),
    [
        (GGMLType.Q8_0, GQ.Q8_0),
        (GGMLType.Q4_0, GQ.Q4_0),
        (GGMLType.Q4_1, GQ.Q4_1),
        (GGMLType.MXFP4, GQ.MXFP4),
        (GGMLType.BF16, GQ.BF16),
        (GGMLType.F16, GQ.F16),
        (GGMLType.F32, GQ.F32),
    ],
)
def test_quantize_dispatch_matches_gguf(t, qt):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    x[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    if t in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.MXFP4):
        x[0, :4] = 0.0
    got = quants.quantize(x, t)
    expected = np.ascontiguousarray(gguf.quants.quantize(x, qt)).view(np.uint8)
    assert np.array_equal(got, expected.reshape(got.shape))
    back = quants.dequantize(got, t, x.shape)
    if t in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        np.testing.assert_allclose(back, x, rtol=1e-2)
    else:
        atol = {GGMLType.Q8_0: 0.03, GGMLType.MXFP4: 1.0}.get(t, 0.6)  # MXFP4: 4 bits, 2^e steps
        np.testing.assert_allclose(back, x, atol=atol)


# --- the real model -------------------------------------------------------------------------------
def test_smollm2_tensors_match_gguf(smollm2_path):
    with read_gguf(smollm2_path) as f:
        names = [n for n in f.tensors if n.startswith("blk.0.")] + ["output_norm.weight"]
        for name in names:
            t = f.tensors[name]
            expected = gguf.quants.dequantize(f.raw(name), GQ(t.file_type_id)).reshape(t.shape)
            assert_bit_identical(f.dequantize(name), expected)
        assert {f.tensors[n].ggml_type for n in names} == {GGMLType.Q4_1, GGMLType.F32}
        # Q8_0 token embeddings: the first 4096 rows
        t = f.tensors["token_embd.weight"]
        assert t.ggml_type is GGMLType.Q8_0
        rows = f.raw("token_embd.weight")[:4096]
        expected = gguf.quants.dequantize(rows, GQ.Q8_0)
        assert_bit_identical(quants.dequantize(rows, GGMLType.Q8_0, (4096, 576)), expected)


def test_smollm2_dequantizes_in_seconds(smollm2_path):
    with read_gguf(smollm2_path) as f:
        t0 = time.perf_counter()
        n = sum(f.dequantize(name).size for name in f.tensors)
        dt = time.perf_counter() - t0
    assert n == 134_515_008
    assert dt < 20, f"dequantizing 135M parameters took {dt:.1f} s"
