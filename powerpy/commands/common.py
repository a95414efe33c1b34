"""Options shared by the commands that load a model or read a text."""

from __future__ import annotations

import argparse
import sys

THRESHOLD_ENV = "LLAMA_SPARSE_PRED_THRESHOLD"


def add_load_args(p: argparse.ArgumentParser) -> None:
    """``-m``, ``-t``, ``--sparse-threshold``, ``--cut-scale``, ``--ffn-act``,
    ``--exact-activations``, the KV cache types ``-ctk``/``-ctv`` and ``--mmap``/``--no-mmap``."""
    p.add_argument("-m", "--model", help="model file (default: the sparse SmolLM2-135M)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (0: torch default)")
    p.add_argument(
        "--sparse-threshold",
        type=float,
        default=None,
        help=f"predictor threshold (default: env {THRESHOLD_ENV}, then the file's key, then 0)",
    )
    p.add_argument(
        "--cut-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="scale the file's per-layer FFN cuts (powerpy.ffn_down_threshold, sparse runs): "
        "0 turns them off, larger values skip more down rows (default 1: the file's)",
    )
    p.add_argument(
        "--ffn-act",
        choices=("relu", "silu"),
        default=None,
        help="FFN activation when the file does not say it (a dense GGUF of a ReLU model, "
        "e.g. ReluLLaMA, needs relu; default: silu for GGUF, relu for PWRI)",
    )
    p.add_argument(
        "--exact-activations",
        action="store_true",
        help="keep activations f32 in quantized matmuls, with float64 RoPE angles and torch's "
        "attention (default: llama.cpp's numerics: Q8 activation blocks with integer dot "
        "products, ggml's exp, RoPE and f16 attention steps)",
    )
    for flag, what in (("-ctk", "k"), ("-ctv", "v")):
        p.add_argument(
            flag,
            f"--cache-type-{what}",
            choices=("f16", "f32"),
            default="f16",
            help=f"KV cache type for {what.upper()} (default f16, as llama.cpp; -ctk and -ctv "
            "must match)",
        )
    p.add_argument(
        "--mmap",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="map the model file instead of reading it into memory (default: --no-mmap: the "
        "weights are read into 2 MiB transparent huge pages, which the sparse kernels' "
        "scattered row reads need; --mmap loads faster and shares the page cache)",
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
    from powerpy.pipeline.corpus import corpus_text

    return llm.tokenize(corpus_text(args.text, args.kjv), add_bos=False)


def load_model(args: argparse.Namespace):
    """Load ``args.model`` (or the default model) with the options of ``add_load_args``."""
    import torch

    from powerpy.api import load
    from powerpy.model.options import RunOptions

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    ctk, ctv = getattr(args, "cache_type_k", "f16"), getattr(args, "cache_type_v", "f16")
    if ctk != ctv:
        raise ValueError(
            f"-ctk {ctk} and -ctv {ctv} differ: powerpy keeps keys and values in one type, "
            "pass the same value to both"
        )
    cut_scale = getattr(args, "cut_scale", 1.0)
    try:
        RunOptions(cut_scale=cut_scale)  # its check, named by the flag
    except ValueError as e:
        raise ValueError(f"--cut-scale: {e}, e.g. 0 (no cut) or 1") from None
    return load(
        args.model,
        threshold=args.sparse_threshold,  # None: env LLAMA_SPARSE_PRED_THRESHOLD, file, 0
        weight_format=getattr(args, "weight_format", "auto"),
        dense=getattr(args, "dense", False),
        ffn_act=args.ffn_act,
        cache_type=ctk,
        use_mmap=getattr(args, "mmap", False),
        cut_scale=cut_scale,
        exact_activations=getattr(args, "exact_activations", False),
        progress=sys.stderr.isatty(),
    )


def add_plot_arg(p: argparse.ArgumentParser, what: str) -> None:
    """``--plot FILE.png``: also draw the result (needs the ``plot`` extra)."""
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help=f"also save a figure: {what} (.png, .pdf or .svg; needs powerpy[plot])",
    )


def check_plot(args: argparse.Namespace) -> None:
    """Fail before long work when ``--plot`` cannot be written or matplotlib is missing."""
    if getattr(args, "plot", None):
        from powerpy import plot

        plot.check_path(args.plot)
        if not plot.available():
            raise plot.PlotError("--plot needs matplotlib: pip install 'powerpy[plot]'")


def save_plot(fig, path: str) -> None:
    """Write a figure atomically and say where."""
    from powerpy import plot

    out = plot.save(fig, path)
    print(f"wrote plot {out}", file=sys.stderr)
