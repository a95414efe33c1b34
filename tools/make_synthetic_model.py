"""Write a synthetic PowerInfer (PWRI) model (llama, falcon or opt) with random weights and
working predictors.

A thin command line over ``powerpy.testing.synthetic.write_synthetic_model``, which documents
how the sparsity is made. Shapes: llama tiny, 1b (TinyLlama), 7b (LLaMA-2); falcon tiny
(multi-query), 1b (2048/8192, 24 layers, 32 heads, 4 kv heads, attn_norm_2); opt tiny, 1b
(OPT-1.3B).

Examples:
    python tools/make_synthetic_model.py --shape tiny --dtype f16 -o /tmp/tiny/model.powerinfer.gguf
    python tools/make_synthetic_model.py --shape 7b --dtype q4_0 --powerlaw --layers 2 \\
        -o /tmp/m.gguf
    python tools/make_synthetic_model.py --arch falcon --shape 1b --dtype q4_0 --powerlaw \\
        -o /tmp/falcon/model.powerinfer.gguf
"""

from __future__ import annotations

import argparse
import logging

from powerpy.testing.synthetic import ARCH_SHAPES, ARCHS, DTYPES, write_synthetic_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=ARCHS, default="llama", help="model family")
    shapes = sorted({name for table in ARCH_SHAPES.values() for name in table})
    ap.add_argument("--shape", choices=shapes, default="tiny", help="(per --arch)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="f16")
    ap.add_argument("--active", type=float, default=0.10, help="mean active fraction per token")
    ap.add_argument("--powerlaw", action="store_true", help="power-law hot neurons")
    ap.add_argument(
        "--alpha",
        type=float,
        default=1.4,
        help="power-law exponent (1.4: the top 20%% of neurons get ~80%% of activations)",
    )
    ap.add_argument("--layers", type=int, help="override the layer count")
    ap.add_argument("--hidden", type=int, help="predictor hidden size H (default per shape)")
    ap.add_argument("--predictor-dtype", choices=list(DTYPES), help="default: as --dtype")
    ap.add_argument(
        "--predictor-noise",
        type=float,
        default=0.2,
        help="relative std of the gate part the predictor cannot see (0: exact predictor)",
    )
    ap.add_argument("--threshold", type=float, help="write powerinfer.sparse_threshold")
    ap.add_argument("--calib-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-stats", action="store_true", help="skip activation/activation_*.pt")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    if not 0.0 < args.active < 1.0:
        ap.error(f"--active must be in (0, 1), got {args.active}")
    if args.shape not in ARCH_SHAPES[args.arch]:
        ap.error(f"--arch {args.arch} has shapes {', '.join(ARCH_SHAPES[args.arch])}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kw = {k: v for k, v in vars(args).items() if k not in ("output", "no_stats")}
    try:
        write_synthetic_model(args.output, **kw, stats=not args.no_stats)
    except ValueError as e:
        raise SystemExit(f"make_synthetic_model: {e}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
