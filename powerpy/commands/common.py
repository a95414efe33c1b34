"""Options shared by the commands: loading a model (``add_model_args``), choosing a text
(``add_text_args``), profiling one (``add_profile_args``) and drawing the result (``--plot``)."""

from __future__ import annotations

import argparse
import math
import os
import sys

from powerpy.config import ACTIVATIONS

THRESHOLD_ENV = "LLAMA_SPARSE_PRED_THRESHOLD"  # --sparse-threshold's default, as PowerInfer's


def sparse_threshold(args: argparse.Namespace) -> float | None:
    """``--sparse-threshold``, else the environment variable ``LLAMA_SPARSE_PRED_THRESHOLD``,
    else None (the library then takes the file's key, then 0).

    Raises:
        ValueError: the environment variable is not a number.
    """
    if args.sparse_threshold is not None:
        return args.sparse_threshold
    env = os.environ.get(THRESHOLD_ENV, "").strip()
    if not env:
        return None
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"{THRESHOLD_ENV}={env!r} is not a number") from None
    if math.isnan(value) or value == math.inf:
        raise ValueError(
            f"{THRESHOLD_ENV}={env!r} {value} is not usable: give a finite number (or -inf)"
        )
    return value


def add_model_args(p: argparse.ArgumentParser, *, generate: bool = False) -> None:
    """The options that load a model: ``-m``, ``-t``, ``--sparse-threshold``, ``--cut-scale``,
    ``--ffn-act``, ``--exact-activations``, the KV cache types ``-ctk``/``-ctv`` and
    ``--mmap``/``--no-mmap``. ``generate``: also those of the commands that generate (infer,
    bench, serve): ``--dense``, ``--vram-budget``, ``--reset-gpu-index``,
    ``--disable-gpu-index`` and ``-ngl``. ``load_model`` reads them all."""
    p.add_argument("-m", "--model", help="model file (default: the sparse SmolLM2-135M)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (0: torch default)")
    p.add_argument(
        "--sparse-threshold",
        type=float,
        default=None,
        help=f"predictor threshold (default: the environment variable {THRESHOLD_ENV} when "
        "set, then the file's powerinfer.sparse_threshold, then 0)",
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
        choices=ACTIVATIONS,
        default=None,
        help="FFN activation when the file does not say it (a dense GGUF of a ReLU model, "
        "e.g. ReluLLaMA or ReluFalcon, needs relu; default: the family's dense one for GGUF "
        "(silu llama, gelu falcon), relu for PWRI)",
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
    if generate:
        _add_generate_args(p)


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dense", action="store_true", help="ignore the predictors (dense FFN)")
    p.add_argument(
        "--weight-format", choices=("auto", "f32", "raw"), default="auto", help=argparse.SUPPRESS
    )
    p.add_argument(
        "--vram-budget",
        type=float,
        default=None,
        metavar="GIB",
        help="PWRI: hybrid CPU-GPU placement within GIB of VRAM (negative: free VRAM - 256 MiB)",
    )
    p.add_argument(
        "-cmoe",
        "--cpu-moe",
        action="store_true",
        help="mixtures of experts: keep every expert on the CPU, the dense parts on the GPU "
        "(llama.cpp's -cmoe; without --vram-budget: the free VRAM)",
    )
    p.add_argument(
        "-ncmoe",
        "--n-cpu-moe",
        type=int,
        default=None,
        metavar="N",
        help="mixtures of experts: keep the experts of the first N layers on the CPU and the "
        "other layers' whole on the GPU, not by activation statistics (llama.cpp's -ncmoe)",
    )
    p.add_argument("--reset-gpu-index", action="store_true", help="regenerate the .gpuidx")
    p.add_argument("--disable-gpu-index", action="store_true", help="keep all FFN rows on CPU")
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run each decode step eagerly instead of replaying it as a captured CUDA graph",
    )
    p.add_argument(
        "--defer-cold",
        action="store_true",
        help="hybrid decode: add each layer's CPU rows to the residual stream one layer late, "
        "so the CPU works while the GPU runs the next layer (changes the output slightly)",
    )
    p.add_argument(  # dev/test: "cpu" emulates the accelerator on the CPU
        "--accel-device", default=None, help=argparse.SUPPRESS
    )
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="dense GGUF only")


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


