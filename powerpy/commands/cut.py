"""`powerpy cut`: a model's down-row cut in one command: a dense run over a calibration text sets
each layer's cut at a share of its neurons, and the PWRI file runs every layer ungated with it."""

from __future__ import annotations

import argparse
import sys

from powerpy.commands.common import add_model_args, add_text_args, load_model, text_ids


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cut",
        help="write a PWRI model that skips the FFN down rows of small contributions, its "
        "per-layer cuts set on a calibration text (any GLU model, no predictors)",
    )
    add_model_args(p)
    add_text_args(p, file_flag="--text", kjv_default="train")
    p.add_argument(
        "-s",
        "--share",
        type=float,
        default=0.4,
        help="share of each layer's down rows to skip on the calibration text: its cut is that "
        "quantile of |h_j|·‖ffn_down_t[j]‖ (default 0.4)",
    )
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    p.add_argument("--ctx", type=int, default=256, help="calibration window length (default 256)")
    p.add_argument("-o", "--outfile", required=True, help="output file (.powerinfer.gguf)")
    p.add_argument(
        "--outtype",
        choices=("f32", "f16", "q8_0", "q4_0", "q4_1", "auto"),
        default="auto",
        help="tensor type (default auto: the source's own types, blocks copied untouched)",
    )
    p.add_argument("--name", help="general.name (default: the source's)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from powerpy.pipeline.cut import down_cuts, write_cut_model

    llm = load_model(args)
    a = llm.model.args
    ids = text_ids(llm, args)
    src = args.text or f"KJV {args.kjv}"
    cuts = down_cuts(
        llm.model, ids, args.share, ctx=args.ctx, max_tokens=args.tokens,
        numerics=llm.options.numerics, progress=sys.stderr.isatty(),
    )  # fmt: skip
    how = {"cut_share": args.share, "cut_text": src, "cut_tokens": args.tokens}
    out = write_cut_model(
        llm.path, args.outfile, cuts, activation=a.ffn_variant.activation,
        outtype=args.outtype, name=args.name, extra=how, progress=sys.stderr.isatty(),
    )  # fmt: skip
    print(
        f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {a.n_layer} layers ungated, cuts "
        f"at {100 * args.share:g}% of {src}; see the trade-off with `powerpy perplexity -m "
        f"{out} -f TEXT --cut 0.75 1 1.25`",
        file=sys.stderr,
    )
    return 0
