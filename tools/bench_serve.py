"""Load-test `powerpy serve`: aggregate tokens/s and p50/p99 time to first token at 1, 4 and 16
concurrent streaming clients.

    python tools/bench_serve.py                       # starts `powerpy serve` (default model)
    python tools/bench_serve.py -m model.gguf --batch off --batch auto
    python tools/bench_serve.py --url http://127.0.0.1:8080   # an already running server
    python tools/bench_serve.py --serve-args "--replicas 2" -t 1 --clients 16   # Ray Serve replicas

Each client sends ``--requests`` streamed completions of exactly ``--max-tokens`` tokens
(``ignore_eos``) one after another; a level's figure is the tokens of all its requests over its
wall time. Time to first token includes the wait in the server's queue.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "In the beginning God created",
    "Write a short poem about the sea.",
    "The quick brown fox",
    "Python is a programming language that",
    "My favourite food is",
    "The history of Rome",
]


def stream_one(host: str, port: int, prompt: str, max_tokens: int, key: str | None):
    """(time to first token s, total s, completion tokens) of one streamed completion."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    ttft, tokens = None, 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
            ttft = time.perf_counter() - t0
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    conn.close()
    total = time.perf_counter() - t0
    return ttft if ttft is not None else total, total, tokens


def level(host: str, port: int, clients: int, args) -> dict[str, float]:
    """Run ``clients`` concurrent clients; return the aggregate figures."""

    def client(c: int):
        return [
            stream_one(host, port, PROMPTS[(c + k) % len(PROMPTS)], args.max_tokens, args.api_key)
            for k in range(args.requests)
        ]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        runs = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in runs)
    tokens = sum(r[2] for r in runs)
    return {
        "clients": clients,
        "requests": len(runs),
        "tokens": tokens,
        "tok_s": tokens / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "wall": wall,
    }


def start_server(args, batch: str) -> tuple[subprocess.Popen, str, int, str]:
    cmd = [
        sys.executable,
        "-m",
        "powerpy",
        "serve",
        "--port",
        "0",
        "-np",
        str(args.parallel),
        "--batch",
        batch,
        "-c",
        str(args.ctx_size),
    ]
    if args.model:
        cmd += ["-m", args.model]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    cmd += args.serve_args.split() if args.serve_args else []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    info = []
    for line in proc.stderr:
        info.append(line.rstrip())
        m = re.search(r"listening on http://(\S+):(\d+)", line)
        if m:  # keep reading its stderr so that it never blocks on a full pipe
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, m.group(1), int(m.group(2)), "; ".join(info)
    raise RuntimeError("the server did not start:\n" + "\n".join(info))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="model file (default: the default model)")
    p.add_argument("--url", help="bench this running server instead of starting one")
    p.add_argument("--api-key", default=None)
    p.add_argument("-np", "--parallel", type=int, default=4, help="server sessions (4)")
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="server KV positions")
    p.add_argument("-t", "--threads", type=int, default=0)
    p.add_argument("--batch", action="append", help="server batching mode(s) (default: auto)")
    p.add_argument("--clients", default="1,4,16", help="client counts (1,4,16)")
    p.add_argument("--requests", type=int, default=2, help="requests per client (2)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (32)")
    p.add_argument("--serve-args", default="", help="more serve flags, e.g. '--replicas 2'")
    args = p.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    print("| batching | clients | requests | tok/s | TTFT p50 s | TTFT p99 s |")
    print("|---|---:|---:|---:|---:|---:|")
    for batch in args.batch or ["auto"]:
        proc = None
        if args.url:
            u = urlparse(args.url)
            host, port, info = u.hostname, u.port or 80, "external server"
        else:
            proc, host, port, info = start_server(args, batch)
            print(f"<!-- {info} -->")
        try:
            for n in levels:
                r = level(host, port, n, args)
                print(
                    f"| {batch} | {n} | {r['requests']} | {r['tok_s']:.1f} | "
                    f"{r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} |",
                    flush=True,
                )
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                proc.wait(60)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
