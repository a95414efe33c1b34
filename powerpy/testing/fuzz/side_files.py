"""Mutations of the side files (``.generated.gpuidx``, ``activation/activation_{i}.pt``) and
the seed cases of issue 13, for the load-path fuzzer (see ``cases``)."""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from powerpy.formats.constants import GGMLType, Keys, Names
from powerpy.formats.constants import GGUFValueType as V
from powerpy.formats.gguf_types import file_type_id
from powerpy.testing.fuzz.files import (
    BUDGET_GIB,
    MUTATIONS,
    SPEC,
    Draft,
    Mutation,
    Tensor,
    any_value,
    mutation,
    pick,
    write_draft,
)


# --- gpuidx files ---------------------------------------------------------------------------------
def gpuidx_draft(rng: np.random.Generator) -> Draft:
    """A valid index for ``SPEC`` (random buckets, a small capacity so that it is reused)."""
    kv = {
        Keys.ARCHITECTURE: (Keys.GPUIDX_ARCH, V.STRING),
        Keys.GPUIDX_BLOCK_COUNT: (SPEC.n_layer, V.UINT32),
        Keys.SPLIT_VRAM_CAPACITY: (1024, V.UINT64),
    }
    tensors = []
    for layer in range(SPEC.n_layer):
        bucket = np.sort(rng.choice(SPEC.n_ff, size=int(rng.integers(0, SPEC.n_ff)), replace=False))
        mask = np.zeros(SPEC.n_ff, np.int32)
        mask[bucket] = 1
        tensors.append(Tensor(Names.GPU_IDX.format(l=layer), mask, GGMLType.I32, mask.shape))
        b = bucket.astype(np.int32)
        tensors.append(Tensor(Names.GPU_BUCKET.format(l=layer), b, GGMLType.I32, b.shape))
    return Draft(True, kv, tensors)


def _gpuidx(mutate: Callable[[Draft, np.random.Generator], str]) -> Mutation:
    def fn(d: Draft, rng: np.random.Generator) -> str:
        idx = gpuidx_draft(rng)
        what = mutate(idx, rng)
        d.gpuidx = lambda model, path: write_draft(path, idx)
        d.load = {"vram_budget": BUDGET_GIB, "device": "cpu"}
        return what

    fn.__name__ = mutate.__name__
    return mutation("gpuidx")(fn)


@_gpuidx
def idx_values(idx: Draft, rng: np.random.Generator) -> str:
    """One value of an index tensor changed (mostly out of range)."""
    t = pick(rng, idx.tensors)
    a = np.array(t.data, np.int32)
    v = pick(rng, (-1, 2, SPEC.n_ff, 2**31 - 1, -(2**31), 0, 1))
    if a.size:
        a[int(rng.integers(a.size))] = v
    else:
        a = np.array([v], np.int32)
    t.data, t.shape = a, a.shape
    return f"{t.name}: a value = {v}"


@_gpuidx
def idx_layers(idx: Draft, rng: np.random.Generator) -> str:
    """Fewer or more index tensors than the layers need."""
    n = pick(rng, (0, 1, 3, 4, 6))
    idx.tensors = (idx.tensors * 4)[:n]
    return f"{n} tensors"


@_gpuidx
def idx_types(idx: Draft, rng: np.random.Generator) -> str:
    """An index tensor of another type."""
    t = pick(rng, idx.tensors)
    new = pick(rng, (GGMLType.F32, GGMLType.I8, GGMLType.I16, GGMLType.F16))
    dt = {
        GGMLType.F32: np.float32,
        GGMLType.I8: np.int8,
        GGMLType.I16: np.int16,
        GGMLType.F16: np.float16,
    }
    t.data, t.ggml_type = np.asarray(t.data).astype(dt[new]), new
    return f"{t.name} as {new.name}"


@_gpuidx
def idx_shape(idx: Draft, rng: np.random.Generator) -> str:
    """An index tensor of the wrong shape."""
    t = pick(rng, idx.tensors)
    a = np.asarray(t.data)
    t.data = np.stack([a, a]) if rng.integers(2) else np.concatenate([a, a])
    t.shape = t.data.shape
    return f"{t.name} shape {t.shape}"


@_gpuidx
def idx_keys(idx: Draft, rng: np.random.Generator) -> str:
    """An index key removed or given a random value."""
    key = pick(rng, (Keys.SPLIT_VRAM_CAPACITY, Keys.GPUIDX_BLOCK_COUNT, Keys.ARCHITECTURE))
    if rng.integers(4) == 0:
        del idx.kv[key]
        return f"without {key}"
    idx.kv[key] = any_value(rng)
    return f"{key} = {idx.kv[key]!r:.60}"


