"""`powerpy train-predictors`: profile a model and train one predictor per layer
(docs/architecture.md#predictor-training)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    p = sub.add_parser("train-predictors", help="train activation predictors (model_{i}.pt)")
    add_model_args(p)
    add_profile_args(p, tokens=100_000, from_samples=True)
    p.add_argument("-o", "--output", required=True, help="predictor directory")
    hid = p.add_mutually_exclusive_group()
    hid.add_argument("--hidden", type=int, default=128, help="predictor hidden size H")
    hid.add_argument(
        "--auto-hidden", action="store_true", help="smallest H per layer reaching --recall-target"
    )
    p.add_argument("--recall-target", type=float, default=0.9, help="for --auto-hidden")
    p.add_argument("--samples", type=int, default=None, help="samples/layer (default: all)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--threshold", type=float, default=0.0, help="runtime predictor threshold")
    p.add_argument(
        "--skip-fraction",
        type=float,
        default=None,
        help="calibrate per-layer operating points for this mean fraction of skipped neurons "
        "(folded into fc2; the global threshold becomes --calibration-threshold)",
    )
    p.add_argument("--calibration-threshold", type=float, default=-1.0, help=argparse.SUPPRESS)
    p.add_argument(
        "--predictor-cost",
        type=float,
        default=None,
        metavar="C",
        help="with --skip-fraction: a predictor's decode time in units of its layer's dense FFN "
        "(measure it with powerpy bench); layers whose predictor does not pay then run dense "
        "(powerpy.dense_layers) and --skip-fraction counts the time saved net of the predictors",
    )
    p.add_argument(
        "--calibrate-from",
        metavar="PRED_DIR",
        help="with --from-samples and --skip-fraction: only calibrate these trained predictors",
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="also write OUTPUT/predictors.q8.safetensors (int8 rows, for shipping)",
    )
    p.add_argument("--work-dir", help="keep the sample dump here (default: temporary)")
    add_plot_arg(p, "recall, precision and predicted vs true active share per layer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from powerpy.pipeline.train import TrainOptions, train_from_samples, train_predictors

    opts = TrainOptions(
        hidden=args.hidden,
        auto_hidden=args.auto_hidden,
        recall_target=args.recall_target,
        epochs=args.epochs,
        patience=args.patience,
        threshold=args.threshold,
        seed=args.seed,
    )
    progress = sys.stderr.isatty()
    check_plot(args)

    def show(r) -> None:
        print(
            f"layer {r.layer:3d}  H {r.hidden:4d}  recall {r.recall:.4f}  precision "
            f"{r.precision:.4f}  predicted-active {100 * r.pred_active:5.1f}%  true-active "
            f"{100 * r.true_active:5.1f}%  ({r.epochs} epochs)",
            flush=True,
        )

    if args.calibrate_from:
        if not args.from_samples or args.skip_fraction is None:
            raise ValueError("--calibrate-from needs --from-samples DIR and --skip-fraction F")
        _calibrate(args, args.calibrate_from, opts, progress)
        _maybe_pack(args)
        if args.plot:
            from powerpy import plot
            from powerpy.pipeline.train_report import TrainReport

            report = TrainReport.load(args.calibrate_from)
            save_plot(plot.predictor_quality(report), args.plot)
        return 0
    if args.from_samples:
        report = train_from_samples(
            args.from_samples, args.output, opts, progress=progress, log_layer=show
        )
        if args.skip_fraction is not None:
            _calibrate(args, args.output, opts, progress)
    else:
        llm = load_model(args)
        ids = text_ids(llm, args)
        report, _ = train_predictors(
            llm.model,
            ids,
            args.output,
            opts,
            tokens=args.tokens,
            samples=args.samples,
            ctx=args.ctx,
            target_sparsity=args.target_sparsity,
            numerics=llm.options.numerics,
            skip_fraction=args.skip_fraction,
            predictor_cost=args.predictor_cost,
            work_dir=args.work_dir,
            progress=progress,
            log_layer=show,
        )
    _maybe_pack(args)
    if args.plot:
        from powerpy import plot

        report.model = report.model or (Path(args.model).name if args.model else "")
        save_plot(plot.predictor_quality(report), args.plot)
    s = report.summary()
    print(
        f"mean recall {s['recall_mean']:.4f} (min {s['recall_min']:.4f}), precision "
        f"{s['precision_mean']:.4f}, predicted-active {100 * s['pred_active_mean']:.1f}%, "
        f"true-active {100 * s['true_active_mean']:.1f}% -> {args.output}"
    )
    return 0


def _calibrate(args: argparse.Namespace, pred_dir: str, opts, progress: bool) -> None:
    """Calibrate ``pred_dir`` on the sample dump into ``args.output``; print the per-layer plan."""
    from powerpy.pipeline.calibrate import calibrate_predictors

    records = calibrate_predictors(
        pred_dir,
        args.from_samples,
        args.output,
        args.skip_fraction,
        global_threshold=args.calibration_threshold,
        predictor_cost=args.predictor_cost,
        seed=opts.seed,
        val_fraction=opts.val_fraction,
        progress=progress,
    )
    for r in records:
        if r["dense"]:
            print(f"layer {r['layer']:3d}  dense (the predictor would cost more than it saves)")
            continue
        print(
            f"layer {r['layer']:3d}  threshold {r['threshold']:+.4f}  planned active "
            f"{100 * r['active']:5.1f}%  lost energy {r['lost']:.5f}"
        )
    mean = sum(r["active"] for r in records) / len(records)
    print(f"planned mean active {100 * mean:.1f}% -> {args.output}")


def _maybe_pack(args: argparse.Namespace) -> None:
    if args.pack:
        from pathlib import Path

        from powerpy.pipeline.predictors import PACK_FILE, pack_predictors

        out = pack_predictors(args.output, Path(args.output) / PACK_FILE)
        print(f"packed predictors: {out} ({out.stat().st_size / 2**20:.1f} MiB)")
