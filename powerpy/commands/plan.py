"""`powerpy plan MODEL --pipeline auto`: which layers go to which machine, each stage's memory
and predicted speed; reads the model's header only (``powerpy.cluster.plan``)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="split a model over machines: stages, memory and predicted tok/s (loads nothing)",
        description="Plan a model split by layer range over the nodes of a Ray cluster (or the "
        "machines --nodes describes, or this one), as `serve --pipeline auto` would; or predict "
        "a split given as --pipeline HOST:A-B,...",
    )
    p.add_argument("model_file", nargs="?", metavar="MODEL", help="the model (or -m)")
    p.add_argument("-m", "--model", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--pipeline",
        default="auto",
        metavar="auto|HOST:A-B,...",
        help="auto (default): choose the stages; or a split to predict (as serve takes it)",
    )
    p.add_argument(
        "--nodes",
        default=None,
        metavar="NAME:RAM[:VRAM[:HOST_BW[:GPU_BW]]],...",
        help="plan for these machines (GiB, GB/s) instead of probing the Ray cluster's nodes",
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=0,
        help="KV positions of all sessions together (0: the model's default)",
    )
    p.add_argument(
        "--vram-budget",
        type=float,
        default=None,
        metavar="GIB",
        help="at most this much VRAM per stage (default: each node's free VRAM)",
    )
    p.add_argument(
        "--activity",
        type=float,
        default=None,
        metavar="F",
        help="share of a gated FFN's rows a token reads (default: 1 for "
        "predictor-gated and dense FFNs, experts used / experts for a mixture)",
    )
    p.add_argument(
        "--hop-ms",
        type=float,
        default=1.5,
        help="cost of one stage boundary per decode step (default 1.5 ms)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--ray-address", default=None, help="the Ray cluster to probe")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from powerpy.cluster.plan import Plan, parse_nodes, plan_pipeline, predict, this_node
    from powerpy.default_model import default_model_path

    path = args.model_file or args.model or default_model_path()
    if args.activity is not None and not 0 < args.activity <= 1:
        raise ValueError("--activity must be in (0, 1]")
    nodes = parse_nodes(args.nodes) if args.nodes else _cluster(args.ray_address)
    if nodes is None:
        print("no Ray cluster running: planning for this machine", file=sys.stderr)
        nodes = [this_node()]
    kw = dict(
        n_ctx=args.ctx_size or None,
        vram_budget=args.vram_budget,
        activity=args.activity,
        hop_seconds=args.hop_ms / 1e3,
    )
    if args.pipeline == "auto":
        plan: Plan = plan_pipeline(path, nodes, **kw)
    else:
        plan = predict(path, nodes, args.pipeline, **kw)
    print(plan.json() if args.json else plan.table(), file=sys.stdout)
    return 0


def _cluster(address: str | None):
    """The running Ray cluster's nodes, probed; None without Ray or a running cluster (a plan
    starts none)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return None
    from powerpy.cluster.actors import cluster_nodes, connect

    try:
        connect(address or "auto")
    except ConnectionError:
        return None
    return cluster_nodes()
