"""Microbenchmark of the sparse FFN kernels: native kernel vs torch fallback vs dense torch.

One "layer" is the predictor-gated ReGLU FFN of batch-1 decode on neuron-major weights
gate/up/down_t (n_ff, n_embd): ``h = glu_rows(x, gate, up, idx, "reglu")`` and
``y = down_t.gather_axpy(h, idx)`` for k active neurons.

Methods:
  kernel  powerpy.model.matrices with the native kernels (2 calls: fused gate/up, then axpy)
  torch   powerpy.model.matrices, kernels disabled (index_select(out=) + F.linear, embedding_bag)
  dense   best dense torch formulation (F.linear on gate and up; down via a contiguous
          (n_embd, n_ff) copy, or the transposed view for f32); for q8_0/q4_0 the torch
          fallback's tile-dequantize + BLAS path over all rows
  dense-k the native kernels over all rows (linear + axpy over every neuron)

GB/s = bytes of touched weight rows / time. Each call is timed alone; a cell reports the
median. Several copies of the layer (>= --pool-gb in total) and 16 random sorted index sets are
cycled so that touched rows come from DRAM, not from the 32 MiB L3.

On a machine shared with other busy processes, OpenMP's default active wait can make a
2-thread call take 10+ ms (a spinning thread holds the core its partner needs); run with
OMP_WAIT_POLICY=passive there (it costs ~60-80 us per parallel region instead) and --stat min.

Example:
    OMP_WAIT_POLICY=passive python tools/bench_kernels.py --shape 1b 7b --dtype f16 q4_0 \\
        --threads 1 2 --k 0.1 0.25 1 --stat min
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from powerpy.formats.constants import TYPE_TRAITS, GGMLType  # noqa: E402
from powerpy.model import kernels, numerics  # noqa: E402
from powerpy.model.ffn import glu_rows  # noqa: E402
from powerpy.model.matrices import DenseWeight, QuantWeight, Weight  # noqa: E402
from powerpy.model.numerics import Numerics  # noqa: E402

SHAPES = {"1b": (2048, 5632), "7b": (4096, 11008)}  # (n_embd, n_ff)
FLOAT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
QUANT = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}


def random_weight(rows: int, cols: int, dtype: str, gen: torch.Generator) -> Weight:
    """N(0, 0.02)-ish weights; quantized ones get random blocks (no quantization cost)."""
    if dtype in FLOAT:
        return DenseWeight((torch.randn(rows, cols, generator=gen) * 0.02).to(FLOAT[dtype]))
    qt = QUANT[dtype]
    tr = TYPE_TRAITS[qt]
    nb = cols // tr.block_size
    raw = torch.randint(0, 256, (rows, nb, tr.type_size), dtype=torch.uint8, generator=gen)
    d = (torch.rand(rows, nb, generator=gen) * 0.004 + 0.001).to(torch.float16)
    raw[..., :2] = d.view(torch.uint8).reshape(rows, nb, 2)
    return QuantWeight(raw.reshape(rows, nb * tr.type_size), qt, cols)


def timed(fn, n: int, budget_s: float, stat: str = "median") -> float:
    """Median (or min) seconds of up to n calls (at least 3), stopping after budget_s."""
    fn(0)  # warm-up
    times = []
    t_end = time.perf_counter() + budget_s
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() > t_end:
            break
    return min(times) if stat == "min" else statistics.median(times)


def layer_fn(
    method: str,
    layers: list[list[Weight]],
    downs: list | None,
    x: torch.Tensor,
    idxs: list[torch.Tensor],
    all_rows: torch.Tensor,
):
    """A callable running one FFN layer (copy i % len(layers)) with the given method."""

    def run(i: int) -> None:
        g, u, d = layers[i % len(layers)]
        idx = idxs[i % len(idxs)]
        if method in ("kernel", "torch"):
            with numerics.using(Numerics(native=method == "kernel")):
                h = glu_rows(x, g, u, idx, "reglu")
                d.gather_axpy(h, idx)
        elif method == "dense-k":
            h = torch.relu(g.linear(x[None])[0]) * u.linear(x[None])[0]
            d.gather_axpy(h, all_rows)
        elif downs is not None:  # dense torch, float
            xw = x.to(g.w.dtype)[None]
            h = torch.relu(F.linear(xw, g.w)) * F.linear(xw, u.w)
            F.linear(h, downs[i % len(downs)])
        else:  # dense torch, quantized: the fallback's tile dequantize + BLAS over all rows
            with numerics.using(Numerics(native=False)):
                h = torch.relu(g.linear(x[None])) * u.linear(x[None])
                d.gather_axpy(h[0], all_rows)

    return run


def bench_config(args: argparse.Namespace, shape: str, dtype: str, gen: torch.Generator) -> None:
    """All thread counts and k for one (shape, dtype): prints a row per (threads, k)."""
    n_embd, n_ff = SHAPES[shape]
    one = random_weight(n_ff, n_embd, dtype, gen)
    n_copies = min(args.max_copies, max(2, math.ceil(args.pool_gb * 1e9 / (3 * one.nbytes))))
    layers = [
        [one if i == 0 and j == 0 else random_weight(n_ff, n_embd, dtype, gen) for j in range(3)]
        for i in range(n_copies)
    ]
    downs = None
    if "dense" in args.methods and dtype in FLOAT:
        # contiguous (n_embd, n_ff) down copy for F.linear(h, W_down); f32 uses the view
        downs = [lay[2].w.t() if dtype == "f32" else lay[2].w.t().contiguous() for lay in layers]
    x = torch.randn(n_embd, generator=gen)
    all_rows = torch.arange(n_ff)
    for nt in args.threads:
        torch.set_num_threads(nt)
        for frac in args.k:
            k = max(1, round(frac * n_ff))
            idxs = [torch.randperm(n_ff, generator=gen)[:k].sort().values for _ in range(16)]
            touched = 3 * k * one.nbytes / n_ff
            res: dict[str, float] = {}
            for m in args.methods:
                if m.startswith("dense") and frac < 1.0 and 1.0 in args.k:
                    continue  # dense does not depend on k: reported once, at k=100%
                run = layer_fn(m, layers, downs, x, idxs, all_rows)
                res[m] = timed(run, args.iters, args.budget, args.stat)
            cells = []
            for m in args.methods:
                if m in res:
                    b = 3 * one.nbytes if m.startswith("dense") else touched
                    cells.append(f"{res[m] * 1e3:9.3f} {b / res[m] / 1e9:5.1f}")
                else:
                    cells.append(f"{'':9} {'':5}")
            ratio = ""
            if "kernel" in res and "torch" in res:
                ratio = f"torch/kernel {res['torch'] / res['kernel']:.1f}x"
            print(
                f"{shape:5} {dtype:5} {nt:2d} {frac * 100:4.0f} " + " ".join(cells) + "  " + ratio,
                flush=True,
            )
            _last[(shape, dtype, nt, frac)] = res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["1b", "7b"], choices=list(SHAPES))
    ap.add_argument(
        "--dtype", nargs="+", default=["f32", "f16", "q8_0", "q4_0"], choices=[*FLOAT, *QUANT]
    )
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--k", nargs="+", type=float, default=[0.1, 0.25, 1.0], help="k / n_ff")
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["kernel", "torch", "dense", "dense-k"],
        choices=["kernel", "torch", "dense", "dense-k"],
    )
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--budget", type=float, default=0.6, help="seconds per cell (soft)")
    ap.add_argument("--pool-gb", type=float, default=1.2, help="total bytes of layer copies")
    ap.add_argument("--max-copies", type=int, default=24)
    ap.add_argument(
        "--stat",
        default="median",
        choices=["median", "min"],
        help="min is robust when other processes share the CPU",
    )
    ap.add_argument("--prefetch", type=int, default=-1, help="kernel prefetch reach (bytes)")
    args = ap.parse_args(argv)

    lib = kernels.library()
    if lib is not None and args.prefetch >= 0:  # a build constant since ABI 27: its own build
        flags = (*kernels.DEFAULT_FLAGS, f"-DPP_PREFETCH_BYTES={args.prefetch}")
        lib = kernels._library = kernels.build(flags=flags)
    if lib is None:
        print("native kernels unavailable: only torch methods run")
        args.methods = [m for m in args.methods if m not in ("kernel", "dense-k")]
    else:
        print(f"kernels: {lib.simd}, {lib.path.name}")
    print(f"timing: {args.stat} of up to {args.iters} calls; ms per layer and GB/s of touched rows")
    gen = torch.Generator().manual_seed(0)
    head = " ".join(f"{m + ' ms':>9} {'GB/s':>5}" for m in args.methods)
    print(f"{'shape':5} {'dtype':5} {'T':>2} {'k%':>4} {head}  ratios")
    for shape in args.shape:
        for dtype in args.dtype:
            bench_config(args, shape, dtype, gen)
    _print_summary()
    return 0


_last: dict[tuple[str, str, int, float], dict[str, float]] = {}


def _print_summary() -> None:
    """Speedups of each sparse cell (k < 100%) over the dense runs of its configuration."""
    lines = []
    for (shape, dtype, nt, frac), res in _last.items():
        dense = _last.get((shape, dtype, nt, 1.0), {})
        if frac >= 1.0 or not dense:
            continue
        parts = []
        for m in ("kernel", "torch"):
            for ref in ("dense", "dense-k"):
                if m in res and ref in dense:
                    parts.append(f"{m} vs {ref} {dense[ref] / res[m]:.1f}x")
        if "kernel" in res and "torch" in res:
            parts.append(f"kernel vs torch {res['torch'] / res['kernel']:.1f}x")
        lines.append(f"  {shape} {dtype} {nt}T k={frac * 100:.0f}%: " + ", ".join(parts))
    if lines:
        print("speedups (time ratios):")
        print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
