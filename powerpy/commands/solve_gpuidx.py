"""``python -m solver``: a drop-in for upstream's ``python -m powerinfer``
(docs/architecture.md#solver).

    python -m solver --activation DIR --neuron 11008 --capacity 539288 --layer 32 \\
        --vram-capacity 13357166592 --output model.generated.gpuidx

Same arguments and defaults as upstream (``--batch 256 --threshold 0``), same output file
(docs/formats.md#gpu-index-file), byte for byte. Differences, all deliberate:

- statistics are paired with layers in numeric order; ``--compat-lexicographic`` reproduces
  upstream bug #247 for the export step;
- exactly ``activation_0.pt … activation_{layer-1}.pt`` must exist (missing or extra files are a
  one-line error instead of a crash or a silent mismatch);
- ties at the cut follow ``torch.topk`` as upstream (``--tie-break torch``, the default here);
- an ILP that cannot prove optimality in ``--time-limit`` seconds falls back to its best
  feasible point with a warning instead of crashing.

``solver/__main__.py`` is a shim calling :func:`main`, so the ``solver`` package itself imports
neither torch nor powerpy. Reading ``activation_{i}.pt`` needs torch: ``main()`` imports
``powerpy.formats.stats`` lazily, so importing this module stays light. The solving is
``powerpy.placement.solve.solve_index``, the same code ``powerpy gen-gpuidx`` runs. Not a
``powerpy`` subcommand: it keeps upstream's argument names and defaults.
"""

from __future__ import annotations

import argparse
import logging
import sys

UPSTREAM_DEFAULT_NEURON = 32768
UPSTREAM_DEFAULT_CAPACITY = int(32768 * 32 * 0.1)  # 104857, upstream's default
UPSTREAM_DEFAULT_LAYER = 59


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (upstream's arguments plus powerpy's extras)."""
    p = argparse.ArgumentParser(
        prog="python -m solver",
        description="Solve the hot-neuron GPU split and write a PowerInfer .gpuidx file.",
    )
    p.add_argument("--activation", required=True, help="directory of activation_{i}.pt")
    p.add_argument(
        "--neuron", type=int, default=UPSTREAM_DEFAULT_NEURON, help="n_ff (neurons per layer)"
    )
    p.add_argument(
        "--capacity",
        type=int,
        default=UPSTREAM_DEFAULT_CAPACITY,
        help="most GPU neurons, summed over all layers",
    )
    p.add_argument("--layer", type=int, default=UPSTREAM_DEFAULT_LAYER, help="n_layer")
    p.add_argument(
        "--vram-capacity", type=int, default=None, help="bytes, written to split.vram_capacity"
    )
    p.add_argument("--batch", type=int, default=256, help="group size in neurons")
    p.add_argument(
        "--threshold", type=int, default=0, help="smallest non-zero neuron count per layer"
    )
    p.add_argument("--output", required=True, help="output .gpuidx path")
    # powerpy extras
    p.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit in seconds")
    p.add_argument("--method", choices=("auto", "ilp", "greedy", "dp"), default="auto")
    p.add_argument(
        "--compat-lexicographic",
        action="store_true",
        help="pair statistics files with layers in string order for the export (bug #247)",
    )
    p.add_argument(
        "--tie-break",
        choices=("torch", "stable"),
        default="torch",
        help="equal statistics at the cut: torch.topk's choice (upstream) or lower index first",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the solver CLI.

    Args:
        argv: arguments (default ``sys.argv[1:]``).

    Returns:
        0 on success, 1 on a reported error, 2 on a usage error.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.vram_capacity is None:
        parser.error("--vram-capacity is required (it is written into split.vram_capacity)")
    if args.vram_capacity < 0:
        parser.error(f"--vram-capacity must be >= 0 bytes, got {args.vram_capacity}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    try:
        return _run(args)
    except (ValueError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        print(f"python -m solver: error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    # torch enters here, through powerpy.formats.stats
    from powerpy.formats.stats import lexicographic_pairing, load_activation_stats
    from powerpy.placement.solve import solve_index

    stats = load_activation_stats(args.activation, args.layer, args.neuron)
    export = None
    if args.compat_lexicographic:
        export = [stats[k] for k in lexicographic_pairing(args.layer)]
    index, result = solve_index(
        stats,
        args.capacity,
        vram_capacity=args.vram_capacity,
        block_count=args.layer,
        batch=args.batch,
        threshold=args.threshold,
        time_limit=args.time_limit,
        method=args.method,
        export_stats=export,
        tie_break=args.tie_break,
    )
    index.write(args.output)
    total = int(result.counts.sum())
    print(
        f"{args.layer} layers, {total} of {args.capacity} neurons on the GPU "
        f"({result.method}{'' if result.optimal else ', not proven optimal'}, "
        f"{result.seconds:.3f} s)"
    )
    print("counts: " + " ".join(str(int(k)) for k in result.counts))
    print(f"wrote {args.output}")
    return 0
