"""read_gguf on corrupt input: only GGUFFormatError (naming the file and the offset), in bounded
time, never a huge allocation; explicit tests for every named failure mode, then hypothesis
mutations (truncation, bit flips, overwrites, absurd counts and lengths, bad magic/version/types)
of small valid GGUF and PWRI files."""

from __future__ import annotations

import itertools
import math
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerpy.formats import quants
from powerpy.formats.constants import GGMLType, GGUFValueType
from powerpy.formats.gguf_reader import GGUFFormatError, read_gguf
from powerpy.formats.gguf_writer import write_gguf

V = GGUFValueType
HUGE = 2**63


# --- hand-built files ---------------------------------------------------------------------------
def s(text: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string: u64 length + bytes (``length`` overrides the stored length)."""
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data) if length is None else length) + data


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def ti(name: str, ne: tuple[int, ...], type_id: int, offset: int) -> bytes:
    head = s(name) + struct.pack("<I", len(ne))
    return head + b"".join(struct.pack("<Q", d) for d in ne) + struct.pack("<IQ", type_id, offset)


def build(
    kvs: list[bytes],
    tis: list[bytes],
    data: bytes = b"",
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    align: int = 32,
    pad: bool = True,
) -> bytes:
    n_t = len(tis) if n_tensors is None else n_tensors
    n_k = len(kvs) if n_kv is None else n_kv
    out = magic + struct.pack("<IQQ", version, n_t, n_k) + b"".join(kvs) + b"".join(tis)
    if pad:
        out += bytes(-len(out) % align)
    return out + data


ARCH = kv("general.architecture", V.STRING, s("llama"))
U32 = struct.pack("<I", 1)
F32_DATA = np.arange(32, dtype=np.float32).tobytes()  # 128 bytes, already aligned

# name -> (file bytes, expected message fragment, expected offset or None)
CASES: dict[str, tuple[bytes, str, int | None]] = {
    "empty": (b"", "empty", 0),
    "short_header": (b"GGUF\x03\x00", "truncated file: version", 4),
    "bad_magic": (build([ARCH], []).replace(b"GGUF", b"GGML", 1), "bad magic b'GGML'", 0),
    "version_1": (build([ARCH], [], version=1), "version 1", 4),
    "version_4": (build([ARCH], [], version=4), "unsupported GGUF version 4", 4),
    "big_endian": (build([ARCH], [], version=3 << 24), "big-endian", 4),
    "huge_n_kv": (build([ARCH], [], n_kv=HUGE), f"key/value count {HUGE}", 16),
    "max_n_kv": (build([ARCH], [], n_kv=2**64 - 1), "key/value count", 16),
    "huge_n_tensors": (build([ARCH], [], n_tensors=HUGE), f"tensor count {HUGE}", 8),
    "huge_key_length": (build([s("k", HUGE) + U32], []), f"has length {HUGE}", 24),
    "huge_string_value": (
        build([kv("k", V.STRING, s("v", HUGE))], []),
        f"value of key 'k' has length {HUGE}",
        24 + 9 + 4,
    ),
    "huge_array_count": (
        build([kv("k", V.ARRAY, struct.pack("<IQ", V.UINT32, HUGE))], []),
        f"claims {HUGE} UINT32 items",
        24 + 9 + 4 + 4,
    ),
    "huge_string_array": (
        build([kv("k", V.ARRAY, struct.pack("<IQ", V.STRING, 2**40) + s("a"))], []),
        "claims 1099511627776 STRING items",
        24 + 9 + 4 + 4,
    ),
    "huge_item_in_string_array": (
        build([kv("k", V.ARRAY, struct.pack("<IQ", V.STRING, 2) + s("a") + s("b", HUGE))], []),
        "string item of array 'k' has length",
        24 + 9 + 4 + 12 + 9,
    ),
    "unknown_value_type": (build([kv("k", 13, U32)], []), "unknown value type of key 'k' 13", 33),
    "unknown_item_type": (
        build([kv("k", V.ARRAY, struct.pack("<IQ", 99, 1) + U32)], []),
        "unknown array item type of key 'k' 99",
        37,
    ),
    "array_of_arrays": (
        build([kv("k", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1) + struct.pack("<IQ", 4, 0))], []),
        "array of arrays",
        37,
    ),
    "duplicate_key": (build([ARCH, ARCH], []), "duplicate key 'general.architecture'", 24 + 45),
    "invalid_utf8_key": (build([kv(b"\xff\xfe", V.UINT32, U32)], []), "not valid UTF-8", 24),
    "duplicate_tensor": (
        build([ARCH], [ti("w", (32,), 0, 0), ti("w", (32,), 0, 128)], F32_DATA * 2),
        "duplicate tensor name 'w'",
        None,
    ),
    "n_dims_5": (build([], [ti("w", (1, 1, 1, 1, 1), 0, 0)], F32_DATA), "n_dims = 5", 24 + 9),
    "long_name": (
        build([], [ti("x" * 64, (32,), 0, 0)], F32_DATA),
        "64 bytes, longer than the 63",
        24,
    ),
    "pwri_unknown_type": (
        build([], [ti("w", (32,), 19, 0)], F32_DATA, magic=b"PWRI"),
        "type id 19, unknown to PowerInfer",
        24 + 9 + 4 + 8,
    ),
    "gguf_iq_type": (
        build([], [ti("w", (256,), 16, 0)], bytes(128)),
        "powerpy does not support IQ quants",
        24 + 9 + 4 + 8,
    ),
    "gguf_removed_type_4": (build([], [ti("w", (32,), 4, 0)], F32_DATA), "type id 4", 45),
    "gguf_f64_type": (build([], [ti("w", (32,), 28, 0)], F32_DATA), "type id 28", 45),
    "partial_block": (
        build([], [ti("w", (16, 2), 2, 0)], bytes(64)),
        "ne[0] = 16 elements per row, not a multiple of the block size 32",
        24 + 9 + 4,
    ),
    "absurd_dims": (
        build([], [ti("w", (0, 2**62, 2**62), 0, 0)]),
        "absurd dimensions",
        24 + 9 + 4,
    ),
    "data_past_eof": (
        build([ARCH], [ti("w", (64,), 0, 0)], F32_DATA),
        "extends past the end of the file",
        None,
    ),
    "offset_past_eof": (
        build([], [ti("w", (32,), 0, 2**63)], F32_DATA),
        "extends past the end",
        24 + 9 + 4 + 8 + 4,
    ),
    "data_start_past_eof": (
        build([], [ti("w", (0,), 0, 0)], pad=False),
        "tensor data would start",
        None,
    ),
    "misaligned": (
        build([], [ti("w", (8,), 0, 0), ti("v", (8,), 0, 8)], F32_DATA),
        "data offset 8, not a multiple of the alignment 32",
        None,
    ),
    "overlap": (
        build([], [ti("w", (32,), 0, 0), ti("v", (16,), 0, 64)], F32_DATA),
        "overlaps tensor 'w'",
        None,
    ),
    "alignment_not_pow2": (
        build([kv("general.alignment", V.UINT32, struct.pack("<I", 48))], []),
        "general.alignment = 48 is not a power of two",
        24,
    ),
    "alignment_zero": (
        build([ARCH, kv("general.alignment", V.UINT32, struct.pack("<I", 0))], []),
        "general.alignment = 0",
        24 + 45,
    ),
    "alignment_u64": (
        build([kv("general.alignment", V.UINT64, struct.pack("<Q", 32))], []),
        "has type UINT64, expected UINT32",
        24,
    ),
    "truncated_tensor_info": (
        build([ARCH], [ti("w", (32,), 0, 0)], pad=False)[:-5],
        "truncated file: data offset of tensor 'w'",
        None,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_named_failure_modes(case, tmp_path):
    data, fragment, offset = CASES[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(data)
    t0 = time.perf_counter()
    with pytest.raises(GGUFFormatError) as e:
        read_gguf(path)
    assert time.perf_counter() - t0 < 1.0
    message = str(e.value)
    assert isinstance(e.value, ValueError)
    assert str(path) in message and "offset" in message
    assert fragment in message, message
    assert e.value.path == str(path)
    if offset is not None:
        assert e.value.offset == offset, message
        assert f"offset {offset}" in message


def test_valid_edge_cases_are_accepted(tmp_path):
    """Neighbours of the failure modes that must still read."""
    cases = {
        "name_63": build([], [ti("x" * 63, (32,), 0, 0)], F32_DATA),
        "n_dims_4": build([], [ti("w", (32, 1, 1, 1), 0, 0)], F32_DATA),
        "n_dims_0": build([], [ti("w", (), 0, 0)], bytes(32)),
        "empty_tensor_at_eof": build([], [ti("w", (32,), 0, 0), ti("e", (0,), 0, 128)], F32_DATA),
        "no_trailing_padding": build([], [ti("w", (3,), 0, 0)], F32_DATA[:12]),
        "alignment_1": build(
            [kv("general.alignment", V.UINT32, struct.pack("<I", 1))],
            [ti("w", (3,), 0, 0), ti("v", (3,), 0, 12)],
            F32_DATA[:24],
            align=1,
        ),
        "version_2": build([ARCH], [ti("w", (32,), 0, 0)], F32_DATA, version=2),
        "bool_byte_2": build([kv("b", V.BOOL, b"\x02")], []),
        "non_utf8_value": build([kv("k", V.STRING, s(b"\xff"))], []),
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with read_gguf(path) as f:
            for t in f.tensors:
                f.dequantize(t)
    with read_gguf(tmp_path / "n_dims_0.gguf") as f:
        assert f.tensors["w"].ne == () and f.tensors["w"].shape == () and f.array("w").shape == ()
    with read_gguf(tmp_path / "alignment_1.gguf") as f:
        assert f.array("v").tolist() == [3.0, 4.0, 5.0]


# --- hypothesis -----------------------------------------------------------------------------------
def _valid_file(magic: bytes) -> bytes:
    """A small valid file (~1.3 KB) touching every reader path, built with write_gguf."""
    import tempfile

    rng = np.random.default_rng(0)
    q6 = rng.integers(0, 256, (1, 210), dtype=np.uint8)
    q6[0, 208:210] = np.array([0.01], "<f2").view(np.uint8)
    kvs = [
        ("general.architecture", "llama"),
        ("llama.block_count", (1, V.UINT32)),
        ("f", (0.5, V.FLOAT32)),
        ("b", True),
        ("strs", ["a", "bc", ""]),
        ("ints", np.arange(4, dtype=np.int32)),
        ("u64", (2**40, V.UINT64)),
    ]
    tensors = [
        ("f32", rng.standard_normal((2, 32)).astype(np.float32), GGMLType.F32),
        ("f16", rng.standard_normal(32).astype(np.float16), GGMLType.F16),
        ("q8", quants.quantize_q8_0(rng.standard_normal((2, 32))), GGMLType.Q8_0),
        ("q4", quants.quantize_q4_0(rng.standard_normal(32)), GGMLType.Q4_0),
        ("q6k", q6, GGMLType.Q6_K),
        ("i32", np.arange(5, dtype=np.int32), GGMLType.I32),
        ("empty", np.zeros(0, np.int32), GGMLType.I32),
    ]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "base.gguf"
        write_gguf(path, kvs, tensors, magic=magic)
        return path.read_bytes()


BASES = {magic: _valid_file(magic) for magic in (b"GGUF", b"PWRI")}


def _fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every count, length, type and offset field of a valid file.

    An independent walker, so the fuzzer can aim at the fields that drive allocation.
    """
    fields = [(0, 4), (4, 4), (8, 8), (16, 8)]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string() -> None:
        nonlocal pos
        fields.append((pos, 8))
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    for _ in range(n_kv):
        string()
        fields.append((pos, 4))
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if vtype == V.STRING:
            string()
        elif vtype == V.ARRAY:
            item, count = struct.unpack_from("<IQ", data, pos)
            fields += [(pos, 4), (pos + 4, 8)]
            pos += 12
            for _ in range(count):
                if item == V.STRING:
                    string()
                else:
                    pos += sizes[item]
        else:
            pos += sizes[vtype]
    for _ in range(n_tensors):
        string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        fields += [(pos, 4)] + [(pos + 4 + 8 * j, 8) for j in range(n_dims)]
        pos += 4 + 8 * n_dims
        fields += [(pos, 4), (pos + 4, 8)]
        pos += 12
    return fields


FIELDS = {magic: _fields(data) for magic, data in BASES.items()}
INTERESTING = [
    *range(0, 34),
    63,
    64,
    255,
    256,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
    len(BASES[b"GGUF"]),
    len(BASES[b"GGUF"]) + 1,
]
_COUNTER = itertools.count()


def _check(data: bytes, directory: Path) -> None:
    """read_gguf either raises GGUFFormatError or gives a file whose tensors can all be used."""
    path = directory / f"case{next(_COUNTER)}.gguf"
    path.write_bytes(data)
    try:
        try:
            f = read_gguf(path)
        except GGUFFormatError as e:
            assert str(path) in str(e) and "offset" in str(e)
            return
        with f:
            repr(f)
            f.typed_kv()
            for name, t in f.tensors.items():
                raw = f.raw(name)
                assert raw.nbytes == t.nbytes and t.offset + t.nbytes <= len(data)
                if t.ggml_type in quants.SUPPORTED_TYPES:
                    out = f.dequantize(name)
                    assert out.shape == t.shape and out.dtype == np.float32
                if t.ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.I32):
                    assert f.array(name).shape == t.shape
            _check_rewrite(f, directory)
    finally:
        path.unlink()


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        )
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b and type(a) is type(b)


