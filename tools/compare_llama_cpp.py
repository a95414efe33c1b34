"""Speed of powerpy and llama.cpp (llama-cpp-python) side by side: prompt processing and decode.

    python tools/compare_llama_cpp.py [-m MODEL.gguf] [-n 64] [--prompt 512] [-t THREADS]
    python tools/compare_llama_cpp.py --shape 1b --dtype f16 --prompt 512 -n 32 -t 2

Without ``--shape`` both engines run one file (default: SmolLM2-135M Q4_1), powerpy densely
(it has no predictors). With ``--shape`` a synthetic PowerInfer model of that shape is written
once into ``--work`` (power-law neurons, ~10% predicted active, ``tools/make_synthetic_model.py``)
together with a dense GGUF of the same weights for llama.cpp; powerpy runs the PWRI file sparse
and dense; ``--arch falcon`` makes a Falcon-shaped one. ``--shape 0.5b --arch qwen2`` (llama,
qwen3, gemma, gemma2, gemma3, phi2, phi3, stablelm) writes one dense GGUF of that family in a real
~0.5B model's dimensions (``FAMILY_SHAPES``), which both engines run. (llama.cpp runs that file
as SwiGLU, or GELU for falcon, where the synthetic model is ReLU: the same bytes and operations,
so speeds compare, outputs do not.)

The engines run in paired rounds (llama.cpp, then powerpy, back to back); the table gives the
median of each and the median of the per-round ratios. llama.cpp runs in a process of its own
(``--same-process`` runs it in powerpy's), so neither engine's libraries or threads share a
process with the other's. With ``--one-at-a-time`` each round starts a llama.cpp process, then a
powerpy process, each loading its file, so only one model is resident at a time (two 7B F16
files do not fit in 24 GB together). Timings on a shared machine drift: compare the ratios, not
the absolute numbers.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

PROMPT = "In the beginning God created the heaven and the earth. And the earth was"
# evaluated once before the rounds by each engine: a mapped file's first pass faults its pages
# in, and the first graph allocates its buffers
WARM_IDS = list(range(3, 19))


# ----------------------------------------------------------------------------- the files
def dense_gguf_from_pwri(src: Path, out: Path) -> Path:
    """The dense GGUF llama.cpp reads, from a PWRI file: predictors and powerpy's keys dropped,
    ``ffn_down_t`` (n_ff, n_embd) transposed back to ggml's ``ffn_down`` (n_embd, n_ff), same
    types (a quantized one rounds once more), its bias renamed ``ffn_down.bias``."""
    from powerpy.formats import quants
    from powerpy.formats.constants import Keys
    from powerpy.formats.gguf_reader import read_gguf
    from powerpy.formats.gguf_writer import GGUFStreamWriter

    with read_gguf(src) as gf:
        names = [n for n in gf.tensors if ".fc1." not in n and ".fc2." not in n]
        table = []
        for n in names:
            t = gf.tensors[n]
            shape = tuple(t.shape)
            if n.endswith(".ffn_down_t.weight"):
                n, shape = n.replace(".ffn_down_t.", ".ffn_down."), shape[::-1]
            table.append((n.replace(".ffn_down_t.bias", ".ffn_down.bias"), shape, t.ggml_type))
        drop = (
            Keys.SPARSE_THRESHOLD,
            Keys.SPARSE_ACTIVATION,
            Keys.DENSE_LAYERS,
            Keys.FFN_DOWN_THRESHOLD,
        )
        kv = {k: v for k, v in gf.typed_kv().items() if k not in drop}
        with GGUFStreamWriter(out, kv, table) as w:
            for src_name, (name, shape, ggml_type) in zip(names, table, strict=True):
                if src_name.endswith(".ffn_down_t.weight"):
                    down = np.ascontiguousarray(gf.dequantize(src_name).T)  # (n_embd, n_ff)
                    w.write(name, quants.quantize(down, ggml_type).reshape(-1), shape)
                else:
                    w.write(name, gf.raw(src_name).reshape(-1), shape)
    return out


def synthetic_pair(shape: str, dtype: str, work: Path, arch: str = "llama") -> tuple[Path, Path]:
    """(PWRI, dense GGUF) of a synthetic model of ``arch``, written once into ``work``."""
    from powerpy.testing.synthetic import write_synthetic_model

    work.mkdir(parents=True, exist_ok=True)
    name = f"synthetic-{shape}-{dtype}" if arch == "llama" else f"synthetic-{arch}-{shape}-{dtype}"
    pwri = work / f"{name}.powerinfer.gguf"
    dense = work / f"{name}.dense.gguf"
    if not pwri.is_file():
        print(f"writing {pwri} ...", flush=True)
        write_synthetic_model(pwri, shape, dtype, arch=arch, active=0.10, powerlaw=True)
    if not dense.is_file():
        print(f"writing {dense} ...", flush=True)
        dense_gguf_from_pwri(pwri, dense)
    return pwri, dense


# ~0.5B dense shapes of the families without a synthetic PWRI model (``--shape 0.5b``): random
# weights, a byte vocabulary padded to the family's size, the real models' dimensions
FAMILY_SHAPES = {
    # SmolLM2-360M
    "llama": dict(n_embd=960, n_layer=32, n_ff=2560, n_head=15, n_head_kv=5, n_vocab=49152),
    # Qwen2.5-0.5B
    "qwen2": dict(n_embd=896, n_layer=24, n_ff=4864, n_head=14, n_head_kv=2, n_vocab=151936),
    # Qwen3-0.6B (head size 128, not 1024 / 16)
    "qwen3": dict(
        n_embd=1024, n_layer=28, n_ff=3072, n_head=16, n_head_kv=8, key_length=128, n_vocab=151936
    ),
    # gemma-3-270m (head size 256); gemma and gemma2 in the same dimensions (their smallest
    # models are 2.5B and 2.6B)
    "gemma3": dict(
        n_embd=640, n_layer=18, n_ff=2048, n_head=4, n_head_kv=1, key_length=256, n_vocab=262144
    ),
    "gemma2": dict(
        n_embd=640, n_layer=18, n_ff=2048, n_head=4, n_head_kv=1, key_length=256, n_vocab=256000
    ),
    "gemma": dict(
        n_embd=640, n_layer=18, n_ff=2048, n_head=4, n_head_kv=1, key_length=256, n_vocab=256000
    ),
    # phi-2's layout (parallel block, biases everywhere) and vocabulary in half its width
    "phi2": dict(n_embd=1280, n_layer=24, n_ff=5120, n_head=20, n_head_kv=20, n_vocab=51200),
    # StableLM 2 1.6B's layout and vocabulary in half its width (LayerNorms with biases)
    "stablelm": dict(n_embd=1024, n_layer=24, n_ff=2816, n_head=16, n_head_kv=16, n_vocab=100352),
    # Phi-3's layout (fused qkv and gate+up) in Qwen2.5-0.5B's dimensions, Phi-3's vocabulary
    "phi3": dict(n_embd=896, n_layer=24, n_ff=4864, n_head=14, n_head_kv=14, n_vocab=32064),
}


def family_model(arch: str, dtype: str, work: Path) -> Path:
    """A dense GGUF of ``arch`` in its ``FAMILY_SHAPES`` shape (the output tied where the family
    ties it), written once."""
    from powerpy.formats.constants import GGMLType
    from powerpy.testing import TinySpec, write_tiny_model

    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{arch}-0.5b-{dtype}.gguf"
    if not path.is_file():
        print(f"writing {path} ...", flush=True)
        spec = TinySpec(arch=arch, tied=True, n_ctx=4096, **FAMILY_SHAPES[arch])
        write_tiny_model(path, spec, sparse=False, dtype=GGMLType[dtype.upper()])
    return path


# ----------------------------------------------------------------------------- the runs
def llama_cpp_pp(ref, ids: list[int]) -> float:
    ref.reset()
    t0 = time.perf_counter()
    ref.eval(ids)
    return len(ids) / (time.perf_counter() - t0)


def _last_logits(ref) -> np.ndarray:
    """The last evaluated token's logits (the only row llama.cpp computes without logits_all)."""
    return np.ctypeslib.as_array(ref._ctx.get_logits(), shape=(ref.n_vocab(),))


