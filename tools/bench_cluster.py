"""Figures of a split model (docs/cluster.md): what a pipeline hop costs, and what a second
machine could gain.

    python tools/bench_cluster.py hops [-m MODEL] [--rounds 5] [-n 64]
    python tools/bench_cluster.py model [--ram 64 --vram 24 --host-bw 50 --gpu-bw 900]

``hops``: greedy decode of one sequence through the scheduler, in paired rounds: the whole model
in this process, its two halves as stages in this process (the split alone), and the two
halves as Ray actors on a local cluster (the hops). Each run uses one torch thread, as each
stage has one CPU. Also the round trip of an empty Ray actor call and of one carrying a
(1, n_embd) hidden state. Prints medians of the rounds.

``model``: a ReluLLaMA-70B-shaped PWRI file in Q4_0 (its header; the data are holes of a sparse
file, never read), planned by the placement's cost model (``powerpy.cluster.plan``) on one PC and
split over two alike, with the FFN activity of a ReLU-sparse model and as dense.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decode_tok_s(engine, tokenizer, options, n: int) -> float:
    """Tokens/s of one greedy sequence of ``n`` tokens (after its prompt) via the scheduler."""
    from powerpy.sampling import SamplingParams
    from powerpy.scheduler import Delta, Failed, Finished, Request, Sampling, Scheduler

    sched = Scheduler(engine, tokenizer, options, n_parallel=1, batch="off")
    sched.start()
    try:
        times, done = [], threading.Event()

        def on_event(ev):
            if isinstance(ev, Delta):
                times.append(time.perf_counter())
            if isinstance(ev, Failed):
                times.clear()
                print(f"failed: {ev.message}", file=sys.stderr)
            if isinstance(ev, (Finished, Failed)):
                done.set()

        greedy = Sampling(SamplingParams(temperature=0), ignore_eos=True)
        sched.submit(Request(sched.encode("In the beginning"), n + 1, greedy, on_event=on_event))
        done.wait(600)
        if len(times) < 2:
            raise SystemExit("the run failed")
        return (len(times) - 1) / (times[-1] - times[0])  # the decode steps after the first token
    finally:
        sched.close()


def hops(args) -> None:
    import ray
    import torch

    import powerpy
    from powerpy.cluster.actors import StageActor, start_pipeline
    from powerpy.cluster.pipeline import PipelineEngine
    from powerpy.cluster.spec import StageSpec
    from powerpy.default_model import default_model_path

    torch.set_num_threads(1)
    path = Path(args.model) if args.model else default_model_path()
    whole = powerpy.load(path, use_mmap=True)
    n_layer, n_embd = whole.model.args.n_layer, whole.model.args.n_embd
    halves = [range(0, n_layer // 2), range(n_layer // 2, n_layer)]
    local = PipelineEngine.in_process(path, halves)
    ray.init(
        num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False
    )
    remote = start_pipeline(path, [StageSpec(h) for h in halves], threads=1)
    runs: dict[str, list[float]] = {
        "one process": [],
        "2 stages, this process": [],
        "2 stages, Ray actors": [],
    }
    engines = [whole.model, local, remote]
    print(
        f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs); "
        f"{path.name}: {n_layer} layers, n_embd {n_embd}"
    )
    for r in range(args.rounds):
        order = list(zip(runs, engines, strict=True))
        for name, engine in order if r % 2 == 0 else order[::-1]:
            runs[name].append(decode_tok_s(engine, whole.tokenizer, whole.options, args.n))
    med = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in med.items():
        print(
            f"{k:>24}: {v:7.1f} tok/s  ({1e3 / v:6.2f} ms/token; rounds "
            f"{', '.join(f'{x:.1f}' for x in runs[k])})"
        )
    extra = 1e6 * (1 / med["2 stages, Ray actors"] - 1 / med["2 stages, this process"])
    calls = len(halves)  # actor calls a token makes: one per stage
    print(
        f"pipeline overhead: {extra:.0f} us per token over {calls} actor calls "
        f"= {extra / calls:.0f} us per hop; the step is {1e3 / med['one process']:.2f} ms"
    )
    probe = StageActor.options(num_cpus=0).remote(str(path), range(0, 1), threads=1)
    ray.get(probe.info.remote())
    for what, arg in (("empty", None), (f"(1, {n_embd}) f32", torch.zeros(1, n_embd))):
        ts = []
        for _ in range(200):
            t0 = time.perf_counter()
            ray.get(probe.ping.remote() if arg is None else probe.info.remote())
            ts.append(time.perf_counter() - t0)
        if arg is not None:  # a call that carries the hidden state there and back
            ts = []
            echo = ray.remote(num_cpus=0)(lambda x: x)
            for _ in range(200):
                t0 = time.perf_counter()
                ray.get(echo.remote(arg))
                ts.append(time.perf_counter() - t0)
            what += " (a task there and back)"
        print(f"Ray round trip, {what}: median {1e6 * statistics.median(ts):.0f} us")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    remote.close()
    ray.shutdown()


def write_header_only(path: Path, args, n_layer: int = 80) -> Path:
    """A PWRI file of ReluLLaMA-70B's shapes (matrices Q4_0, predictors F16 with 1024 hidden
    units, norms F32); its data are holes."""
    from powerpy.formats.constants import GGMLType, Names
    from powerpy.formats.gguf_types import tensor_nbytes
    from powerpy.formats.gguf_writer import GGUFStreamWriter
    from powerpy.testing import TinySpec, spec_args

    spec = TinySpec(
        n_embd=8192,
        n_layer=n_layer,
        n_ff=28672,
        n_head=64,
        n_head_kv=8,
        n_ctx=4096,
        n_vocab=32000,
        n_pred_hidden=1024,
    )
    kv = spec_args(spec, sparse=True).to_gguf_kv(name="relullama-70b-shape", vocab_size=True)
    q, f, h16 = GGMLType.Q4_0, GGMLType.F32, GGMLType.F16
    d, ff, gqa, h = spec.n_embd, spec.n_ff, 1024, spec.n_pred_hidden
    table = [
        (Names.TOKEN_EMBD, (32000, d), q),
        (Names.OUTPUT_NORM, (d,), f),
        (Names.OUTPUT, (32000, d), q),
    ]
    for l in range(n_layer):
        for name, shape, t in (
            (Names.ATTN_NORM, (d,), f),
            (Names.ATTN_Q, (d, d), q),
            (Names.ATTN_K, (gqa, d), q),
            (Names.ATTN_V, (gqa, d), q),
            (Names.ATTN_OUTPUT, (d, d), q),
            (Names.FFN_NORM, (d,), f),
            (Names.FFN_GATE, (ff, d), q),
            (Names.FFN_UP, (ff, d), q),
            (Names.FFN_DOWN_T, (ff, d), q),
            (Names.FC1, (h, d), h16),
            (Names.FC2, (ff, h), h16),
        ):
            table.append((name.format(l=l), shape, t))
    w = GGUFStreamWriter(path, kv, table, magic=b"PWRI")
    fout = w.writer.fout[0]
    fout.flush()
    size = fout.tell()
    for _, shape, t in table:  # each tensor padded to the alignment, as the writer lays them out
        size += -(-tensor_nbytes(tuple(reversed(shape)), t) // 32) * 32
    os.truncate(w.tmp, size)
    fout.close()
    with open(w.tmp, "r+b") as fh:
        fh.write(b"PWRI" + (3).to_bytes(4, "little"))
    w._target.commit()
    return path


def model(args) -> None:
    from powerpy.cluster.plan import Node, plan_pipeline, predict

    gib = 1 << 30
    with tempfile.TemporaryDirectory() as d:
        path = write_header_only(Path(d) / "relullama-70b-shape.powerinfer.gguf", args)
        size = path.stat().st_size
        print(
            f"ReluLLaMA-70B shape, Q4_0 PWRI: {size / gib:.1f} GiB; each PC {args.ram} GiB "
            f"RAM, {args.vram} GiB VRAM, {args.host_bw} / {args.gpu_bw} GB/s; hop "
            f"{args.hop_ms} ms"
        )
        pc = dict(
            ram=int(args.ram * gib),
            vram=int(args.vram * gib),
            host_bw=args.host_bw * 1e9,
            gpu_bw=args.gpu_bw * 1e9,
        )
        one, two = [Node("pc1", **pc)], [Node("pc1", **pc), Node("pc2", **pc)]
        for activity in (args.activity, 1.0):
            kw = dict(n_ctx=4096, activity=activity, hop_seconds=args.hop_ms / 1e3)
            alone = plan_pipeline(path, one, **kw)
            auto = plan_pipeline(path, two, **kw)
            half = predict(path, two, "pc1:0-39,pc2:40-79", **kw)
            print(f"\nFFN activity {activity:g}:")
            print(alone.table())
            print(half.table())
            print(
                f"auto over two PCs chooses {len(auto.stages)} stage(s); the 2-stage split "
                f"predicts {half.tok_s / alone.tok_s:.2f}x the tok/s of one PC"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    h = sub.add_parser("hops")
    h.add_argument("-m", "--model", default=None)
    h.add_argument("-n", type=int, default=64, help="tokens per run (64)")
    h.add_argument("--rounds", type=int, default=5)
    m = sub.add_parser("model")
    m.add_argument("--ram", type=float, default=64.0, help="GiB of free RAM per PC (64)")
    m.add_argument("--vram", type=float, default=24.0, help="GiB of VRAM per PC (24)")
    m.add_argument("--host-bw", type=float, default=50.0, help="GB/s read from RAM (50)")
    m.add_argument("--gpu-bw", type=float, default=900.0, help="GB/s read from VRAM (900)")
    m.add_argument(
        "--activity",
        type=float,
        default=0.2,
        help="share of FFN rows a token reads (0.2, a ReLU-sparse model)",
    )
    m.add_argument("--hop-ms", type=float, default=1.7, help="ms per stage boundary (1.7)")
    args = p.parse_args()
    hops(args) if args.what == "hops" else model(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
