"""llama.cpp's CUDA build as the hybrid's speed anchor: decode tok/s of the dense twin of a PWRI
model with as many layers offloaded (``n_gpu_layers``) as each VRAM budget holds.

Run by ``tools/device_check.py`` (section ``llamacpp``) on the lent GPU machine, where
``tools/device_llama_wheel.sh`` built the wheel and ``tools/device_check.sh`` installed it; on
its own::

    python tools/device_llama.py --model M.powerinfer.gguf --budget 4=4294967296 --out rows.json
    python tools/device_llama.py --dry-run          # a tiny model, whatever llama_cpp is here

The dense twin (``compare_llama_cpp.dense_gguf_from_pwri``: no predictors, ggml's ``ffn_down``)
has the same weights in the same types. llama.cpp offloads whole layers, the last ones first,
with their KV cache, and the output matrix as the layer after the last; the token embeddings
stay on the host. A budget's ``n_gpu_layers`` is the largest whose layers, KV rows and the
output (when offloaded) fit the budget less ``RESERVE`` for llama.cpp's compute buffers; each
row also gives the VRAM the process took (the device's free memory before loading and after
the timed decode), so a layer count that overshoots shows. Each configuration runs in a fresh
process (``--run``), llama.cpp's CUDA libraries found in torch's CUDA wheels
(``cuda_lib_dirs``), never in the caller's process.

A wheel whose CPU backend needs instructions this CPU lacks (it is built for AVX-512, since the
device's CPU is not the development machine's) is refused with the reason, not run into SIGILL.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path.insert(0, str(ROOT))  # powerpy from this checkout, installed or not
RESERVE = 512 * 2**20  # llama.cpp's compute buffers and CUDA context beside the weights
N_CTX = 512
# llama.cpp's system-info names of the x86 features a build may need -> /proc/cpuinfo's flags
CPU_FEATURES = {
    "AVX512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
    "AVX2": ("avx2",),
    "FMA": ("fma",),
    "F16C": ("f16c",),
}


def cuda_lib_dirs() -> list[str]:
    """The folders of the CUDA runtime and cuBLAS that torch's wheels installed (site-packages'
    ``nvidia/**/lib`` holding libcudart or libcublas), for the child's LD_LIBRARY_PATH."""
    import site

    roots = [*site.getsitepackages(), site.getusersitepackages()]
    found = []
    for root in roots:
        base = Path(root) / "nvidia"
        if not base.is_dir():
            continue
        for lib in sorted(base.glob("**/lib")):
            if any(lib.glob("libcudart.so*")) or any(lib.glob("libcublas.so*")):
                found.append(str(lib))
    return found


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    dirs = cuda_lib_dirs()
    if dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*dirs, env.get("LD_LIBRARY_PATH", "")]).strip(
            os.pathsep
        )
    return env


def missing_cpu_features(system_info: str, cpuinfo: str) -> list[str]:
    """The features the build's system info says it uses (``NAME = 1``) that this CPU's flags
    lack."""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    need = [n for n in CPU_FEATURES if f"{n} = 1" in system_info]
    return [f for n in need for f in CPU_FEATURES[n] if f not in flags]


