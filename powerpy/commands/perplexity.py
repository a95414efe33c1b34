"""`powerpy perplexity`: llama.cpp-style perplexity, dense and sparse side by side, or the
sparsity trade-off threshold by threshold (``--sweep``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from powerpy.commands.common import (
    add_model_args,
    add_plot_arg,
    add_text_args,
    check_plot,
    load_model,
    save_plot,
    text_ids,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "perplexity",
        help="perplexity of a text (llama.cpp method); PWRI models: dense and sparse side by side",
    )
    add_model_args(p)
    add_text_args(p, file_flag="-f|--file", kjv_default="heldout")
    p.add_argument("-c", "--ctx", type=int, default=512, help="chunk length (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--dense", action="store_true", help="run the dense FFN only")
    which.add_argument(
        "--sparse-only", action="store_true", help="PWRI models: skip the dense reference run"
    )
    which.add_argument("--dense-too", action="store_true", help=argparse.SUPPRESS)  # the default
    which.add_argument(
        "--sweep",
        nargs="*",
        type=float,
        metavar="T",
        help="PWRI models: the trade-off table, one pass per predictor threshold (skipped "
        "share, PPL, change vs dense); default thresholds -3 -2 -1 -0.5 0 0.5 1 2",
    )
    p.add_argument(
        "--oracle",
        nargs="+",
        type=float,
        metavar="S",
        help="also sweep an oracle that keeps each token's top neurons (by |h|·‖down‖) at "
        "these skipped shares, e.g. 0.2 0.5 0.8: the best any predictor could do",
    )
    p.add_argument(
        "--cut",
        nargs="+",
        type=float,
        metavar="S",
        help="also sweep the file's per-layer cuts (powerpy.ffn_down_threshold) scaled by these "
        "factors, e.g. 0.5 1 2 (1: the file's point; larger skips more)",
    )
    add_plot_arg(p, "perplexity increase vs skipped share (the sweep, or dense vs sparse)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    from powerpy.model.options import DENSE, RunOptions
    from powerpy.pipeline.perplexity import perplexity

    thresholds = args.sweep or None  # --sweep alone: the default thresholds
    if any(t != t for t in thresholds or ()):
        raise ValueError("--sweep: a threshold is NaN; give numbers such as -1 0 1")
    bad = [s for s in args.oracle or () if not 0.0 <= s < 1.0]
    if bad:
        raise ValueError(f"--oracle {bad[0]:g}: skipped shares must be in [0, 1), e.g. 0.5")
    for s in args.cut or ():
        try:
            RunOptions(cut_scale=s)
        except ValueError as e:
            raise ValueError(f"--cut: {e}, e.g. 0.5 1 2") from None
    check_plot(args)
    llm = load_model(args)
    model = llm.model
    ids = text_ids(llm, args)
    bos = llm.tokenizer.bos_id if llm.tokenizer.add_bos else None
    src = args.text or f"KJV {args.kjv}"
    print(
        f"model: {llm.path.name} | text: {src}, {len(ids)} tokens | ctx {args.ctx}",
        file=sys.stderr,
    )
    kw = dict(ctx=args.ctx, chunks=args.chunks, bos_id=bos, progress=sys.stderr.isatty())
    if args.sweep is not None or args.oracle or args.cut:
        return _sweeps(args, llm, ids, thresholds, kw)
    results = []
    sparse_ok = model.can_gate and not args.dense
    if args.dense or not args.sparse_only or not sparse_ok:
        dense = dataclasses.replace(DENSE, numerics=llm.options.numerics)
        results.append(("dense", perplexity(model, ids, desc="dense", opts=dense, **kw)))
    if sparse_ok:
        sparse = dataclasses.replace(llm.options, sparse=True)
        results.append(("sparse", perplexity(model, ids, desc="sparse", opts=sparse, **kw)))
    base = results[0][1].ppl
    print(f"{'run':<8}{'PPL':>10}{'vs dense':>10}{'skipped':>10}  chunks x scored")
    for label, r in results:
        rel = f"{100 * (r.ppl / base - 1):+.2f}%" if results[0][0] == "dense" else "-"
        skip = f"{100 * r.sparsity:.1f}%" if r.sparsity is not None else "-"
        per = r.n_scored // r.n_chunks
        print(f"{label:<8}{r.ppl:>10.4f}{rel:>10}{skip:>10}  {r.n_chunks} x {per}")
    if args.plot:
        if len(results) < 2:
            raise ValueError("--plot needs the dense and the sparse run (a PWRI model)")
        from powerpy import plot
        from powerpy.pipeline.sweep import SweepPoint, SweepResult

        d, s = results[0][1], results[1][1]
        point = SweepPoint(llm.options.threshold, s.ppl, s.sparsity or 0.0, s.ppl / d.ppl - 1)
        sweep = SweepResult(llm.name, "predictors", d.ppl, [point], d.n_scored, d.ctx, d.n_chunks)
        save_plot(plot.tradeoff(sweep), args.plot)
    return 0


def _sweeps(args: argparse.Namespace, llm, ids: list[int], thresholds, kw: dict) -> int:
    from powerpy.model.options import DENSE
    from powerpy.pipeline import sweep
    from powerpy.pipeline.perplexity import perplexity

    model = llm.model
    if args.sweep is not None and not model.can_gate:
        raise ValueError(f"--sweep needs a PWRI model with predictors; {llm.path} is dense")
    opts = dataclasses.replace(DENSE, numerics=llm.options.numerics)
    dense = perplexity(model, ids, desc="dense", opts=opts, **kw)
    kw = {**kw, "numerics": llm.options.numerics}  # the sweeps' runs compute as the dense one
    results = []
    if args.sweep is not None:
        ts = thresholds or sweep.DEFAULT_THRESHOLDS
        results.append(sweep.sparsity_sweep(model, ids, ts, name=llm.name, dense=dense, **kw))
    if args.oracle:
        results.append(
            sweep.oracle_sweep(model, ids, args.oracle, name=llm.name, dense=dense, **kw)
        )
    if args.cut:
        results.append(sweep.cut_sweep(model, ids, args.cut, name=llm.name, dense=dense, **kw))
    for i, r in enumerate(results):
        print(("\n" if i else "") + r.table())
    if args.plot:
        from powerpy import plot

        save_plot(plot.tradeoff(*results), args.plot)
    return 0
