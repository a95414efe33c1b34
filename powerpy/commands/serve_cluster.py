"""`powerpy serve` beyond one machine: ``--pipeline`` (the model's layers in stages on Ray
actors) and ``--replicas`` (whole servers as a Ray Serve deployment behind one endpoint).

This module only parses and checks flags at import; Ray is imported when a cluster starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Served:
    """What the server runs: an engine (a model here, or a pipeline), its tokenizer and run
    options, the model's file and arguments, each session's context, and facts to show."""

    engine: Any
    tokenizer: Any
    options: Any
    path: Path
    args: Any
    n_ctx: int
    info: dict = field(default_factory=dict)
    banner: str = ""


def session_ctx(args: argparse.Namespace, model_args) -> int:
    """Positions per session: ``-c`` shared by the sessions, else the model's default.

    Raises:
        ValueError: fewer than 2 positions per session.
    """
    n_ctx = args.ctx_size // args.parallel if args.ctx_size else model_args.default_n_ctx
    if n_ctx < 2:
        raise ValueError(f"-c {args.ctx_size} leaves {n_ctx} positions per session")
    return n_ctx


FAILURE_POLICIES = ("fail", "restart")
CLUSTER_HINT = "pip install 'powerpy[cluster]'"


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """``--pipeline``, ``--replicas``, ``--on-stage-failure``, ``--stage-timeout``,
    ``--ray-address``."""
    g = p.add_argument_group("beyond one machine (Ray; pip install 'powerpy[cluster]')")
    g.add_argument(
        "--pipeline",
        metavar="auto|HOST:A-B,...",
        default=None,
        help="split the model by layer range into stages on Ray nodes, e.g. "
        "10.0.0.1:0-39,10.0.0.2:40-79 (layers inclusive; HOST: IP, hostname, node id or a "
        "custom resource, * any; an optional :GIB is that stage's VRAM budget), or auto "
        "(as `powerpy plan` chooses; one stage when the model fits one node)",
    )
    g.add_argument(
        "--replicas",
        metavar="N|MIN:MAX",
        default=None,
        help="run N servers (or MIN to MAX, autoscaled) as a Ray Serve deployment behind one "
        "endpoint at --host:--port; Serve restarts a replica whose health check fails",
    )
    g.add_argument(
        "--on-stage-failure",
        choices=FAILURE_POLICIES,
        default="fail",
        help="--pipeline: when a stage dies or hangs, fail (503 and /health 503 until "
        "restarted) or restart it and re-run the sequences it held (default fail)",
    )
    g.add_argument(
        "--stage-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="--pipeline: seconds a step may take before its stage counts as stuck (120)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster (default: RAY_ADDRESS, else the one `ray start` made here, "
        "else a new local one)",
    )


def check_cluster_args(args: argparse.Namespace) -> None:
    """Parse ``--replicas`` into ``args.replica_range``; refuse what does not combine.

    Raises:
        ValueError: a malformed count, both flags, or Ray missing.
    """
    args.replica_range = None
    if args.replicas is not None:
        lo, _, hi = args.replicas.partition(":")
        try:
            args.replica_range = (int(lo), int(hi or lo))
        except ValueError:
            raise ValueError(f"--replicas {args.replicas!r}: give N or MIN:MAX") from None
        if not 1 <= args.replica_range[0] <= args.replica_range[1]:
            raise ValueError(f"--replicas {args.replicas!r}: need 1 <= MIN <= MAX")
        if args.pipeline:
            raise ValueError("--replicas with --pipeline (replicas of pipelines) is not supported")
    if args.stage_timeout <= 0:
        raise ValueError("--stage-timeout must be > 0")
    if args.pipeline or args.replicas:
        missing = [m for m in ("ray", "ray.serve") if not _importable(m)]
        if missing:
            raise ValueError(f"--pipeline and --replicas need Ray: {CLUSTER_HINT}")


def load_pipeline(args: argparse.Namespace):
    """``--pipeline``: the stages started on the cluster, as ``serve.Served`` (the driver reads
    only the model's header: its tokenizer and hyperparameters)."""
    from powerpy.cluster.actors import start_pipeline
    from powerpy.cluster.spec import parse_pipeline
    from powerpy.commands.common import sparse_threshold
    from powerpy.config import ModelArgs
    from powerpy.default_model import default_model_path
    from powerpy.formats.gguf_reader import read_gguf
    from powerpy.tokenizer import Tokenizer

    path = Path(args.model) if args.model else default_model_path()
    with read_gguf(path) as gf:
        model_args = ModelArgs.from_gguf(gf).with_ffn_act(args.ffn_act, source=str(path))
        tokenizer = Tokenizer.from_gguf_kv(gf.kv)
    n_ctx = session_ctx(args, model_args)
    if args.pipeline == "auto":
        from powerpy.cluster.actors import cluster_nodes, connect
        from powerpy.cluster.plan import plan_pipeline

        connect(args.ray_address)
        plan = plan_pipeline(
            path, cluster_nodes(), n_ctx=n_ctx * args.parallel, vram_budget=args.vram_budget
        )
        print(plan.table(), file=sys.stderr)
        specs = plan.specs
    else:
        specs = parse_pipeline(args.pipeline, model_args.n_layer)
    ctk = getattr(args, "cache_type_k", "f16")
    load_options = dict(
        threshold=sparse_threshold(args),
        weight_format=args.weight_format,
        dense=args.dense,
        ffn_act=args.ffn_act,
        cache_type=ctk,
        cut_scale=args.cut_scale,
        exact_activations=args.exact_activations,
        device=args.accel_device,
        n_ctx=n_ctx * args.parallel,
        reset_gpu_index=args.reset_gpu_index,
        disable_gpu_index=args.disable_gpu_index,
    )
    engine = start_pipeline(
        path,
        specs,
        load_options=load_options,
        vram_budget=args.vram_budget,
        threads=args.threads,
        timeout=args.stage_timeout,
        restart=args.on_stage_failure == "restart",
        address=args.ray_address,
    )
    stages = [
        {"stage": i, "host": s["host"], "layers": s["layers"], "actor": s["actor"]}
        for i, s in enumerate(engine.stages)
    ]
    lines = "".join(f"\n  stage {s['stage']}: layers {s['layers']} on {s['host']}" for s in stages)
    return Served(
        engine,
        tokenizer,
        engine.options,
        path,
        model_args,
        n_ctx,
        {"pipeline": stages},
        f", pipeline of {len(stages)} stages{lines}",
    )


def run_replicas(args: argparse.Namespace, build: Callable) -> int:
    """``--replicas``: the server as a Ray Serve deployment on ``--host:--port``, until
    Ctrl-C (which shuts the deployment down); each replica runs ``build(args)``."""
    import functools
    import signal

    from powerpy.cluster.actors import connect
    from powerpy.cluster.replicas import deploy, shutdown

    port = args.port or _free_port(args.host)
    connect(args.ray_address)
    lo, hi = args.replica_range
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        deploy(
            functools.partial(build, args),
            replicas=(lo, hi),
            host=args.host,
            port=port,
            cpus=max(1, args.threads),
            slots=args.parallel + args.queue,
        )
        what = f"{lo}" if lo == hi else f"{lo} to {hi} (autoscaled)"
        print(f"{what} replicas of {args.model or 'the default model'}", file=sys.stderr)
        url_host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"listening on http://{url_host}:{port}", file=sys.stderr, flush=True)
        while not stop:
            time.sleep(0.2)
    finally:
        shutdown()
    print("server stopped", file=sys.stderr)
    return 0


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