# ------------------------------------------------------------------------------ the child
def _cuda_free() -> int | None:
    """The device's free bytes (cudaMemGetInfo), or None without the CUDA runtime."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            rt = ctypes.CDLL(name)
        except OSError:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0:
            return int(free.value)
        return None
    return None


def _cpu_moe_overrides(n: int):
    """llama.cpp's ``--n-cpu-moe n`` as model parameters' tensor buffer overrides: the expert
    stacks of layers 0 .. n-1 in host memory (the pattern of each layer, the CPU buffer type,
    a null end). Returns the array and what it points into (keep both alive)."""
    import ctypes

    import llama_cpp

    class BufferOverride(ctypes.Structure):  # struct llama_model_tensor_buft_override
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    lib = next((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu.so*"))
    cpu = ctypes.CDLL(str(lib))
    cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    buft = cpu.ggml_backend_cpu_buffer_type()
    patterns = [rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps".encode() for i in range(n)]
    arr = (BufferOverride * (n + 1))()
    for i, pat in enumerate(patterns):
        arr[i].pattern, arr[i].buft = pat, buft
    return arr, patterns


def run_child(args: argparse.Namespace) -> dict:
    """One configuration in this process: load, a warm prefill, then the best of ``repeats``
    greedy decodes of ``tokens`` tokens."""
    import ctypes

    import llama_cpp
    import numpy as np

    out: dict = {"n_gpu_layers": args.ngl}
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    out["gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    out["system_info"] = info
    if args.probe:
        return out
    free0 = _cuda_free() if out["gpu_offload"] else None
    if args.n_cpu_moe is not None:  # Llama() takes no overrides: its default parameters do
        from llama_cpp import llama_cpp as lc

        keep = _cpu_moe_overrides(args.n_cpu_moe)
        defaults = lc.llama_model_default_params

        def with_overrides():
            p = defaults()
            p.tensor_buft_overrides = ctypes.addressof(keep[0])
            return p

        lc.llama_model_default_params = with_overrides
        out["n_cpu_moe"] = args.n_cpu_moe
    t0 = time.perf_counter()
    ref = llama_cpp.Llama(
        model_path=args.model,
        n_gpu_layers=args.ngl,
        n_ctx=args.n_ctx,
        n_batch=64,  # small compute buffers: the prompt is 16 tokens, then one at a time
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        verbose=False,
    )
    out["load_s"] = round(time.perf_counter() - t0, 2)
    # compare_llama_cpp's decode loop, not imported: it imports torch, whose OpenMP runtime
    # beside llama.cpp's makes both spin (a tiny model decodes at 2 tok/s instead of 2000)
    prompt = [int(t) for t in args.prompt.split(",")]
    best = 0.0
    for _ in range(args.repeats):
        ref.reset()
        ref.eval(prompt)
        t = time.perf_counter()
        for _ in range(args.tokens):
            logits = np.ctypeslib.as_array(ref._ctx.get_logits(), shape=(ref.n_vocab(),))
            ref.eval([int(np.argmax(logits))])
        best = max(best, args.tokens / (time.perf_counter() - t))
    out["tok_s"] = best
    free1 = _cuda_free() if out["gpu_offload"] else None
    out["vram_bytes"] = free0 - free1 if free0 is not None and free1 is not None else None
    return out


def child(
    model: Path | None,
    ngl: int,
    threads: int,
    prompt: list[int],
    tokens: int,
    repeats: int,
    timeout: float,
    probe: bool = False,
    n_cpu_moe: int | None = None,
) -> dict:
    """Run ``--run`` in a fresh process (``n_cpu_moe``: as llama.cpp's ``--n-cpu-moe``); its
    JSON, or {"error": ...}."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--run",
        "--ngl",
        str(ngl),
        "--threads",
        str(threads),
        "--tokens",
        str(tokens),
        "--repeats",
        str(repeats),
        "--prompt",
        ",".join(map(str, prompt)),
        "--n-ctx",
        str(N_CTX),
    ]
    if probe:
        cmd.append("--probe")
    else:
        cmd += ["--model", str(model)]
    if n_cpu_moe is not None:
        cmd += ["--n-cpu-moe", str(n_cpu_moe)]
    try:
        p = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"n_gpu_layers": ngl, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout)[-1500:]
        return {"n_gpu_layers": ngl, "error": f"exit {p.returncode}: {tail}"}
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------ the parent
def layer_sizes(dense: Path) -> tuple[list[int], int, int]:
    """(bytes of each repeating layer, bytes of the output matrix and norm, KV bytes per layer
    at N_CTX positions in f16) of a GGUF."""
    from powerpy.config import ModelArgs
    from powerpy.formats.gguf_reader import read_gguf

    with read_gguf(dense) as gf:
        args = ModelArgs.from_gguf(gf)
        layers = [0] * args.n_layer
        out = 0
        for name, t in gf.tensors.items():
            if name.startswith("blk."):
                layers[int(name.split(".")[1])] += t.nbytes
            elif name.startswith("output"):
                out += t.nbytes
        if "output.weight" not in gf.tensors:  # tied: llama.cpp offloads a copy of the embedding
            out += gf.tensors["token_embd.weight"].nbytes
    return layers, out, 2 * N_CTX * args.n_embd_gqa * 2  # K and V, f16


def fit_layers(layers: list[int], output: int, kv: int, budget: int | None) -> int:
    """The largest n_gpu_layers (0 .. n_layer + 1, the last: the output too) that fits."""
    if budget is None:
        return 0
    room, n = budget - RESERVE, 0
    for size in reversed(layers):  # llama.cpp offloads the last layers first
        if room < size + kv:
            return n
        room -= size + kv
        n += 1
    return n + 1 if room >= output else n


