"""Paired A/B speed of two powerpy checkouts on one model: `powerpy bench --json` of each, back
to back, in alternating order, for several rounds; prints per-row medians and the median of
the per-round ratios (new / base).

    git worktree add /tmp/base REV
    python tools/bench_ab.py --base /tmp/base --new . -m MODEL.gguf -t 2 -p 128 -n 32 \\
        --rounds 5 --reps 2

Each checkout builds its own native kernels (the cache key hashes the sources). On a machine
that drifts, read the per-round ratios, not the absolute numbers; "floor" is the per-token
Python/dispatch floor (``powerpy bench``'s tiny model of the same depth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def bench(checkout: Path, args: argparse.Namespace) -> dict[str, float]:
    """One ``powerpy bench --json`` run of ``checkout``: {row: tok/s}."""
    env = dict(os.environ, PYTHONPATH=str(checkout.resolve()), OMP_WAIT_POLICY="passive")
    cmd = [
        sys.executable,
        "-m",
        "powerpy",
        "bench",
        "--json",
        "-t",
        str(args.threads),
        "-p",
        str(args.prompt),
        "-n",
        str(args.gen),
        "-r",
        str(args.reps),
    ]
    if args.model:
        cmd += ["-m", str(Path(args.model).resolve())]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/")
    if res.returncode:
        raise SystemExit(f"{checkout}: {res.stderr[-2000:]}")
    d = json.loads(res.stdout)
    out = {f"{r['mode']} {r['test']}": r["tok_s"] for r in d["rows"]}
    if d.get("python_overhead_ms_per_token"):
        out["floor"] = 1e3 / d["python_overhead_ms_per_token"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="checkout measured as the base")
    ap.add_argument("--new", type=Path, default=Path("."), help="checkout compared with it")
    ap.add_argument("-m", "--model", help="model file (default: the default model)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--prompt", type=int, default=128, help="pp tokens (0: none)")
    ap.add_argument("-n", "--gen", type=int, default=32, help="tg tokens (0: none)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=1, help="best of this many runs inside a bench")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for r in range(args.rounds):
        order = ("base", "new") if r % 2 == 0 else ("new", "base")
        for which in order:
            print(f"round {r + 1}/{args.rounds}: {which}", file=sys.stderr, flush=True)
            runs[which].append(bench(getattr(args, which), args))
    print(f"model {args.model or 'default'}, {args.threads} threads, {args.rounds} rounds")
    for row in runs["base"][0]:
        a = [x[row] for x in runs["base"]]
        b = [x[row] for x in runs["new"]]
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        print(
            f"  {row:14s} base {statistics.median(a):9.2f}  new {statistics.median(b):9.2f} "
            f"tok/s  new/base {statistics.median(ratios):.3f}  "
            f"(rounds {' '.join(f'{q:.3f}' for q in ratios)})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
