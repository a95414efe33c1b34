"""Synthetic mixture-of-experts GGUFs of any size, for benchmarks: the tensors of a
``TinySpec`` with experts (``tiny.tiny_tensors``'s layout and scales), generated and written one
tensor at a time, so a file of gigabytes needs one tensor's memory. llama.cpp reads them too.

    python -m powerpy.testing.moe out.gguf --n-embd 1024 --n-layer 8 --n-ff 1024 \\
        --n-expert 8 --n-expert-used 2 --dtype q8_0 [--arch qwen2moe --n-ff-shexp 2048]
        [--arch deepseek2 --n-layer-dense 1 --kv-lora-rank 512 --q-lora-rank 768]
        [--arch gpt-oss --head-dim 64 --experts-dtype mxfp4 --sliding-window 128]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from powerpy.formats import quants
from powerpy.formats.constants import GGMLType, Names
from powerpy.formats.gguf_writer import GGUFStreamWriter
from powerpy.testing.tiny import TinySpec, spec_args, tensor_table, vocab_kv


def _values(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    """tiny_tensors' scales (``tiny.random_tensor``), drawn in f32: norms 1 + 0.1·N(0, 1),
    biases 0.1·N(0, 1), matrices and other vectors (a shared expert's gate row) N(0, 1) /
    sqrt(columns)."""
    if kind in ("norm", "bias"):
        a = rng.standard_normal(shape, dtype=np.float32)
        return (1.0 + 0.1 * a if kind == "norm" else 0.1 * a).astype(np.float32)
    return rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1]))


def _drawn(shape: tuple[int, ...], kind: str, t: GGMLType, device: str, seed: int) -> np.ndarray:
    """``_values``'s distributions drawn by torch on ``device``, as ``t`` (F32 or F16)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(shape, generator=gen, device=device)
    if kind in ("norm", "bias"):
        a = 1.0 + 0.1 * a if kind == "norm" else 0.1 * a
    else:
        a.mul_(shape[-1] ** -0.5)
    return a.to(torch.float16 if t == GGMLType.F16 else torch.float32).cpu().numpy()


def _type(name: str, shape: tuple, kind: str, dtype: GGMLType, experts: GGMLType) -> GGMLType:
    """A tensor's type: vectors, biases and routers f32 (as converters write them), the experts'
    stacks ``experts``, other matrices ``dtype``."""
    if kind in ("norm", "bias", "row") or name.endswith(Names.FFN_GATE_INP[7:]):
        return GGMLType.F32
    return experts if len(shape) == 3 else dtype


def _encoded(a: np.ndarray, t: GGMLType) -> np.ndarray:
    if t == GGMLType.F32:
        return a
    return a.astype(np.float16) if t == GGMLType.F16 else quants.quantize(a, t)


def write_moe_model(
    path: str | Path,
    spec: TinySpec,
    dtype: GGMLType = GGMLType.Q8_0,
    *,
    experts: GGMLType | None = None,
    seed: int = 0,
    device: str | None = None,
) -> Path:
    """Write a random MoE model of ``spec`` (``spec.n_expert`` > 0) to ``path``, matrices in
    ``dtype`` (F32, F16, or a type ``formats.quants.quantize`` writes), the experts' stacks in
    ``experts`` (None: ``dtype``; MXFP4 as GPT-OSS ships them), one tensor at a time.
    ``device``: draw the values with torch on this device instead of numpy (the same
    distributions, other values; F32 and F16 only), for files of tens of gigabytes.

    Raises:
        ValueError: a spec without experts, or a type the quantizers do not write.
    """
    if spec.n_expert <= 0:
        raise ValueError("write_moe_model needs a spec with experts (n_expert > 0)")
    if device is not None and {dtype, experts or dtype} - {GGMLType.F32, GGMLType.F16}:
        raise ValueError("write_moe_model draws on a device in F32 and F16 only")
    kv = spec_args(spec, sparse=False).to_gguf_kv(name="powerpy-synthetic-moe")
    kv |= vocab_kv(spec.n_vocab)
    rows = tensor_table(spec, sparse=False)
    table = [
        (name, shape, _type(name, shape, kind, dtype, experts or dtype))
        for name, shape, kind in rows
    ]
    with GGUFStreamWriter(path, kv, table) as w:
        for i, ((name, shape, kind), (_, _, t)) in enumerate(zip(rows, table, strict=True)):
            if device is not None:
                w.write(name, _drawn(shape, kind, t, device, seed * 100_003 + i), shape)
                continue
            a = _encoded(_values(shape, kind, np.random.default_rng([seed, i])), t)
            w.write(name, a.reshape(-1).view(np.uint8) if a.dtype == np.uint8 else a, shape)
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write a synthetic mixture-of-experts GGUF")
    ap.add_argument("output")
    ap.add_argument(
        "--arch",
        default="llama",
        choices=("llama", "qwen3moe", "qwen2moe", "glm4moe", "deepseek2", "gpt-oss"),
    )
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--n-head-kv", type=int, default=4)
    ap.add_argument("--n-ff", type=int, default=1024, help="each expert's FFN width")
    ap.add_argument("--n-expert", type=int, default=8)
    ap.add_argument("--n-expert-used", type=int, default=2)
    ap.add_argument(
        "--n-ff-shexp",
        type=int,
        default=0,
        help="qwen2moe: the shared expert's FFN width (0: --n-ff)",
    )
    ap.add_argument(
        "--n-ff-dense",
        type=int,
        default=0,
        help="glm4moe, deepseek2: the leading dense layers' FFN width (0: 4 · --n-ff)",
    )
    ap.add_argument(
        "--n-layer-dense", type=int, default=0, help="glm4moe, deepseek2: leading dense layers"
    )
    ap.add_argument("--head-dim", type=int, default=0, help="the head size (0: n_embd / n_head)")
    ap.add_argument("--n-rot", type=int, default=0, help="rotated dims per head (0: all)")
    ap.add_argument("--kv-lora-rank", type=int, default=512, help="deepseek2: the latent")
    ap.add_argument(
        "--q-lora-rank", type=int, default=0, help="deepseek2: q's low rank (0: a plain attn_q)"
    )
    ap.add_argument("--dtype", default="q8_0", choices=("f32", "f16", "q8_0", "q4_0"))
    ap.add_argument(
        "--experts-dtype",
        default=None,
        choices=("f16", "q8_0", "q4_0", "mxfp4"),
        help="the experts' stacks (default: --dtype)",
    )
    ap.add_argument(
        "--sliding-window", type=int, default=128, help="gpt-oss: the window of its even layers"
    )
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    experts = dict(
        n_expert=a.n_expert,
        n_expert_used=a.n_expert_used,
        n_ff_exp=a.n_ff,
        n_ff_shexp=a.n_ff_shexp,
        n_layer_dense=a.n_layer_dense,
    )
    n_ff = a.n_ff_dense or (4 * a.n_ff if a.n_layer_dense else a.n_ff)
    head = a.head_dim or a.n_embd // a.n_head
    extra: dict = {"key_length": a.head_dim, "n_rot": a.n_rot}
    if a.arch == "deepseek2":  # MLA heads: the head size of q·k (n_rot of it turned), v's too
        n_rot = a.n_rot or 64
        extra = dict(
            n_rot=n_rot,
            q_lora_rank=a.q_lora_rank,
            kv_lora_rank=a.kv_lora_rank,
            key_length_mla=head + n_rot,
            value_length_mla=head,
        )
    if a.arch == "gpt-oss":
        extra["sliding_window"] = a.sliding_window
    spec = TinySpec(
        a.n_embd,
        a.n_layer,
        n_ff,
        a.n_head,
        a.n_head_kv,
        arch=a.arch,
        n_ctx=4096,
        **experts,
        **extra,
    )
    ex = GGMLType[a.experts_dtype.upper()] if a.experts_dtype else None
    write_moe_model(a.output, spec, GGMLType[a.dtype.upper()], experts=ex, seed=a.seed)


if __name__ == "__main__":
    main()
