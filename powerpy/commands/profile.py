"""`powerpy profile`: per-neuron activation counts (activation_{i}.pt) and training samples."""

from __future__ import annotations

import argparse
import sys

from powerpy.commands.common import (
    add_model_args,
    add_plot_arg,
    add_profile_args,
    check_plot,
    load_model,
    save_plot,
    text_ids,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="count neuron activations on a text (input of gen-gpuidx, training data)"
    )
    add_model_args(p)
    add_profile_args(p, tokens=None)
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.add_argument(
        "--dump-samples",
        type=int,
        default=0,
        metavar="N",
        help="dump N tokens per layer of (ffn_inp, |h|) as fp16 .npy for training",
    )
    add_plot_arg(p, "the activation power law per layer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from powerpy.pipeline.profile import profile, write_profile

    check_plot(args)
    llm = load_model(args)
    ids = text_ids(llm, args)
    res = profile(
        llm.model,
        ids,
        ctx=args.ctx,
        max_tokens=args.tokens,
        target_sparsity=args.target_sparsity,
        dump_dir=args.output,
        dump_samples=args.dump_samples,
        seed=args.seed,
        progress=sys.stderr.isatty(),
        numerics=llm.options.numerics,
    )
    res.model = llm.name
    paths = write_profile(res, args.output)
    frac = res.active_fraction()
    print(
        f"profiled {res.n_tokens} tokens ({res.kind}): mean active {100 * frac.mean():.1f}% "
        f"(layers {100 * frac.min():.1f}-{100 * frac.max():.1f}%); wrote {len(paths)} files "
        f"to {args.output}" + (f", {res.n_samples} samples/layer" if res.n_samples else ""),
        file=sys.stderr,
    )
    if args.plot:
        from powerpy import plot

        save_plot(plot.power_law(res), args.plot)
    return 0