def llama_cpp_tg(ref, ids: list[int], n: int) -> float:
    ref.reset()
    ref.eval(ids)
    t0 = time.perf_counter()
    for _ in range(n):
        ref.eval([int(np.argmax(_last_logits(ref)))])
    return n / (time.perf_counter() - t0)


def _llama_cpp_server(conn, path: str, n_ctx: int, n_batch: int, threads: int) -> None:
    """A llama.cpp process: answers ("pp", ids) and ("tg", ids, n) with tokens/s; None stops."""
    import llama_cpp

    # logits of the last token only, as powerpy computes them (with logits_all a pp test would
    # also time the output matrix for every prompt token); prompts on the same threads as
    # decode (llama-cpp-python's default for n_threads_batch is every CPU)
    ref = llama_cpp.Llama(
        model_path=path,
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=False,
        verbose=False,
    )
    llama_cpp_pp(ref, WARM_IDS)
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        conn.send(llama_cpp_pp(ref, cmd[1]) if cmd[0] == "pp" else llama_cpp_tg(ref, *cmd[1:]))


def _powerpy_server(conn, path: str, threads: int, exact: bool) -> None:
    """A powerpy process: answers (test, ids, n, mode) with tokens/s; None stops."""
    import powerpy
    from powerpy.model.options import DENSE, SPARSE

    torch.set_num_threads(threads)
    llm = powerpy.load(path, exact_activations=exact)
    model = llm.model
    powerpy_pp(model, WARM_IDS, DENSE)
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        test, ids, n, mode = cmd
        opts = SPARSE if mode == "sparse" else DENSE
        conn.send(powerpy_pp(model, ids, opts) if test == "pp" else powerpy_tg(model, ids, n, opts))


