"""A DeepSeek-like mixture too big for the GPU: powerpy's expert placement against llama.cpp's
CUDA build with ``--n-cpu-moe`` at the same VRAM, decode tok/s.

    python tools/device_moe.py --out OUTDIR               # the lent GPU machine (~2 minutes)
    python tools/device_moe.py --dry-run --out OUTDIR     # a tiny one, emulated accelerator

The model is a ``glm4moe`` file (GLM-4.5's layout: GQA attention, a leading dense layer, 64
routed experts of which 6 run per token, a shared expert, sigmoid routing) in DeepSeek-V2-Lite's
widths, F16, 24 layers: about 27 GB, drawn on the device and streamed to disk
(``powerpy.testing.moe.write_moe_model``). DeepSeek's own latent attention is not in the
device step yet (``plan.device_refusal``), so its GQA twin stands in: the experts, which are
what the budget decides, are the same.

Rows (each configuration loaded afresh; llama.cpp in processes of its own, ``device_llama``):

- ``powerpy cpu-only`` and ``llama.cpp cpu-only``;
- ``powerpy experts``: ``--vram-budget`` with the activation statistics of a profile run: the
  dense parts, the shared experts and the most used experts' most used neurons on the GPU;
- ``powerpy --n-cpu-moe N`` and ``llama.cpp --n-cpu-moe N``: every layer on the GPU but the
  experts of the first N layers, N the fewest that fit the budget by the file's bytes.

Each row gives tok/s and, on CUDA, the device memory it took; the JSON and a table go to
``OUTDIR/device_moe.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parent))

from powerpy._fs import atomic_write  # noqa: E402
from powerpy.api import load  # noqa: E402
from powerpy.formats.constants import GGMLType  # noqa: E402
from powerpy.formats.stats import save_activation_stats  # noqa: E402
from powerpy.pipeline.research import profile  # noqa: E402
from powerpy.testing.moe import write_moe_model  # noqa: E402
from powerpy.testing.tiny import TinySpec  # noqa: E402

sys.path.insert(0, str(TOOLS))
import device_llama  # noqa: E402
import device_step  # noqa: E402

GIB = 2**30
# DeepSeek-V2-Lite's widths in glm4moe's layout (its 27 layers cut to 24, 2 shared experts to 1)
SHAPE = TinySpec(
    arch="glm4moe",
    n_embd=2048,
    n_layer=24,
    n_ff=10944,  # the leading dense layer's
    n_head=16,
    n_head_kv=4,
    n_expert=64,
    n_expert_used=6,
    n_ff_exp=1408,
    n_layer_dense=1,
    n_vocab=32000,
    n_ctx=4096,
)
SHAPE_DRY = dataclasses.replace(
    SHAPE,
    n_embd=128,
    n_layer=4,
    n_ff=512,
    n_head=4,
    n_head_kv=2,
    n_expert=8,
    n_expert_used=2,
    n_ff_exp=128,
    n_vocab=512,
    n_ctx=256,
)
BUDGET_GIB = 16.0
N_CTX = 512
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]


def say(msg: str) -> None:
    print(f"[device_moe {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def expert_layers(path: Path) -> tuple[list[int], int]:
    """(bytes of each layer's expert stacks, bytes of everything else) of a GGUF."""
    from powerpy.formats.gguf_reader import read_gguf

    with read_gguf(path) as gf:
        n_layer = int(gf.kv[f"{gf.kv['general.architecture']}.block_count"])
        experts, rest = [0] * n_layer, 0
        for name, t in gf.tensors.items():
            if "_exps." in name:
                experts[int(name.split(".")[1])] += t.nbytes
            else:
                rest += t.nbytes
    return experts, rest


def fewest_cpu_moe(experts: list[int], rest: int, budget: int) -> int:
    """The smallest N of ``--n-cpu-moe N`` whose GPU part (all but the first N layers' experts,
    plus ``device_llama.RESERVE``) fits ``budget`` bytes."""
    for n in range(len(experts) + 1):
        if rest + sum(experts[n:]) + device_llama.RESERVE <= budget:
            return n
    return len(experts)


def _used(dev: torch.device) -> int | None:
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    return int(total - free)


def powerpy_row(name: str, path: Path, dev: torch.device, args, **placement) -> dict:
    """Decode tok/s of ``path`` loaded with ``placement`` (none: CPU-only)."""
    row: dict = {"engine": "powerpy", "config": name}
    base = _used(dev)
    t0 = time.perf_counter()
    kw = {"device": str(dev), "n_ctx": N_CTX, **placement} if placement else {}
    llm = load(path, use_mmap=True, **kw)
    row["load_s"] = round(time.perf_counter() - t0, 2)
    r = device_step.step_rates(llm, PROMPT, args.tokens, args.repeats)
    row["tok_s"] = max(r["graph"]["tok_s"], r["eager"]["tok_s"])
    row |= {f"{k}_{f}": r[k][f] for k in ("graph", "eager") for f in ("tok_s", "plan")}
    if "deferred" in r:  # the experts' cold neurons a layer late (--defer-cold)
        row["deferred_tok_s"] = r["deferred"]["tok_s"]
    used = _used(dev)
    row["vram_bytes"] = used - base if used is not None and base is not None else None
    if llm.runtime is not None:
        row["placed_bytes"] = llm.runtime.device_bytes
    del llm
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run(args) -> list[dict]:
    dev = torch.device("cpu" if args.dry_run else "cuda")
    shape = SHAPE_DRY if args.dry_run else dataclasses.replace(SHAPE, n_layer=args.layers)
    with tempfile.TemporaryDirectory(prefix="device_moe_", dir=args.workdir) as tmp:
        return _run(args, dev, shape, Path(tmp))


def _run(args, dev: torch.device, shape: TinySpec, work: Path) -> list[dict]:
    path = work / "deepseek-like.gguf"
    t0 = time.perf_counter()
    write_moe_model(path, shape, GGMLType.F16, device=str(dev))
    experts, rest = expert_layers(path)
    size = sum(experts) + rest
    budget = int(args.budget * GIB) if not args.dry_run else size // 2
    say(f"wrote {size / GIB:.1f} GiB in {time.perf_counter() - t0:.0f} s; budget {budget} bytes")
    rows: list[dict] = [{"model_bytes": size, "budget_bytes": budget, "shape": str(shape)}]

    cpu = load(path, use_mmap=True)
    t0 = time.perf_counter()
    res = profile(
        cpu,
        list(range(3, 3 + args.profile_tokens)),
        args.profile_tokens,
        ctx=min(64, args.profile_tokens),
        progress=False,
    )
    stats = work / "activation"
    save_activation_stats(stats, [torch.from_numpy(c) for c in res.counts])
    say(f"profiled {args.profile_tokens} tokens in {time.perf_counter() - t0:.0f} s")
    del cpu
    n_cpu_moe = fewest_cpu_moe(experts, rest, budget)
    configs = [
        ("cpu-only", {}),
        (
            "experts",
            {"vram_budget": budget / GIB, "activation_dir": stats, "reset_gpu_index": True},
        ),
        (f"--n-cpu-moe {n_cpu_moe}", {"vram_budget": budget / GIB, "n_cpu_moe": n_cpu_moe}),
    ]
    for name, placement in configs:
        try:
            row = powerpy_row(name, path, dev, args, **placement)
        except Exception as e:  # noqa: BLE001 - one failed configuration must not hide the rest
            row = {"engine": "powerpy", "config": name, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        say(str(row))
    threads = torch.get_num_threads()
    try:
        probe = device_llama.check_build(threads)
    except RuntimeError as e:
        rows.append({"engine": "llama.cpp", "error": str(e)})
        return rows
    for name, ngl, n in (("cpu-only", 0, None), (f"--n-cpu-moe {n_cpu_moe}", 999, n_cpu_moe)):
        r = device_llama.child(
            path,
            ngl if probe["gpu_offload"] else 0,
            threads,
            PROMPT,
            args.tokens,
            args.repeats,
            300,
            n_cpu_moe=n,
        )
        r.pop("system_info", None)
        rows.append({"engine": "llama.cpp", "config": name, **r})
        say(str(rows[-1]))
    return rows


def render(rows: list[dict]) -> str:
    head, body = rows[0], rows[1:]
    md = ["# A DeepSeek-like mixture beyond the GPU", "", f"model {head}", ""]
    cols = ["engine", "config", "tok_s", "graph_tok_s", "eager_tok_s", "deferred_tok_s"]
    cols += ["graph_plan", "vram_bytes"]
    cols += ["placed_bytes", "n_gpu_layers", "error"]
    md += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in body:
        cells = [r.get(c) for c in cols]
        md.append(
            "| "
            + " | ".join(
                "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)[:200]
                for v in cells
            )
            + " |"
        )
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="a tiny model, emulated accelerator")
    ap.add_argument("--budget", type=float, default=BUDGET_GIB, help="GiB of VRAM")
    ap.add_argument("--layers", type=int, default=SHAPE.n_layer)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile-tokens", type=int, default=64)
    ap.add_argument("--workdir", help="for the model's folder (default: /dev/shm, else $TMPDIR)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.tokens, args.repeats, args.profile_tokens = 2, 1, 16
        torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm")
    if args.workdir is None and shm.is_dir() and shutil.disk_usage(shm).free > 40 * GIB:
        args.workdir = str(shm)  # memory-backed: writing 27 GB costs no disk
    rows = run(args)
    for name, text in (
        ("device_moe.json", json.dumps(rows, indent=1, default=str)),
        ("device_moe.md", render(rows)),
    ):
        with atomic_write(args.out / name) as tmp:
            tmp.write_text(text)
    print(render(rows))
    return 0 if not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
