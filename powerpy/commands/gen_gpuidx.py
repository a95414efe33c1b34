"""`powerpy gen-gpuidx`: solve the hot-neuron placement and write ``<model>.generated.gpuidx``.

Reads the model header only (never its weights), the activation statistics beside it, runs the
dense offload pass for the VRAM budget, turns what is left into a neuron capacity, solves, and
writes a PowerInfer-compatible index (``docs/formats.md#gpu-index-file``,
``docs/architecture.md#hybrid-placement``). The work is done by ``powerpy.placement``
(``Placement.for_model``, then ``solve.solve_placement``); this module parses arguments and
prints the placement's summary, the same one ``powerpy infer`` prints.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from powerpy.commands.common import add_plot_arg, check_plot, save_plot


def register(subparsers: Any) -> None:
    """Add the ``gen-gpuidx`` subcommand to the powerpy CLI."""
    p = subparsers.add_parser(
        "gen-gpuidx",
        help="solve the hot-neuron GPU placement and write <model>.generated.gpuidx",
        description=(
            "Solve which FFN neurons go to the GPU for a VRAM budget and write a "
            "PowerInfer-compatible .gpuidx (in process; no `python -m powerinfer`)."
        ),
    )
    p.add_argument("-m", "--model", required=True, help="PowerInfer model (.powerinfer.gguf)")
    p.add_argument(
        "--vram-budget",
        type=float,
        required=True,
        metavar="GIB",
        help="VRAM budget in GiB (negative: all free VRAM minus 256 MiB; needs CUDA)",
    )
    p.add_argument(
        "--activation", metavar="DIR", help="activation_{i}.pt directory (default: beside model)"
    )
    p.add_argument(
        "--ctx",
        type=int,
        default=None,
        help="KV cache positions (default: the training context, at most 4096, as infer)",
    )
    p.add_argument("--batch", type=int, default=256, help="group size in neurons")
    p.add_argument(
        "--threshold", type=int, default=0, help="smallest non-zero neuron count per layer"
    )
    p.add_argument(
        "--capacity-model",
        choices=("exact", "powerinfer"),
        default="exact",
        help="neurons per byte: exact row sizes, or PowerInfer's 4.5-factor formula (parity)",
    )
    p.add_argument(
        "--compat-lexicographic",
        action="store_true",
        help="pair statistics files with layers in string order, like upstream bug #247",
    )
    p.add_argument(
        "--tie-break",
        choices=("stable", "torch"),
        default="stable",
        help="equal statistics at the cut: lower index wins, or torch.topk's choice (upstream)",
    )
    p.add_argument(
        "--method", choices=("auto", "ilp", "greedy", "dp"), default="auto", help="solver"
    )
    p.add_argument("--output", "-o", help="output path (default: <model>.generated.gpuidx)")
    p.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit in seconds")
    p.add_argument("--memory-f32", action="store_true", help="f32 KV cache (4 bytes per value)")
    add_plot_arg(p, "GPU-served share of activations vs VRAM budget, this budget marked")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``gen-gpuidx``; returns the exit code (errors raise ValueError/FileNotFoundError)."""
    from powerpy.config import ModelArgs
    from powerpy.formats.constants import Keys
    from powerpy.formats.gguf_reader import read_gguf
    from powerpy.formats.gpuidx import default_gpuidx_path
    from powerpy.formats.stats import lexicographic_pairing, load_activation_stats
    from powerpy.placement.budget import budget_bytes
    from powerpy.placement.placement import Placement
    from powerpy.placement.reserve import DeviceReserve
    from powerpy.placement.solve import solve_placement

    model_path = Path(args.model)
    if not model_path.is_file():
        raise FileNotFoundError(f"model file not found: {model_path}")
    output = Path(args.output) if args.output else default_gpuidx_path(model_path)
    if output.exists() and os.path.samefile(output, model_path):
        raise ValueError(f"--output {output} is the model file; refusing to overwrite it")
    if (
        (args.ctx is not None and args.ctx <= 0)
        or args.batch <= 0
        or args.threshold < 0
        or args.time_limit <= 0
    ):
        raise ValueError("--ctx, --batch and --time-limit must be > 0 and --threshold >= 0")
    check_plot(args)
    free = None
    if args.vram_budget < 0:
        from powerpy.model.device import Accelerator  # CUDA, when there is one

        accel = Accelerator.choose(None)
        free = accel.free_memory() if accel is not None else None
    budget = budget_bytes(args.vram_budget, free)
    activation = Path(args.activation) if args.activation else model_path.parent / "activation"
    mode = "upstream" if args.capacity_model == "powerinfer" else "exact"

    with read_gguf(model_path) as model:
        arch = model.kv.get(Keys.ARCHITECTURE)
        margs = ModelArgs.from_gguf(model)
        args.ctx = args.ctx or margs.default_n_ctx
        # the budget is the placement's, as upstream's; what a CUDA run needs besides
        reserve_line = DeviceReserve.for_model(margs, args.ctx).describe()
        base = Placement.for_model(
            model, budget, n_ctx=args.ctx, kv_elem_bytes=4 if args.memory_f32 else 2
        )
    stats = load_activation_stats(activation, base.n_layer, base.n_ff)
    export = None
    if args.compat_lexicographic:
        export = [stats[k] for k in lexicographic_pairing(base.n_layer)]
    placement = solve_placement(
        base,
        stats,
        capacity_mode=mode,
        batch=args.batch,
        threshold=args.threshold,
        time_limit=args.time_limit,
        method=args.method,
        export_stats=export,
        tie_break=args.tie_break,
    )
    assert placement.index is not None
    placement.index.write(output)

    print(f"model      {model_path} ({arch}, {base.n_layer} layers, n_ff {base.n_ff})")
    print(f"statistics {activation}{' (lexicographic pairing)' if export else ''}")
    print(placement.summary())
    print(f"  {reserve_line}")
    print(f"wrote {output}")
    if args.plot:
        from powerpy import plot
        from powerpy.placement.coverage import coverage_curve

        with read_gguf(model_path) as model:
            curve = coverage_curve(
                model,
                stats,
                n_ctx=args.ctx,
                kv_elem_bytes=4 if args.memory_f32 else 2,
                batch=args.batch,
                include=(budget,),
                name=model_path.name,
            )
        save_plot(plot.coverage_vs_budget(curve, mark=budget), args.plot)
    return 0