class Worker:
    """An engine in a spawned process of its own: ``ask`` sends a command, returns the answer."""

    def __init__(self, target, *args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        if self.conn.recv() != "ready":
            raise RuntimeError(f"{target.__name__} failed to start")

    def ask(self, cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=60)


class LlamaCpp:
    """llama.cpp on one file, in this process or in a process of its own."""

    def __init__(self, path: Path, n_ctx: int, n_batch: int, threads: int, same_process: bool):
        self.ref = self.worker = None
        if same_process:
            import llama_cpp

            self.ref = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_threads=threads,
                n_threads_batch=threads,
                logits_all=False,
                verbose=False,
            )
            llama_cpp_pp(self.ref, WARM_IDS)
        else:
            self.worker = Worker(_llama_cpp_server, str(path), n_ctx, n_batch, threads)

    def pp(self, ids: list[int]) -> float:
        return llama_cpp_pp(self.ref, ids) if self.worker is None else self.worker.ask(("pp", ids))

    def tg(self, ids: list[int], n: int) -> float:
        if self.worker is None:
            return llama_cpp_tg(self.ref, ids, n)
        return self.worker.ask(("tg", ids, n))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def powerpy_pp(model, ids: list[int], opts) -> float:
    cache = model.new_cache(len(ids))
    t0 = time.perf_counter()
    model.forward(torch.tensor(ids), cache, opts)
    return len(ids) / (time.perf_counter() - t0)


def powerpy_tg(model, ids: list[int], n: int, opts) -> float:
    cache = model.new_cache(len(ids) + n + 1)
    logits = model.forward(torch.tensor(ids), cache, opts)
    t0 = time.perf_counter()
    for _ in range(n):
        logits = model.forward(logits.argmax(-1), cache, opts)
    return n / (time.perf_counter() - t0)


