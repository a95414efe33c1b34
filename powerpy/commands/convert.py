"""`powerpy convert`: HF checkpoint or dense GGUF + predictors -> PowerInfer (PWRI) model file."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="build a PowerInfer (PWRI) model from an HF checkpoint or a dense GGUF + predictors",
    )
    p.add_argument(
        "src", help="HF checkpoint directory (LLaMA, Mistral, Falcon, OPT), or a dense GGUF file"
    )
    p.add_argument(
        "predictor_dir",
        nargs="?",
        help="directory with model_{i}.pt (+ optional config.json); without it an HF "
        "checkpoint becomes a dense GGUF (to profile and train predictors on)",
    )
    p.add_argument(
        "-o", "--outfile", required=True, help="output file (.powerinfer.gguf, or .gguf when dense)"
    )
    p.add_argument(
        "--outtype",
        choices=("f32", "f16", "q8_0", "q4_0", "q4_1", "auto"),
        default="f16",
        help="tensor type (auto: a GGUF source's own types, blocks copied untouched)",
    )
    p.add_argument("--vocab-gguf", help="copy the tokenizer from this GGUF (HF sources)")
    p.add_argument(
        "--vocab-pre",
        help="tokenizer.ggml.pre for a BPE vocab (default: the family's: default, falcon, gpt-2)",
    )
    p.add_argument(
        "--activation",
        choices=("relu", "silu", "gelu"),
        help="override the predictors' sparse_activation (default: their config.json)",
    )
    p.add_argument("--name", help="general.name (default: the source's)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from powerpy.pipeline.convert import convert

    out = convert(
        args.src,
        args.predictor_dir,
        args.outfile,
        outtype=args.outtype,
        vocab_gguf=args.vocab_gguf,
        vocab_pre=args.vocab_pre,
        activation=args.activation,
        name=args.name,
        progress=sys.stderr.isatty(),
    )
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)
    return 0
