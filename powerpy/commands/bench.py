"""`powerpy bench`: llama-bench-style speed table, dense vs sparse, with bytes and bandwidth."""

from __future__ import annotations

import argparse
import json
import sys

from powerpy.commands.infer import add_model_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure prompt and generation speed (llama-bench style)")
    add_model_args(p)
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (pp test)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (tg test)")
    p.add_argument("-r", "--repetitions", type=int, default=1, help="best of N runs")
    p.add_argument("--sparse-only", action="store_true", help="skip the dense comparison")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from powerpy.bench import bench_mode, dispatch_overhead_ms, measure_bandwidth
    from powerpy.commands.infer import load_from_args

    llm = load_from_args(args)
    model, sparse_ok = llm.model, llm.model.can_gate
    modes = ["dense"] if args.dense or not sparse_ok else ["sparse"]
    if sparse_ok and not args.dense and not args.sparse_only:
        modes.append("dense")
    bw = measure_bandwidth()
    rows = []
    bos = llm.tokenizer.bos_id or 0
    for mode in modes:
        rows += bench_mode(
            model,
            mode,
            args.n_prompt,
            args.n_gen,
            bw,
            args.repetitions,
            threshold=llm.options.threshold,
            first_token=bos,
        )
    floor = dispatch_overhead_ms(model, modes[0] == "sparse") if args.n_gen > 0 else 0.0
    size_gb = llm.path.stat().st_size / 1e9
    if args.json:
        out = {
            "model": str(llm.path),
            "size_gb": size_gb,
            "threads": torch.get_num_threads(),
            "bandwidth_gb_s": bw,
            "python_overhead_ms_per_token": floor,
            "rows": [r.to_dict() for r in rows],
        }
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    a = llm.model.args
    print(
        f"model {llm.path.name}: {a.arch}, {a.n_layer} layers, {size_gb:.2f} GB, "
        f"threads {torch.get_num_threads()}, measured read bandwidth {bw:.1f} GB/s"
    )
    print(
        f"| {'mode':6} | {'test':6} | {'t/s':>9} | {'active':>6} | {'MB/token':>9} | "
        f"{'GB/s':>6} | {'of BW':>6} |"
    )
    print("|" + "|".join("-" * w for w in (8, 8, 11, 8, 11, 8, 8)) + "|")
    for r in rows:
        tg = r.test.startswith("tg")
        print(
            f"| {r.mode:6} | {r.test:6} | {r.tok_s:9.2f} | "
            + (f"{100 * r.active_fraction:5.1f}% | " if tg else f"{'':6} | ")
            + (
                f"{r.bytes_per_token / 1e6:9.1f} | {r.gb_s:6.2f} | {100 * r.ceiling_share:5.1f}% |"
                if tg
                else f"{'':9} | {'':6} | {'':6} |"
            )
        )
    tg_rows = [r for r in rows if r.test.startswith("tg")]
    if len(tg_rows) == 2:
        s, d = tg_rows
        print(f"sparse/dense tg speed: {s.tok_s / d.tok_s:.2f}x")
    for r in tg_rows:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r.phases_ms.items()))
        print(f"{r.mode} tg ms/token: {parts}")
    if tg_rows:
        print(f"python/dispatch floor (same depth, tiny matrices): {floor:.2f} ms/token")
    return 0