def check_build(threads: int) -> dict:
    """The installed llama_cpp's probe (``gpu_offload``, ``system_info``), in a child; raises
    when it does not load or needs CPU features this CPU lacks."""
    probe = child(None, 0, threads, [1], 1, 1, 120, probe=True)
    if "error" in probe:
        raise RuntimeError(f"llama_cpp does not load: {probe['error']}")
    with open("/proc/cpuinfo") as f:
        missing = missing_cpu_features(probe["system_info"], f.read())
    if missing:
        raise RuntimeError(f"the llama.cpp build needs CPU features this CPU lacks: {missing}")
    return probe


def anchor(
    pwri: Path,
    budgets: list[tuple[str, str, int | None]],
    work: Path,
    *,
    threads: int,
    prompt: list[int],
    tokens: int,
    repeats: int,
    deadline: float,
    log=print,
) -> list[dict]:
    """Rows of llama.cpp's decode tok/s per (key, label, bytes) budget (None: CPU-only) on the
    dense twin of ``pwri`` (written into ``work``). A row's ``budget_key`` is the budget's key,
    as the device check's timing rows name them."""
    start = time.perf_counter()
    probe = check_build(threads)
    sys.path.insert(0, str(TOOLS))
    import compare_llama_cpp as compare

    dense = work / (pwri.name.replace(".powerinfer", "") + ".dense.gguf")
    t0 = time.perf_counter()
    compare.dense_gguf_from_pwri(pwri, dense)
    log(f"llamacpp: dense twin written in {time.perf_counter() - t0:.1f} s")
    layers, output, kv = layer_sizes(dense)
    rows = []
    try:
        for key, label, budget in budgets:
            ngl = fit_layers(layers, output, kv, budget) if probe["gpu_offload"] else 0
            row = {
                "budget_key": key,
                "budget": label,
                "bytes": budget,
                "n_gpu_layers": ngl,
                "n_layer": len(layers),
                "gpu_offload": probe["gpu_offload"],
            }
            rows.append(row)
            left = deadline - (time.perf_counter() - start)
            if left < 15:
                row["error"] = f"skipped: {left:.0f} s left"
                continue
            r = child(dense, ngl, threads, prompt, tokens, repeats, left)
            r.pop("system_info", None)
            row |= r
            if budget is not None and row.get("vram_bytes") is not None:
                row["within_budget"] = row["vram_bytes"] <= budget
            log(f"llamacpp: {row}")
    finally:
        dense.unlink(missing_ok=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a PWRI model (the parent), or the dense GGUF (--run)")
    ap.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="KEY=BYTES",
        help="a VRAM budget (repeatable); CPU-only always runs first",
    )
    ap.add_argument("--out", type=Path, help="write the rows here as JSON")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt", default="1,72,101,108,108,111,44,32")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds for everything")
    ap.add_argument("--dry-run", action="store_true", help="a tiny synthetic model")
    ap.add_argument("--run", action="store_true", help=argparse.SUPPRESS)  # the child
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ngl", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--n-ctx", type=int, default=N_CTX, help=argparse.SUPPRESS)
    ap.add_argument("--n-cpu-moe", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run:
        print(json.dumps(run_child(args)), flush=True)
        return 0
    prompt = [int(t) for t in args.prompt.split(",")]
    budgets = [("cpu", "cpu-only", None)]
    for b in args.budget:
        key, _, size = b.partition("=")
        if not key or not size.isdigit():
            ap.error(f"--budget {b!r}: give KEY=BYTES, e.g. 4=4294967296")
        budgets.append((key, key, int(size)))
    if args.model and not Path(args.model).is_file():
        ap.error(f"--model {args.model}: no such file")
    with tempfile.TemporaryDirectory(prefix="device_llama_") as tmp:
        model = Path(args.model) if args.model else None
        if args.dry_run:
            from powerpy.testing import synthetic as synth

            model = Path(tmp) / "tiny.powerinfer.gguf"
            synth.write_synthetic_model(model, "tiny", "f16", stats=False)
            budgets += [("4", "4 MiB + the reserve", 4 * 2**20 + RESERVE)]
            args.tokens, args.repeats = min(args.tokens, 4), 1
        if model is None:
            ap.error("--model or --dry-run")
        rows = anchor(
            model,
            budgets,
            Path(tmp),
            threads=args.threads,
            prompt=prompt,
            tokens=args.tokens,
            repeats=args.repeats,
            deadline=args.deadline,
        )
    text = json.dumps(rows, indent=1)
    if args.out:
        from powerpy._fs import atomic_write

        with atomic_write(args.out) as tmp_out:
            tmp_out.write_text(text)
    print(text)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