def check_peer_build() -> None:
    """Exit with a message where llama-cpp-python has ggml's AMX kernels, which crash here
    (checked in a child process, so this one never loads ggml)."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    info = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if info.returncode != 0:
        sys.exit(f"llama-cpp-python does not import: {info.stderr.strip().splitlines()[-1:]}")
    if "AMX_INT8 = 1" in info.stdout:
        sys.exit(
            "llama-cpp-python was built with ggml's AMX kernels, which crash on this machine: "
            "rebuild it with `bash tools/install_test.sh`"
        )


def main() -> None:
    import powerpy
    from powerpy.default_model import smollm2_path
    from powerpy.model.options import DENSE, SPARSE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="one GGUF for both (default SmolLM2)")
    ap.add_argument(
        "--shape",
        choices=("tiny", "0.5b", "1b", "7b"),
        help="synthetic model shape (0.5b: a dense model of --arch, FAMILY_SHAPES)",
    )
    ap.add_argument(
        "--arch",
        choices=sorted({"falcon", *FAMILY_SHAPES}),
        default="llama",
        help="synthetic model family (tiny, 1b, 7b: llama, falcon)",
    )
    ap.add_argument("--dtype", choices=("f16", "q8_0", "q4_0"), default="f16")
    ap.add_argument("--work", type=Path, default=Path("/tmp/powerpy-compare"))
    ap.add_argument("-n", type=int, default=64, help="decoded tokens (0: no tg test)")
    ap.add_argument("--prompt", type=int, default=0, metavar="N", help="pp test of N tokens")
    ap.add_argument("-t", "--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--exact-activations", action="store_true", help="powerpy keeps activations f32"
    )
    ap.add_argument(
        "--same-process", action="store_true", help="run llama.cpp in powerpy's process"
    )
    ap.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="each round loads llama.cpp, then powerpy, in fresh processes (one model resident)",
    )
    args = ap.parse_args()
    check_peer_build()
    torch.set_num_threads(args.threads)
    if args.shape == "0.5b":
        if args.arch not in FAMILY_SHAPES:
            ap.error(f"--shape 0.5b: --arch is one of {', '.join(FAMILY_SHAPES)}")
        ours_path = ref_path = family_model(args.arch, args.dtype, args.work)
    elif args.shape:
        if args.arch not in ("llama", "falcon"):
            ap.error(f"--shape {args.shape}: --arch llama or falcon (0.5b for the others)")
        ours_path, ref_path = synthetic_pair(args.shape, args.dtype, args.work, args.arch)
    else:
        ours_path = ref_path = Path(args.model or smollm2_path())
    llm = powerpy.load(ours_path, use_mmap=args.one_at_a_time)  # mapped: ids and modes only
    modes = ["sparse", "dense"] if llm.model.can_gate else ["dense"]
    n_ctx = -(-(max(args.prompt, 16) + args.n + 8) // 256) * 256  # llama.cpp rounds up to 256
    ref_args = (ref_path, n_ctx, max(512, args.prompt), args.threads)
    g = np.random.default_rng(0)
    pp_ids = [int(x) for x in g.integers(3, llm.model.args.n_vocab, args.prompt)]
    tg_ids = llm.tokenize(PROMPT)
    tests = ([f"pp{args.prompt}"] if args.prompt else []) + ([f"tg{args.n}"] if args.n else [])
    ours_args = (str(ours_path), args.threads, args.exact_activations)
    ref = ours = model = None
    if args.one_at_a_time:
        del llm  # each round's powerpy process loads its own
    else:
        ref, model = LlamaCpp(*ref_args, args.same_process), llm.model
        powerpy_pp(model, WARM_IDS, DENSE)
    speeds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        if args.one_at_a_time:
            ref = LlamaCpp(*ref_args, False)
        for test in tests:
            pp = test.startswith("pp")
            run = ref.pp(pp_ids) if pp else ref.tg(tg_ids, args.n)
            speeds.setdefault(("llama.cpp", test), []).append(run)
        if args.one_at_a_time:
            ref.close()
            ours = Worker(_powerpy_server, *ours_args)
        for test in tests:
            pp = test.startswith("pp")
            ids, n = (pp_ids, 0) if pp else (tg_ids, args.n)
            for mode in modes:
                if ours is not None:
                    run = ours.ask(("pp" if pp else "tg", ids, n, mode))
                else:
                    opts = SPARSE if mode == "sparse" else DENSE
                    run = (
                        powerpy_pp(model, ids, opts) if pp else powerpy_tg(model, ids, args.n, opts)
                    )
                speeds.setdefault((f"powerpy {mode}", test), []).append(run)
        if args.one_at_a_time:
            ours.close()
    if not args.one_at_a_time:
        ref.close()
    print(
        f"powerpy {ours_path.name} vs llama.cpp {ref_path.name}: {args.threads} threads, "
        f"{args.rounds} paired rounds, medians"
    )
    print(f"| {'engine':16} | {'test':7} | {'tok/s':>8} | {'vs llama.cpp':>12} | rounds")
    for (engine, test), xs in speeds.items():
        base = speeds[("llama.cpp", test)]
        ratio = statistics.median(a / b for a, b in zip(xs, base, strict=True))
        rounds = ", ".join(f"{x:.1f}" for x in xs)
        mid = statistics.median(xs)
        print(f"| {engine:16} | {test:7} | {mid:8.2f} | {ratio:11.3f}x | {rounds}")


if __name__ == "__main__":
    main()
