"""`powerpy bench`: llama-bench-style speed table, dense vs sparse, with bytes and bandwidth."""

from __future__ import annotations

import argparse
import json
import sys

from powerpy.commands.common import (
    add_model_args,
    add_plot_arg,
    check_plot,
    load_model,
    save_plot,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure prompt and generation speed (llama-bench style)")
    add_model_args(p, generate=True)
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (pp test)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (tg test)")
    p.add_argument(
        "-r",
        "--repetitions",
        type=int,
        default=1,
        help="rounds: each mode runs once per round, in turn; a row is its best run",
    )
    p.add_argument("--sparse-only", action="store_true", help="skip the dense comparison")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_plot_arg(p, "ms per token by phase, sparse vs dense")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from powerpy.benchmark import run_bench

    check_plot(args)
    llm = load_model(args)
    sparse_ok = llm.model.can_gate
    modes = ["dense"] if args.dense or not sparse_ok else ["sparse"]
    if sparse_ok and not args.dense and not args.sparse_only:
        modes.append("dense")
    res = run_bench(
        llm.model,
        name=llm.name,
        n_prompt=args.n_prompt,
        n_gen=args.n_gen,
        repetitions=args.repetitions,
        modes=tuple(modes),
        threshold=llm.options.threshold,
        cut_scale=llm.options.cut_scale,
        first_token=llm.tokenizer.bos_id or 0,
        size_bytes=llm.path.stat().st_size,
        numerics=llm.options.numerics,
    )
    if args.json:
        json.dump({**res.to_dict(), "model": str(llm.path)}, sys.stdout, indent=2)
        print()
    else:
        a = llm.model.args
        print(
            f"model {llm.path.name}: {a.arch}, {a.n_layer} layers, {res.size_bytes / 1e9:.2f} "
            f"GB, threads {res.threads}, measured read bandwidth {res.bandwidth_gb_s:.1f} GB/s"
            + (f" (probes {min(res.probes):.1f}-{max(res.probes):.1f})" if res.probes else "")
        )
        print(res.table())
    if args.plot:
        from powerpy import plot

        save_plot(plot.phases(res), args.plot)
    return 0
