"""Fuzz the whole load path (issue 13) in subprocesses: tools/fuzz.py N [--jobs 2] [--seed S].

Runs N cases of the generator ``powerpy.testing.fuzz`` (mutations taken round-robin, so every
family gets its share) through read -> ``powerpy.load`` -> two tokens -> detokenize. Cases run in
batches, one worker subprocess per batch, under an address-space limit (``RLIMIT_AS``) and a
per-case timeout, so that a crash, a hang or a memory blow-up is caught and charged to the case
that caused it (the worker is then restarted on the rest of its batch).

Prints the outcome counts per family: ok / PowerpyError / NonFiniteError are the allowed
outcomes; anything else (an exception type, crash, timeout, memory) is listed with the case and
a command that reproduces it, and makes the exit code 1.

    python tools/fuzz.py 20000 --jobs 2
    python tools/fuzz.py --case tensors.mislabelled 123   # one case, traceback shown
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import resource
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = ("ok", "PowerpyError", "NonFiniteError")
MAX_SHOWN = 3  # failures shown per (mutation, outcome)


# --- worker ---------------------------------------------------------------------------------------
def _setup_worker() -> None:
    import logging
    import warnings

    sys.path.insert(0, str(ROOT))
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)


def worker() -> int:
    """Read cases ``[[name, seed], ...]`` (JSON) on stdin; print ``start`` and result lines."""
    _setup_worker()
    from powerpy.testing import fuzz

    cases = json.loads(sys.stdin.read())
    out = sys.stdout
    with tempfile.TemporaryDirectory(prefix="powerpy-fuzz-") as tmp:
        for k, (name, seed) in enumerate(cases):
            out.write(json.dumps({"start": k}) + "\n")
            out.flush()
            work = Path(tmp) / str(k)
            try:
                outcome, detail = fuzz.run_case(name, seed, work)
            except fuzz.GeneratorError as e:
                outcome, detail = "generator", str(e)[:300]
            except MemoryError as e:
                outcome, detail = "memory", f"MemoryError: {e}"
            except Exception as e:  # the library bug the fuzzer looks for
                note = (getattr(e, "__notes__", None) or [""])[-1]
                outcome, detail = type(e).__name__, f"{str(e)[:300]} [{note}]"
            out.write(json.dumps({"done": k, "outcome": outcome, "detail": detail}) + "\n")
            out.flush()
            _rmtree(work)
    return 0


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def one_case(name: str, seed: int) -> int:
    """Run one case in this process with the full traceback."""
    _setup_worker()
    from powerpy.testing import fuzz

    with tempfile.TemporaryDirectory(prefix="powerpy-fuzz-") as tmp:
        p = fuzz.prepare(name, seed, Path(tmp))
        print(f"{name} seed {seed}: {p.description}", file=sys.stderr)
        print(fuzz.run(p))
    return 0


# --- parent ---------------------------------------------------------------------------------------
def _limit(mem_bytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        os.nice(5)

    return apply


def run_batch(
    cases: list[tuple[str, int]], timeout: float, mem_bytes: int
) -> list[tuple[str, int, str, str]]:
    """Run ``cases`` in worker subprocesses; -> ``(name, seed, outcome, detail)`` per case."""
    results: list[tuple[str, int, str, str]] = []
    todo = list(cases)
    while todo:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_limit(mem_bytes),
            text=True,
        )
        assert proc.stdin and proc.stdout and proc.stderr
        proc.stdin.write(json.dumps(todo))
        proc.stdin.close()
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        current, deadline, finished = None, time.monotonic() + timeout + 60, 0  # startup time
        failure = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                failure = "timeout"
                proc.kill()
                break
            line = proc.stdout.readline()
            if not line:  # the worker died (or finished)
                break
            msg = json.loads(line)
            if "start" in msg:
                current, deadline = msg["start"], time.monotonic() + timeout
            else:
                name, seed = todo[msg["done"]]
                results.append((name, seed, msg["outcome"], msg["detail"]))
                finished, current = msg["done"] + 1, None
        proc.wait()
        err = proc.stderr.read()
        if current is None and failure is None:
            if finished < len(todo):  # died between cases (startup): charge the next one
                current = finished
            else:
                break
        k = current if current is not None else finished
        name, seed = todo[k]
        if failure is None:
            low = err.lower()
            signs = ("memoryerror", "cannot allocate", "bad_alloc", "failed to map")
            memory = any(w in low for w in signs)
            failure = "memory" if memory else "crash"
        detail = f"exit {proc.returncode}; {err.strip()[-300:]}"
        results.append((name, seed, failure, detail))
        todo = todo[k + 1 :]
    return results


def table(results: list[tuple[str, int, str, str]], families: dict[str, list[str]]) -> str:
    """Outcome counts per family (allowed outcomes first, then the rest)."""
    fam_of = {m: f for f, ms in families.items() for m in ms}
    counts: dict[str, collections.Counter] = {f: collections.Counter() for f in families}
    for name, _, outcome, _ in results:
        counts[fam_of[name]][outcome] += 1
    others = sorted({o for c in counts.values() for o in c} - set(ALLOWED))
    cols = [*ALLOWED, *others]
    width = max(12, *(len(c) + 1 for c in cols))
    lines = ["family".ljust(11) + "".join(c.rjust(width) for c in cols) + "total".rjust(8)]
    total: collections.Counter = collections.Counter()
    for fam, c in counts.items():
        total.update(c)
        row = "".join(str(c[col]).rjust(width) for col in cols)
        lines.append(fam.ljust(11) + row + str(sum(c.values())).rjust(8))
    row = "".join(str(total[col]).rjust(width) for col in cols)
    lines.append("all".ljust(11) + row + str(sum(total.values())).rjust(8))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", type=int, nargs="?", default=1000, help="number of cases")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes at a time")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--batch", type=int, default=250, help="cases per worker process")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    ap.add_argument("--mem-gib", type=float, default=4.0, help="address-space limit per worker")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", nargs=2, metavar=("MUTATION", "SEED"), help="run one case here")
    args = ap.parse_args(argv)
    if args.worker:
        return worker()
    if args.case:
        return one_case(args.case[0], int(args.case[1]))

    sys.path.insert(0, str(ROOT))
    from powerpy.testing import fuzz

    names = list(fuzz.MUTATIONS)
    cases = [(names[i % len(names)], args.seed + i) for i in range(args.n)]
    batches: queue.Queue = queue.Queue()
    for s in range(0, len(cases), args.batch):
        batches.put(cases[s : s + args.batch])
    results: list[tuple[str, int, str, str]] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    mem = int(args.mem_gib * 2**30)

    def pump() -> None:
        while True:
            try:
                batch = batches.get_nowait()
            except queue.Empty:
                return
            got = run_batch(batch, args.timeout, mem)
            with lock:
                results.extend(got)
                done = len(results)
            print(f"  {done}/{args.n} cases, {time.monotonic() - t0:.0f} s", file=sys.stderr)

    threads = [threading.Thread(target=pump) for _ in range(max(1, args.jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    print(f"{len(results)} cases in {time.monotonic() - t0:.0f} s (seed {args.seed})")
    print(table(results, fuzz.families()))
    bad = [r for r in results if r[2] not in ALLOWED]
    shown: collections.Counter = collections.Counter()
    for name, seed, outcome, detail in bad:
        shown[(name, outcome)] += 1
        if shown[(name, outcome)] <= MAX_SHOWN:
            print(f"\n{outcome} in {name} seed {seed}: {detail}")
            print(f"  reproduce: python tools/fuzz.py --case {name} {seed}")
    print(f"\n{len(bad)} outcomes other than {', '.join(ALLOWED)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
