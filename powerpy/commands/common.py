"""Options shared by the commands that load a model or read a text."""

from __future__ import annotations

import argparse
import os
import sys

THRESHOLD_ENV = "LLAMA_SPARSE_PRED_THRESHOLD"


def add_load_args(p: argparse.ArgumentParser) -> None:
    """``-m``, ``-t``, ``--sparse-threshold`` and ``--ffn-act``."""
    p.add_argument("-m", "--model", help="model file (default: the sparse SmolLM2-135M)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (0: torch default)")
    p.add_argument(
        "--sparse-threshold",
        type=float,
        default=None,
        help=f"predictor threshold (default: env {THRESHOLD_ENV}, then the file's key, then 0)",
    )
    p.add_argument(
        "--ffn-act",
        choices=("relu", "silu"),
        default=None,
        help="FFN activation when the file does not say it (a dense GGUF of a ReLU model, "
        "e.g. ReluLLaMA, needs relu; default: silu for GGUF, relu for PWRI)",
    )


def add_text_args(
    p: argparse.ArgumentParser, *, file_flag: str, kjv_default: str
) -> argparse._MutuallyExclusiveGroup:
    """``FILE_FLAG FILE`` or ``--kjv [SPLIT]``: one of them is required; returns the group."""
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument(*file_flag.split("|"), dest="text", help="UTF-8 text file")
    g.add_argument(
        "--kjv",
        nargs="?",
        const=kjv_default,
        choices=("train", "heldout", "all"),
        help=f"the KJV Bible (split: train = Genesis-Philemon, heldout = Hebrews-Revelation; "
        f"default {kjv_default})",
    )
    return g


def text_ids(llm, args: argparse.Namespace) -> list[int]:
    """Token ids (no BOS) of the text chosen by ``add_text_args``."""
    from powerpy.corpus import corpus_text

    return llm.tokenize(corpus_text(args.text, args.kjv), add_bos=False)


def threshold_from(args: argparse.Namespace) -> float | None:
    """CLI flag > env LLAMA_SPARSE_PRED_THRESHOLD > the file's key (None)."""
    if args.sparse_threshold is not None:
        return args.sparse_threshold
    env = os.environ.get(THRESHOLD_ENV)
    if env is None or env.strip() == "":
        return None
    try:
        return float(env)
    except ValueError:
        raise ValueError(f"{THRESHOLD_ENV}={env!r} is not a number") from None


def load_model(args: argparse.Namespace):
    """Load ``args.model`` (or the default model) with the options of ``add_load_args``."""
    import torch

    from powerpy.api import load

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return load(
        args.model,
        threshold=threshold_from(args),
        weight_format=getattr(args, "weight_format", "auto"),
        ffn_act=args.ffn_act,
        progress=sys.stderr.isatty(),
    )
