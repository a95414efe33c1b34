"""Time the hot-neuron solver on a 70B-shaped problem (80 layers x 28672 neurons).

    python tools/bench_solver.py                      # batch 256 and 64, default thresholds
    python tools/bench_solver.py --batch 256 --threshold 512 --repeat 3

Statistics are synthetic power-law activation frequencies (Pareto, per-layer scale), which is
the shape PowerInfer's statistics have. The capacity defaults to 10% of all neurons, like
upstream's default (``int(n_ff * n_layer * 0.1)``). For each batch it times greedy (threshold
0, the default path), the exact DP and the PuLP/CBC ILP at a threshold that really binds the ILP
(default ``2 * batch``), and prints seconds (best of ``--repeat``) and whether CBC proved
optimality. Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from solver import solve


def power_law_stats(n_layer: int, n_ff: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        (rng.pareto(1.2, n_ff) * rng.uniform(0.5, 2.0)).astype(np.float32) for _ in range(n_layer)
    ]


def bench(
    stats: list[np.ndarray],
    capacity: int,
    batch: int,
    threshold: int,
    method: str,
    repeat: int,
    time_limit: float,
) -> tuple[float, bool, int, float]:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = solve(
            stats, capacity, batch=batch, threshold=threshold, method=method, time_limit=time_limit
        )
        best = min(best, time.perf_counter() - t0)
    return best, r.optimal, int(r.counts.sum()), r.mass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--neurons", type=int, default=28672)
    ap.add_argument("--batch", type=int, nargs="*", default=[256, 64])
    ap.add_argument("--threshold", type=int, default=None, help="ILP threshold (default 2*batch)")
    ap.add_argument("--capacity", type=int, default=None, help="default: 10%% of all neurons")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    stats = power_law_stats(args.layers, args.neurons, args.seed)
    capacity = args.capacity or int(args.neurons * args.layers * 0.1)
    print(f"{args.layers} layers x {args.neurons} neurons, capacity {capacity} neurons")
    print(f"{'batch':>5} {'method':>6} {'thresh':>6} {'seconds':>8} {'optimal':>7} {'neurons':>8}")
    for batch in args.batch:
        threshold = 2 * batch if args.threshold is None else args.threshold
        for method, thr in (("greedy", 0), ("dp", threshold), ("ilp", threshold)):
            sec, opt, n, _mass = bench(
                stats, capacity, batch, thr, method, args.repeat, args.time_limit
            )
            print(f"{batch:>5} {method:>6} {thr:>6} {sec:>8.3f} {opt!s:>7} {n:>8}")


if __name__ == "__main__":
    main()