@_gpuidx
def idx_container(idx: Draft, rng: np.random.Generator) -> str:
    """The index file's magic, end, tensor names or order changed."""
    kind = int(rng.integers(4))
    if kind == 0:
        idx.sparse = False
        return "GGUF magic"
    if kind == 1:
        idx.cut = pick(rng, (1, 64, 200, 10**6))
        return f"last {idx.cut} bytes cut"
    if kind == 2:
        idx.tensors[0].name, idx.tensors[1].name = idx.tensors[1].name, idx.tensors[0].name
        return "names swapped"
    idx.tensors.reverse()
    return "tensors reversed"


# --- activation statistics ------------------------------------------------------------------------
def _odd_stats(kind: str, rng: np.random.Generator) -> Callable[[Path], None]:
    """Writes one odd ``activation_{i}.pt`` into ``path`` (a file name)."""
    import torch

    n = SPEC.n_ff
    dense = torch.rand(n) * 100

    def save(obj: Any) -> Callable[[Path], None]:
        return lambda path: torch.save(obj, path)

    makers: dict[str, Callable[[], Callable[[Path], None]]] = {
        "sparse_coo": lambda: save(dense.to_sparse()),
        "sparse_csr": lambda: save(dense.reshape(8, 8).to_sparse_csr()),
        "quantized": lambda: save(torch.quantize_per_tensor(dense, 0.5, 0, torch.quint8)),
        "meta": lambda: save(torch.empty(n, device="meta")),
        "nested": lambda: save(torch.nested.nested_tensor([dense[:10], dense[:20]])),
        "length": lambda: save(
            dense[: pick(rng, (0, 1, n - 1))] if rng.integers(2) else torch.cat([dense, dense])
        ),
        "ndim": lambda: save(pick(rng, (dense.reshape(8, 8), dense[0], dense.reshape(1, n)))),
        "dtype": lambda: save(
            dense.to(
                pick(
                    rng,
                    (
                        torch.complex64,
                        torch.bool,
                        torch.int8,
                        torch.uint8,
                        torch.float16,
                        torch.bfloat16,
                        torch.int64,
                        torch.float64,
                    ),
                )
            )
        ),
        "values": lambda: save(
            dense.index_fill(
                0, torch.tensor([3]), pick(rng, (math.nan, math.inf, -1.0, -math.inf, 1e38))
            )
        ),
        "not_tensor": lambda: save(pick(rng, ({"a": dense}, [dense], "text", 3, None, (dense,)))),
        "noncontiguous": lambda: save(torch.rand(2 * n)[::2]),
        "truncated": lambda: _truncated_pickle(dense, rng),
        "unsafe_pickle": lambda: lambda path: path.write_bytes(pickle.dumps(_Unsafe())),
        "garbage": lambda: (
            lambda path: path.write_bytes(
                pick(rng, (b"", b"PK\x03\x04", b"\x80\x02}q\x00.", bytes(100)))
            )
        ),
        "legacy": lambda: (
            lambda path: torch.save(dense, path, _use_new_zipfile_serialization=False)
        ),
        "directory": lambda: lambda path: path.mkdir(),
    }
    return makers[kind]()


class _Unsafe:
    """A pickle that would run ``eval`` when loaded without ``weights_only``."""

    def __reduce__(self):
        return (eval, ("1 + 1",))


def _truncated_pickle(t: Any, rng: np.random.Generator) -> Callable[[Path], None]:
    """A torch.save zip cut inside (or just after) its data.pkl member."""
    import torch

    def write(path: Path) -> None:
        buf = io.BytesIO()
        torch.save(t, buf)
        data = buf.getvalue()
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        cut = start + int(rng.integers(0, info.compress_size + 1))
        path.write_bytes(data[:cut])

    return write


STATS_KINDS = (
    "sparse_coo",
    "sparse_csr",
    "quantized",
    "meta",
    "nested",
    "length",
    "ndim",
    "dtype",
    "values",
    "not_tensor",
    "noncontiguous",
    "truncated",
    "unsafe_pickle",
    "garbage",
    "legacy",
    "directory",
)


