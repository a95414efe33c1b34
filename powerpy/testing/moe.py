"""Synthetic mixture-of-experts GGUFs of any size, for benchmarks: the tensors of a
``TinySpec`` with experts (``tiny.tiny_tensors``'s layout and scales), generated and written one
tensor at a time, so a file of gigabytes needs one tensor's memory. llama.cpp reads them too.

    python -m powerpy.testing.moe out.gguf --n-embd 1024 --n-layer 8 --n-ff 1024 \\
        --n-expert 8 --n-expert-used 2 --dtype q8_0 [--arch qwen2moe --n-ff-shexp 2048]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from powerpy.families import family
from powerpy.families.base import DENSE_FFN
from powerpy.formats import quants
from powerpy.formats.constants import GGMLType, Names
from powerpy.formats.gguf_writer import GGUFStreamWriter
from powerpy.testing.tiny import BYTE_VOCAB, TinySpec, spec_args, vocab_kv


def _table(spec: TinySpec) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in file order."""
    args = spec_args(spec, sparse=False)
    fam, d = family(spec.arch), spec.n_embd
    out = [(Names.TOKEN_EMBD, (len(BYTE_VOCAB), d))]
    for l in range(spec.n_layer):
        for t in fam.usual_block:
            if t.field not in DENSE_FFN:
                out.append((t.name.format(l=l), tuple(getattr(args, x) for x in t.shape)))
        for t in fam.experts:
            out.append((t.name.format(l=l), tuple(getattr(args, x) for x in t.shape)))
    out += [(Names.OUTPUT_NORM, (d,)), (Names.OUTPUT, (len(BYTE_VOCAB), d))]
    return out


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """tiny_tensors' scales: norms 1 + 0.1·N(0, 1), matrices and other vectors (a shared
    expert's gate row) N(0, 1) / sqrt(columns)."""
    if len(shape) == 1 and "norm" in name:
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1]))


def _tensors(spec: TinySpec, dtype: GGMLType, seed: int) -> Iterator[tuple]:
    for i, (name, shape) in enumerate(_table(spec)):
        a = _values(name, shape, np.random.default_rng([seed, i]))
        if a.ndim == 1 or name.endswith(Names.FFN_GATE_INP[7:]) or dtype == GGMLType.F32:
            yield name, a, GGMLType.F32  # vectors and routers stay f32, as converters write them
        elif dtype == GGMLType.F16:
            yield name, a.astype(np.float16), dtype
        else:
            yield name, quants.quantize(a, dtype), dtype


def write_moe_model(
    path: str | Path, spec: TinySpec, dtype: GGMLType = GGMLType.Q8_0, *, seed: int = 0
) -> Path:
    """Write a random MoE model of ``spec`` (``spec.n_expert`` > 0) to ``path``, matrices in
    ``dtype`` (F32, F16, or a type ``formats.quants.quantize`` writes), one tensor at a time.

    Raises:
        ValueError: a spec without experts, or a type the quantizers do not write.
    """
    if spec.n_expert <= 0:
        raise ValueError("write_moe_model needs a spec with experts (n_expert > 0)")
    kv = spec_args(spec, sparse=False).to_gguf_kv(name="powerpy-synthetic-moe") | vocab_kv()
    table = []
    for name, shape in _table(spec):
        kind = dtype if len(shape) > 1 and not name.endswith(Names.FFN_GATE_INP[7:]) else None
        table.append((name, shape, GGMLType.F32 if kind is None else kind))
    with GGUFStreamWriter(path, kv, table) as w:
        for (name, a, _), (_, shape, _) in zip(_tensors(spec, dtype, seed), table, strict=True):
            w.write(name, a.reshape(-1).view(np.uint8) if a.dtype == np.uint8 else a, shape)
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write a synthetic mixture-of-experts GGUF")
    ap.add_argument("output")
    ap.add_argument("--arch", default="llama", choices=("llama", "qwen3moe", "qwen2moe"))
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--n-head-kv", type=int, default=4)
    ap.add_argument("--n-ff", type=int, default=1024, help="each expert's FFN width")
    ap.add_argument("--n-expert", type=int, default=8)
    ap.add_argument("--n-expert-used", type=int, default=2)
    ap.add_argument("--n-ff-shexp", type=int, default=0, help="qwen2moe: the shared expert's "
                    "FFN width (0: --n-ff)")  # fmt: skip
    ap.add_argument("--dtype", default="q8_0", choices=("f32", "f16", "q8_0", "q4_0"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    experts = dict(n_expert=a.n_expert, n_expert_used=a.n_expert_used, n_ff_exp=a.n_ff,
                   n_ff_shexp=a.n_ff_shexp)  # fmt: skip
    spec = TinySpec(a.n_embd, a.n_layer, a.n_ff, a.n_head, a.n_head_kv, arch=a.arch, n_ctx=4096,
                    **experts)  # fmt: skip
    write_moe_model(a.output, spec, GGMLType[a.dtype.upper()], seed=a.seed)


if __name__ == "__main__":
    main()
