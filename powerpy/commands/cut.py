"""`powerpy cut`: a model's down-row cut in one command: a dense run over a calibration text sets
each layer's cut at a share of its neurons. A dense GGUF becomes a PWRI file that runs every
layer ungated with it; a mixture of experts or a PWRI file is copied with the cuts added (its
predictors kept; a mixture of experts stays a GGUF llama.cpp reads)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from powerpy.commands.common import add_model_args, add_text_args, load_model, text_ids


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cut",
        help="write a model that skips the FFN down rows of small contributions, its per-layer "
        "cuts set on a calibration text (a dense GLU GGUF -> PWRI; a mixture of experts or a "
        "PWRI file -> a copy with the cuts)",
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
    p.add_argument(
        "-o",
        "--outfile",
        required=True,
        help="output file (.powerinfer.gguf for a dense GGUF; a copy's name otherwise)",
    )
    p.add_argument(
        "--outtype",
        choices=("f32", "f16", "q8_0", "q4_0", "q4_1", "auto"),
        default="auto",
        help="a dense GGUF's tensor type (default auto: the source's own types, blocks copied "
        "untouched; a copy keeps them always)",
    )
    p.add_argument("--name", help="general.name (default: the source's)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from powerpy.pipeline.cut import down_cuts, write_cut, write_cut_model

    llm = load_model(args)
    a = llm.model.args
    copy = a.sparse or a.moe  # the file has a sparse mode already: it takes the key
    if copy and (args.outtype != "auto" or args.name):
        raise ValueError(
            "--outtype and --name apply to a dense GGUF written as PWRI; a mixture of experts "
            "or a PWRI file is copied with its types and name"
        )
    if Path(args.outfile).resolve() == Path(llm.path).resolve():
        raise ValueError(f"{args.outfile}: write the cut to a new file, not over the model")
    ids = text_ids(llm, args)
    src = args.text or f"KJV {args.kjv}"
    cuts = down_cuts(
        llm.model,
        ids,
        args.share,
        ctx=args.ctx,
        max_tokens=args.tokens,
        numerics=llm.options.numerics,
        progress=sys.stderr.isatty(),
    )
    if copy:
        out = write_cut(llm.path, args.outfile, cuts, progress=sys.stderr.isatty())
        what = "a copy with per-layer cuts"
    else:
        how = {"cut_share": args.share, "cut_text": src, "cut_tokens": args.tokens}
        out = write_cut_model(
            llm.path,
            args.outfile,
            cuts,
            activation=a.ffn_variant.activation,
            outtype=args.outtype,
            name=args.name,
            extra=how,
            progress=sys.stderr.isatty(),
        )
        what = f"{a.n_layer} layers ungated"
    print(
        f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {what}, cuts at "
        f"{100 * args.share:g}% of {src}'s computed neurons; see the trade-off with "
        f"`powerpy perplexity -m {out} -f TEXT --cut 0.75 1 1.25`",
        file=sys.stderr,
    )
    return 0
