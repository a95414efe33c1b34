"""`powerpy perplexity`: llama.cpp-style perplexity, dense and sparse side by side."""

from __future__ import annotations

import argparse
import sys

from powerpy.commands.common import add_load_args, add_text_args, load_model, text_ids


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "perplexity",
        help="perplexity of a text (llama.cpp method); PWRI models: dense and sparse side by side",
    )
    add_load_args(p)
    add_text_args(p, file_flag="-f|--file", kjv_default="heldout")
    p.add_argument("-c", "--ctx", type=int, default=512, help="chunk length (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--dense", action="store_true", help="run the dense FFN only")
    which.add_argument(
        "--sparse-only", action="store_true", help="PWRI models: skip the dense reference run"
    )
    which.add_argument("--dense-too", action="store_true", help=argparse.SUPPRESS)  # the default
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from powerpy.model.options import DENSE
    from powerpy.pipeline.perplexity import perplexity

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
    results = []
    sparse_ok = model.can_gate and not args.dense
    if args.dense or not args.sparse_only or not sparse_ok:
        results.append(("dense", perplexity(model, ids, desc="dense", opts=DENSE, **kw)))
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
    return 0