def add_profile_args(
    p: argparse.ArgumentParser, *, tokens: int | None, from_samples: bool = False
) -> None:
    """The options of the commands that profile a model on a text (profile, train-predictors):
    ``--text FILE`` or ``--kjv [SPLIT]`` (default split: train), one of them required;
    ``--tokens`` (default ``tokens``; None: the whole text), ``--ctx``, ``--target-sparsity``
    and ``--seed``. ``from_samples``: ``--from-samples DIR`` (a sample dump of ``profile``) may
    replace the text."""
    g = add_text_args(p, file_flag="--text", kjv_default="train")
    if from_samples:
        g.add_argument("--from-samples", help="reuse a sample dump (DIR/samples of `profile`)")
    p.add_argument(
        "--tokens",
        type=int,
        default=tokens,
        help=f"tokens to profile (default: {'all' if tokens is None else tokens})",
    )
    p.add_argument("--ctx", type=int, default=256, help="profiling window length (default 256)")
    p.add_argument(
        "--target-sparsity",
        type=float,
        default=0.5,
        help="SiLU models: per-layer quantile of |h|·‖down‖ counted as inactive (default 0.5)",
    )
    p.add_argument("--seed", type=int, default=0)


def text_ids(llm, args: argparse.Namespace) -> list[int]:
    """Token ids (no BOS) of the text chosen by ``add_text_args``."""
    from powerpy.pipeline.corpus import corpus_text

    return llm.tokenize(corpus_text(args.text, args.kjv), add_bos=False)


def load_model(args: argparse.Namespace):
    """Load ``args.model`` (or the default model) with the options of ``add_model_args``."""
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
    llm = load(
        args.model,
        threshold=sparse_threshold(args),  # None: the file's key, then 0
        weight_format=getattr(args, "weight_format", "auto"),
        dense=getattr(args, "dense", False),
        ffn_act=args.ffn_act,
        cache_type=ctk,
        use_mmap=getattr(args, "mmap", False),
        cut_scale=cut_scale,
        exact_activations=getattr(args, "exact_activations", False),
        cuda_graphs=getattr(args, "cuda_graphs", True),
        defer_cold=getattr(args, "defer_cold", False),
        progress=sys.stderr.isatty(),
    )
    if llm.model.args.sparse and getattr(args, "n_gpu_layers", 0) > 0:
        raise ValueError(
            f"{llm.path}: -ngl/--n-gpu-layers is ignored by sparse (PWRI) models; "
            "use --vram-budget GiB to put hot neurons and dense parts on the GPU"
        )
    return llm


def wants_hybrid(args: argparse.Namespace) -> bool:
    """--vram-budget, --cpu-moe or --n-cpu-moe: the model is to be placed."""
    return args.vram_budget is not None or args.cpu_moe or args.n_cpu_moe is not None


def setup_hybrid(llm, args: argparse.Namespace, n_ctx: int) -> None:
    """--vram-budget (or --cpu-moe/--n-cpu-moe, within the free VRAM without it): place the
    model (docs/architecture.md#hybrid-placement) and print the placement summary to stderr."""
    from powerpy.placement.runtime import place

    n_cpu_moe = llm.model.args.n_layer if args.cpu_moe else args.n_cpu_moe
    llm.runtime = place(
        llm.model,
        llm.file,
        args.vram_budget if args.vram_budget is not None else -1.0,
        device=args.accel_device,
        n_ctx=n_ctx,
        reset_gpu_index=args.reset_gpu_index,
        disable_gpu_index=args.disable_gpu_index,
        n_cpu_moe=n_cpu_moe,
    )
    if llm.runtime is not None:
        llm.model = llm.runtime.model
        print(llm.runtime.summary(), file=sys.stderr)


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