def _check_rewrite(f, directory: Path) -> None:
    """Whatever was accepted can be written back and reads the same."""
    out = directory / f"rewrite{next(_COUNTER)}.gguf"
    write_gguf(out, f.typed_kv(), f.tensor_specs(), magic=f.magic, alignment=f.alignment)
    try:
        with read_gguf(out) as g:
            assert list(g.kv) == list(f.kv) and g.kv_types == f.kv_types
            assert all(_same(f.kv[k], g.kv[k]) for k in f.kv)
            assert [(t.ne, t.ggml_type) for t in g.tensors.values()] == [
                (t.ne, t.ggml_type) for t in f.tensors.values()
            ]
            for name in f.tensors:
                assert np.array_equal(f.raw(name), g.raw(name))
    finally:
        out.unlink()


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    magic = draw(st.sampled_from(sorted(BASES)))
    data = bytearray(BASES[magic])
    fields = FIELDS[magic]
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "field", "magic"]))
        if not data:
            break
        if kind == "truncate":
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif kind == "flip":
            pos = draw(st.integers(0, len(data) - 1))
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "overwrite":
            pos = draw(st.integers(0, len(data) - 1))
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[pos : pos + len(chunk)] = chunk
        elif kind == "field":
            pos, width = draw(st.sampled_from(fields))
            value = draw(st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**64 - 1)))
            data[pos : pos + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
        else:
            data[0:4] = draw(st.sampled_from([b"GGUF", b"PWRI", b"GGML", b"\0\0\0\0", b"pwri"]))
    return bytes(data)


FUZZ = settings(
    deadline=2000,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(FUZZ, max_examples=150)
@given(data=mutated())
def test_fuzz_mutations(data, fuzz_dir):
    _check(data, fuzz_dir)


@settings(FUZZ, max_examples=100)
@given(
    magic=st.sampled_from(sorted(BASES)),
    field=st.integers(0, 10**6),
    value=st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**64 - 1)),
)
def test_fuzz_count_and_type_fields(magic, field, value, fuzz_dir):
    data = bytearray(BASES[magic])
    pos, width = FIELDS[magic][field % len(FIELDS[magic])]
    data[pos : pos + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    _check(bytes(data), fuzz_dir)


@settings(FUZZ, max_examples=50)
@given(
    magic=st.sampled_from([b"GGUF", b"PWRI"]),
    version=st.sampled_from([2, 3]),
    tail=st.binary(max_size=512),
)
def test_fuzz_random_bytes_after_header(magic, version, tail, fuzz_dir):
    _check(magic + struct.pack("<I", version) + tail, fuzz_dir)


def test_every_truncation(tmp_path):
    """Cutting a valid file anywhere gives GGUFFormatError (or a still-valid prefix)."""
    for magic, data in BASES.items():
        for n in range(len(data)):
            _check(data[:n], tmp_path)
        _check(data, tmp_path)  # and the file itself is fine
        with read_gguf(_write(tmp_path / "ok.gguf", data)) as f:
            assert f.magic == magic and len(f.tensors) == 7


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