def _stats_mutation(kind: str) -> None:
    def fn(d: Draft, rng: np.random.Generator) -> str:
        layer = int(rng.integers(SPEC.n_layer))
        odd = _odd_stats(kind, rng)

        def write(act: Path) -> None:
            import torch

            act.mkdir(parents=True, exist_ok=True)
            for i in range(SPEC.n_layer):
                path = act / f"activation_{i}.pt"
                odd(path) if i == layer else torch.save(torch.rand(SPEC.n_ff) * 100, path)

        d.stats = write
        d.load = {"vram_budget": BUDGET_GIB, "device": "cpu"}
        return f"activation_{layer}.pt: {kind}"

    fn.__name__ = kind
    mutation("stats")(fn)


for _kind in STATS_KINDS:
    _stats_mutation(_kind)


# --- the seed cases of the issue ------------------------------------------------------------------
def _set(key: str, *spec: Any) -> Callable[[Draft], None]:
    def fn(d: Draft) -> None:
        d.kv[d.key(key)] = spec

    return fn


def _seed_mislabelled(d: Draft) -> None:
    t = d.tensor(Names.FFN_UP.format(l=0))
    t.type_id, t.data, d.raw = file_type_id(GGMLType.Q4_0, b"PWRI"), t.data.view(np.uint8), True


def _seed_values(v: float) -> Callable[[Draft], None]:
    def fn(d: Draft) -> None:
        t = d.tensor(Names.ATTN_Q.format(l=1))
        t.data = np.full(t.shape, v, np.float32)

    return fn


def _seed_shift(d: Draft) -> None:
    d.kv[Keys.ALIGNMENT], d.raw = (64, V.UINT32), True


def _seed_stats(kind: str) -> Callable[[Draft], None]:
    def fn(d: Draft) -> None:
        name = f"stats.{kind}"
        MUTATIONS[name][1](d, np.random.default_rng(0))

    return fn


SEED_CASES: dict[str, tuple[str, Callable[[Draft], None]]] = {
    "embedding_length_array": ("kv", _set(Keys.EMBEDDING_LENGTH, [32], V.ARRAY, V.UINT32)),
    "embedding_length_array2": ("kv", _set(Keys.EMBEDDING_LENGTH, [32, 32], V.ARRAY, V.UINT32)),
    "tokens_scalar": ("kv", _set(Keys.TOKENS, "hello", V.STRING)),
    "scores_scalar": ("kv", _set(Keys.SCORES, 0.5, V.FLOAT32)),
    "bos_empty_array": ("kv", _set(Keys.BOS_ID, [], V.ARRAY, V.UINT32)),
    "add_eos_empty_array": ("kv", _set(Keys.ADD_EOS, [], V.ARRAY, V.BOOL)),
    "eos_float_inf": ("kv", _set(Keys.EOS_ID, math.inf, V.FLOAT32)),
    "head_count_0": ("hparams", _set(Keys.HEAD_COUNT, 0, V.UINT32)),
    "rope_dims_negative": ("hparams", _set(Keys.ROPE_DIMENSION_COUNT, -8, V.INT32)),
    "block_count_0": ("hparams", _set(Keys.BLOCK_COUNT, 0, V.UINT32)),
    "rope_freq_base_nan": ("hparams", _set(Keys.ROPE_FREQ_BASE, math.nan, V.FLOAT32)),
    "rope_freq_base_0": ("hparams", _set(Keys.ROPE_FREQ_BASE, 0.0, V.FLOAT32)),
    "rope_freq_base_negative": ("hparams", _set(Keys.ROPE_FREQ_BASE, -1e4, V.FLOAT32)),
    "rms_eps_nan": ("hparams", _set(Keys.RMS_EPS, math.nan, V.FLOAT32)),
    "rms_eps_0": ("hparams", _set(Keys.RMS_EPS, 0.0, V.FLOAT32)),
    "rms_eps_negative": ("hparams", _set(Keys.RMS_EPS, -1e-5, V.FLOAT32)),
    "vocab_size_too_large": ("hparams", _set(Keys.VOCAB_SIZE, 300, V.UINT32)),
    "sparse_threshold_nan": ("hparams", _set(Keys.SPARSE_THRESHOLD, math.nan, V.FLOAT32)),
    "weights_nan": ("tensors", _seed_values(math.nan)),
    "weights_huge": ("tensors", _seed_values(3e38)),
    "f32_labelled_q4_0": ("tensors", _seed_mislabelled),
    "alignment_shift": ("alignment", _seed_shift),
    **{
        f"stats_{k}": ("stats", _seed_stats(k))
        for k in ("sparse_coo", "quantized", "meta", "nested", "truncated")
    },
}
