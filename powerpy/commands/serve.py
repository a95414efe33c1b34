"""`powerpy serve`: an OpenAI-compatible HTTP server over one model, llama-server style."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from powerpy.commands.common import add_model_args, load_model, setup_hybrid, wants_hybrid
from powerpy.commands.serve_cluster import Served, add_cluster_args, check_cluster_args, session_ctx

API_KEY_ENV = "POWERPY_API_KEY"
BATCH_CHOICES = ("auto", "off", "rows", "union", "batch")  # powerpy.scheduler.BATCH_MODES
SERVE_PACKAGES = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client")
LOOPBACK = ("127.0.0.1", "localhost", "::1")

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, ...)",
        description="Serve a model over HTTP with OpenAI's API (and llama.cpp's /completion, "
        "/tokenize, /detokenize). Ctrl-C finishes the running requests, then exits. "
        "-t 0 (the default) leaves one core of torch's default to the HTTP server.",
    )
    p.add_argument("model_file", nargs="?", metavar="MODEL", help="the model file (or -m)")
    add_model_args(p, generate=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free)")
    p.add_argument(
        "-np", "--parallel", type=int, default=4, help="sessions run at once (default 4)"
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=0,
        help="KV cache positions, shared equally by the sessions as llama-server does "
        "(0: each session gets the model's training context, at most 4096)",
    )
    p.add_argument(
        "--queue",
        type=int,
        default=64,
        help="requests that may wait for a session; beyond, 503 + Retry-After (default 64)",
    )
    p.add_argument(
        "-n",
        "--n-predict",
        type=int,
        default=-1,
        help="tokens to generate when a request does not say (-1: until the context is full)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
        f"(default: env {API_KEY_ENV})",
    )
    p.add_argument("--alias", default="powerpy", help="model name in the API (default 'powerpy')")
    p.add_argument(
        "--max-body", type=int, default=1 << 20, help="largest request body in bytes (1 MiB)"
    )
    p.add_argument(
        "--batch",
        choices=BATCH_CHOICES,
        default="auto",
        help="batch the sessions' decode steps: auto (measure at start), off, or an FFN mode",
    )
    add_cluster_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    missing = [m for m in SERVE_PACKAGES if not _importable(m)]
    if missing:
        raise ValueError(f"the server needs {', '.join(missing)}: pip install 'powerpy[serve]'")
    if args.parallel < 1 or args.queue < 0 or args.ctx_size < 0 or args.max_body < 1:
        raise ValueError("--parallel and --max-body must be >= 1, --queue and -c >= 0")
    check_cluster_args(args)
    if args.model_file:
        if args.model and args.model != args.model_file:
            raise ValueError(f"two models: {args.model_file} and -m {args.model}")
        args.model = args.model_file
    if args.replicas:
        from powerpy.commands.serve_cluster import run_replicas

        return run_replicas(args, build)
    from powerpy.serve import server

    sock = server.bind(args.host, args.port)  # fail early when the port is taken
    if args.threads == 0 and not args.pipeline:  # the event loop needs a core too
        import torch

        args.threads = max(1, torch.get_num_threads() - 1)
    app, sched, banner = build(args)
    host, port = sock.getsockname()[:2]
    if not app.state.service.config.api_key and args.host not in LOOPBACK:
        log.warning("listening on %s without an API key: anyone who reaches it can use it", host)
    print(banner, file=sys.stderr)
    url_host = f"[{host}]" if ":" in host else host
    print(f"listening on http://{url_host}:{port}", file=sys.stderr, flush=True)
    try:
        server.run(app, sched, sock, verbose=args.verbose)
    finally:
        sched.engine.close()  # a pipeline's stages
    print("server stopped", file=sys.stderr)
    return 0


def build(args: argparse.Namespace):
    """The app, its started scheduler and a line saying what runs: the model in this process
    (``--vram-budget``: placed), or its stages on Ray actors (``--pipeline``)."""
    from powerpy.scheduler import Scheduler
    from powerpy.serve import ServeConfig, create_app

    if args.pipeline:
        from powerpy.commands.serve_cluster import load_pipeline

        served = load_pipeline(args)
    else:
        served = _load_local(args)
    sched = Scheduler(
        served.engine,
        served.tokenizer,
        served.options,
        n_parallel=args.parallel,
        n_ctx=served.n_ctx,
        queue_size=args.queue,
        batch=args.batch,
        source=str(served.path),
    )
    sched.start()
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    a = served.args
    sparse = served.options.sparse and served.engine.can_gate
    config = ServeConfig(
        model_id=args.alias,
        aliases=frozenset({served.path.name, served.path.stem}),
        api_key=key,
        max_body_bytes=args.max_body,
        n_predict=args.n_predict,
        info={
            "file": served.path.name,
            "arch": a.arch,
            "n_layer": a.n_layer,
            "n_vocab": a.n_vocab,
            "n_ctx_train": a.n_ctx_train,
            "n_ctx_slot": served.n_ctx,
            "parallel": args.parallel,
            "sparse": sparse,
            **served.info,
        },
    )
    banner = (
        f"model: {served.path.name} ({a.arch}, {'sparse' if sparse else 'dense'}), "
        f"{args.parallel} sessions x {served.n_ctx} positions, batching {sched.batch_mode}"
    )
    return create_app(sched, config), sched, banner + served.banner


def _load_local(args: argparse.Namespace) -> Served:
    llm = load_model(args)
    n_ctx = session_ctx(args, llm.model.args)
    if wants_hybrid(args):
        setup_hybrid(llm, args, n_ctx * args.parallel)
    return Served(llm.model, llm.tokenizer, llm.options, llm.path, llm.model.args, n_ctx)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
