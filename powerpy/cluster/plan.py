"""Which layers go to which node: ``powerpy plan --pipeline auto`` and ``serve --pipeline auto``.

The plan reads the model's header only. For each node (its free RAM and VRAM, its read
bandwidths) and each run of layers it predicts what the stage needs and how long a decode step
takes there, with the placement's own rules: the dense offload pass of ``placement.budget``
(attention, predictors, FFN norms, the head, then the KV cache; the first misfit stops it), then
the hot FFN rows in what is left. A step reads every dense tensor once and the active share of
the FFN (all of it for a dense FFN, the routed experts' share for a mixture, ``activity`` for a
predictor-gated one), each from where it lies: a byte-roofline time, bytes over bandwidth. The
hot rows are taken as an even share of the FFN's activations (their statistics make it larger),
so a prediction errs on the slow side.

A dynamic programme over the cut points then picks, for 2, 3, ... nodes (the largest first),
the contiguous ranges with the least predicted time per token, stage times plus one hop per
stage boundary. A model that fits one node gets one stage, on its fastest node, unless a split
is predicted ``MIN_SPLIT_GAIN`` times faster (the other machines' GPUs holding more of it): on
machines whose memory alone grows, peers found a split slower. The chosen stages' memory is the
exact placement (``Placement.for_model``) of each stage's own view of the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from powerpy._fs import fmt_bytes
from powerpy.cluster.spec import StageSpec
from powerpy.config import ModelArgs
from powerpy.formats.gguf_reader import GGUFFile, _available_memory, read_gguf
from powerpy.model.stage import layer_span, stage_file
from powerpy.placement.budget import (
    ATTN,
    FFN,
    FFN_NORM,
    HOST,
    OUTPUT,
    PREDICTOR,
    classify_tensor,
    kv_cache_bytes,
)

HOP_SECONDS = 1.5e-3  # one stage boundary of a decode step: a Ray actor call on loopback
HOST_BW = 20e9  # bytes/s read from RAM when a node's was not measured
GPU_BW = 500e9  # ... from VRAM
RAM_HEADROOM = 0.9  # the share of a node's free RAM a stage may fill
MIN_SPLIT_GAIN = 1.25  # a model that fits one node is split only if predicted this much faster
CONTEXT = 512  # positions of KV cache a decode step reads, for the prediction
VRAM_RESERVE = 256 << 20  # a GPU's memory kept back (workspaces), as --vram-budget -1 does
_DENSE_LEVELS = (ATTN, PREDICTOR, FFN_NORM)


@dataclass(frozen=True)
class Node:
    """A machine as the plan sees it: bytes of free RAM and VRAM, read bandwidths (bytes/s)."""

    name: str
    ram: int
    vram: int = 0
    host_bw: float = HOST_BW
    gpu_bw: float = GPU_BW


@dataclass
class StagePlan:
    """One stage of a plan: its spec, RAM and VRAM needs, predicted seconds per token."""

    spec: StageSpec
    node: Node
    host_bytes: int
    device_bytes: int
    seconds: float
    hot_share: float = 0.0  # FFN rows on the GPU
    kv_on_gpu: bool = False


@dataclass
class Plan:
    """A model's stages over nodes, with the predicted speed of one sequence."""

    model: str
    stages: list[StagePlan]
    hop_seconds: float = HOP_SECONDS
    notes: list[str] = field(default_factory=list)

    @property
    def specs(self) -> list[StageSpec]:
        return [s.spec for s in self.stages]

    @property
    def seconds(self) -> float:
        """Predicted decode step of one sequence: every stage, and a hop between two."""
        return sum(s.seconds for s in self.stages) + self.hop_seconds * (len(self.stages) - 1)

    @property
    def tok_s(self) -> float:
        return 1.0 / self.seconds if self.seconds > 0 else math.inf

    @property
    def pipeline(self) -> str:
        """The plan as a ``--pipeline`` value."""
        return ",".join(str(s.spec) for s in self.stages)

    def table(self) -> str:
        """The plan as ``powerpy plan`` prints it."""
        lines = [f"{self.model}: {len(self.stages)} stage(s), --pipeline {self.pipeline}"]
        lines.append(
            f"{'stage':>5} {'node':<16} {'layers':<9} {'RAM':>10} {'VRAM':>10} "
            f"{'hot FFN':>8} {'tok/s':>8}"
        )
        for i, s in enumerate(self.stages):
            lines.append(
                f"{i:>5} {s.node.name:<16} {layer_span(s.spec.layers):<9} "
                f"{fmt_bytes(s.host_bytes):>10} {fmt_bytes(s.device_bytes):>10} "
                f"{100 * s.hot_share:>7.1f}% {1 / max(s.seconds, 1e-12):>8.1f}"
            )
        hops = len(self.stages) - 1
        lines.append(
            f"predicted: {self.tok_s:.2f} tok/s for one sequence (stages "
            f"{1e3 * sum(s.seconds for s in self.stages):.1f} ms + {hops} hop(s) x "
            f"{1e3 * self.hop_seconds:.1f} ms per token)"
        )
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "pipeline": self.pipeline,
            "tok_s": self.tok_s,
            "stages": [
                {
                    "layers": layer_span(s.spec.layers),
                    "node": asdict(s.node),
                    "host_bytes": s.host_bytes,
                    "device_bytes": s.device_bytes,
                    "hot_share": s.hot_share,
                    "kv_on_gpu": s.kv_on_gpu,
                    "tok_s": 1 / s.seconds,
                }
                for s in self.stages
            ],
            "notes": self.notes,
        }

    def json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


class _Layers:
    """Per-layer bytes of the model by placement category, and the ends' bytes."""

    def __init__(self, gf: GGUFFile, args: ModelArgs, n_ctx: int, kv_elem_bytes: int) -> None:
        n = args.n_layer
        self.by = {c: np.zeros(n, np.int64) for c in (*_DENSE_LEVELS, FFN, HOST)}
        self.embed = self.head = self.shared = 0
        for t in gf.tensors.values():
            cat, layer, _ = classify_tensor(t.name)
            if layer >= 0:
                self.by[cat if cat in self.by else HOST][layer] += t.nbytes
            elif cat == OUTPUT:
                self.head += t.nbytes
            elif t.name.startswith(("token_embd", "position_embd")):
                self.embed += t.nbytes
            else:
                self.shared += t.nbytes  # RoPE factors: every stage's
        self.kv = kv_cache_bytes(args.n_embd_gqa, 1, n_ctx, kv_elem_bytes)  # one layer
        self.kv_read = kv_cache_bytes(args.n_embd_gqa, 1, min(CONTEXT, n_ctx), kv_elem_bytes)
        self.tied = "output.weight" not in gf.tensors
        self.cum = {c: np.concatenate([[0], np.cumsum(v)]) for c, v in self.by.items()}
        self.placeable = gf.sparse or args.moe  # a hybrid placement needs a PWRI file or experts

    def total(self, cat: str, a: int, b: int) -> int:
        return int(self.cum[cat][b] - self.cum[cat][a])


def offload(
    layers: _Layers, a: int, b: int, budget: int, *, last: bool
) -> tuple[int, int, bool, int]:
    """(dense bytes, head bytes, KV cache, hot FFN bytes) that go to the GPU for layers [a, b)
    within ``budget`` bytes: the placement's dense pass at layer granularity (the first misfit
    stops it), then the hot rows in what is left."""
    if not (layers.placeable and budget > 0):
        return 0, 0, False, 0
    used = 0
    for cat in _DENSE_LEVELS:
        sizes = layers.by[cat][a:b]
        if used + sizes.sum() <= budget:
            used += int(sizes.sum())
            continue
        cum = np.cumsum(sizes)
        i = np.searchsorted(cum, budget - used, side="right")
        used += int(cum[i - 1]) if i else 0
        return used, 0, False, 0
    head = layers.head if last and used + layers.head <= budget else 0
    if last and not head:
        return used, 0, False, 0
    kv = layers.kv * (b - a)
    kv_gpu = used + head + kv <= budget
    left = budget - used - head - (kv if kv_gpu else 0)
    return used, head, kv_gpu, min(left, layers.total(FFN, a, b))


def stage_cost(
    layers: _Layers,
    a: int,
    b: int,
    node: Node,
    placed: tuple[int, int, bool, int],
    *,
    last: bool,
    activity: float,
) -> tuple[int, int, float, float]:
    """(RAM, VRAM, seconds per token, hot FFN share) of layers [a, b) on ``node`` with
    ``placed`` (``offload``'s four values) on its GPU: every dense byte and the active share of
    the FFN read once a step, from where it lies (the hot rows an even share of the FFN)."""
    gpu_dense, gpu_head, kv_gpu, hot = placed
    dense = sum(layers.total(c, a, b) for c in _DENSE_LEVELS)
    head = layers.head if last else 0
    ffn = layers.total(FFN, a, b)
    share = hot / ffn if ffn else 0.0
    kv, kv_read = layers.kv * (b - a), layers.kv_read * (b - a)
    host_read = (dense - gpu_dense) + (head - gpu_head) + (1 - share) * activity * ffn
    gpu_read = gpu_dense + gpu_head + share * activity * ffn
    host_read, gpu_read = (
        (host_read, gpu_read + kv_read) if kv_gpu else (host_read + kv_read, gpu_read)
    )
    seconds = host_read / node.host_bw + gpu_read / node.gpu_bw
    weights = dense + ffn + layers.total(HOST, a, b) + layers.shared + head
    weights += layers.embed if a == 0 or (last and layers.tied) else 0
    device = gpu_dense + gpu_head + hot + (kv if kv_gpu else 0)
    ram = weights - gpu_dense - gpu_head - hot + (0 if kv_gpu else kv)
    return ram, device, seconds, share


def plan_pipeline(
    path: str | os.PathLike[str],
    nodes: list[Node],
    *,
    n_ctx: int | None = None,
    vram_budget: float | None = None,
    kv_elem_bytes: int = 2,
    activity: float | None = None,
    hop_seconds: float = HOP_SECONDS,
    max_stages: int | None = None,
) -> Plan:
    """The stages for ``nodes`` with the least predicted time per token (see the module).

    Args:
        path: the model (its header is read).
        nodes: the machines (``actors.cluster_nodes`` probes a Ray cluster's).
        n_ctx: KV positions per stage, all sessions together (default the model's).
        vram_budget: GiB of VRAM a stage may use at most (None: the node's free VRAM).
        kv_elem_bytes: 2 (f16 cache) or 4.
        activity: the share of a gated FFN's rows a token reads (default: 1 for a dense FFN,
            experts used / experts for a mixture, 1 for a predictor-gated FFN, an upper bound).
        hop_seconds: the cost of one stage boundary per decode step.
        max_stages: at most this many stages (default: one per node).

    Raises:
        ValueError: no nodes, or the model does not fit them (the message says how much it
            needs and what they have).
    """
    if not nodes:
        raise ValueError("no nodes to plan for")
    with _model(path, n_ctx, kv_elem_bytes, activity) as (gf, args, n_ctx, layers, activity):
        order = sorted(nodes, key=lambda n: n.ram + n.vram, reverse=True)
        limit = min(max_stages or len(order), len(order), args.n_layer)
        singles = [_best_split(layers, args.n_layer, [n], vram_budget, activity) for n in order]
        single = min((f for f in singles if f is not None), key=lambda f: f[0], default=None)
        best = None
        for s in range(2, limit + 1):
            found = _best_split(layers, args.n_layer, order[:s], vram_budget, activity)
            if found is not None:
                found = (found[0] + hop_seconds * (s - 1), found[1])
                best = found if best is None or found[0] < best[0] else best
        if single is not None and (best is None or best[0] * MIN_SPLIT_GAIN > single[0]):
            best = single  # one node holds it: a split must win clearly (peers were slower)
        if best is None:
            need = int(
                sum(layers.by[c].sum() for c in layers.by)
                + layers.head
                + layers.embed
                + layers.shared
                + layers.kv * args.n_layer
            )
            have = sum(n.ram + n.vram for n in order)
            raise ValueError(
                f"{path}: the model needs about {fmt_bytes(need)} of RAM and VRAM with its KV "
                f"cache, the {len(order)} node(s) have {fmt_bytes(have)} free: add a machine "
                "or a smaller context (-c)"
            )
        stages = [
            _exact(gf, args, *cut, n_ctx, kv_elem_bytes, vram_budget, layers, activity)
            for cut in best[1]
        ]
    return Plan(str(path), stages, hop_seconds, _notes(gf, args, activity))


def predict(
    path: str | os.PathLike[str],
    nodes: list[Node],
    pipeline: str,
    *,
    n_ctx: int | None = None,
    vram_budget: float | None = None,
    kv_elem_bytes: int = 2,
    activity: float | None = None,
    hop_seconds: float = HOP_SECONDS,
) -> Plan:
    """The memory and predicted speed of a given split (``--pipeline HOST:A-B,...``; a host is
    the name of one of ``nodes``, ``*`` the largest node no stage names); a stage that does not
    fit its node gets a note.

    Raises:
        ValueError: a spec that does not parse or a host that is none of the nodes.
    """
    from powerpy.cluster.spec import parse_pipeline

    with _model(path, n_ctx, kv_elem_bytes, activity) as (gf, args, n_ctx, layers, activity):
        specs = parse_pipeline(pipeline, args.n_layer)
        by_name = {n.name: n for n in nodes}
        named = {s.host for s in specs}
        spare = sorted((n for n in nodes if n.name not in named), key=lambda n: -(n.ram + n.vram))
        stages, notes = [], []
        for s in specs:
            if s.host is None and not spare:
                raise ValueError(f"--pipeline {s}: no node is left for a stage on any host")
            node = spare.pop(0) if s.host is None else by_name.get(s.host)
            if node is None:
                raise ValueError(
                    f"--pipeline {s}: {s.host!r} is none of the nodes ({', '.join(by_name)})"
                )
            budget = vram_budget if s.vram_budget is None else s.vram_budget
            st = _exact(
                gf,
                args,
                s.layers.start,
                s.layers.stop,
                node,
                n_ctx,
                kv_elem_bytes,
                budget,
                layers,
                activity,
            )
            if st.host_bytes > RAM_HEADROOM * node.ram:
                notes.append(
                    f"stage {s} needs {fmt_bytes(st.host_bytes)} of RAM, {node.name} "
                    f"has {fmt_bytes(node.ram)} free"
                )
            stages.append(st)
    return Plan(str(path), stages, hop_seconds, notes + _notes(gf, args, activity))


@contextlib.contextmanager
def _model(path, n_ctx: int | None, kv_elem_bytes: int, activity: float | None):
    """(file, arguments, KV positions, per-layer bytes, FFN activity) of the model's header."""
    with read_gguf(path) as gf:
        args = ModelArgs.from_gguf(gf)
        n_ctx = n_ctx or args.default_n_ctx
        if activity is None:
            activity = args.n_expert_used / args.n_expert if args.moe else 1.0
        yield gf, args, n_ctx, _Layers(gf, args, n_ctx, kv_elem_bytes), activity


def _notes(gf: GGUFFile, args: ModelArgs, activity: float) -> list[str]:
    notes = []
    if not (gf.sparse or args.moe):
        notes.append("a dense GGUF runs on the CPUs: hybrid placement needs a PWRI file or experts")
    if args.sparse and activity == 1.0:
        notes.append(
            "predictor-gated FFN counted as dense (an upper bound): --activity sets "
            "the share of rows a token reads"
        )
    return notes


def _budget(node: Node, vram_budget: float | None) -> int:
    vram = max(0, node.vram - VRAM_RESERVE) if node.vram else 0
    if vram_budget is not None and vram_budget >= 0:
        vram = min(vram, int(vram_budget * (1 << 30)))
    return vram


def _best_split(layers: _Layers, n_layer: int, nodes: list[Node], vram_budget, activity):
    """(seconds, [(a, b, node)]) of the fastest split of all layers over ``nodes`` in order
    that fits, or None."""
    s_count, inf = len(nodes), math.inf
    cost = np.full((s_count + 1, n_layer + 1), inf)
    back = np.zeros((s_count + 1, n_layer + 1), np.int64)
    cost[0, 0] = 0.0
    for s, node in enumerate(nodes, 1):
        budget, last = _budget(node, vram_budget), s == s_count
        for b in range(s, n_layer + 1) if not last else (n_layer,):
            for a in range(s - 1, b):
                if cost[s - 1, a] == inf:
                    continue
                placed = offload(layers, a, b, budget, last=last)
                ram, _, sec, _ = stage_cost(
                    layers, a, b, node, placed, last=last, activity=activity
                )
                if ram <= RAM_HEADROOM * node.ram and cost[s - 1, a] + sec < cost[s, b]:
                    cost[s, b], back[s, b] = cost[s - 1, a] + sec, a
    if cost[s_count, n_layer] == inf:
        return None
    cuts, b = [], n_layer
    for s in range(s_count, 0, -1):
        a = int(back[s, b])
        cuts.append((a, b, nodes[s - 1]))
        b = a
    return float(cost[s_count, n_layer]), cuts[::-1]


def _exact(gf, args, a, b, node, n_ctx, kv_elem_bytes, vram_budget, layers, activity):
    """A chosen stage with its placement's own bytes (the stage's view of the file)."""
    last, budget = b == args.n_layer, _budget(node, vram_budget)
    placed = offload(layers, a, b, budget, last=last)
    if budget and layers.placeable:
        from powerpy.placement.placement import Placement

        view = stage_file(gf, range(a, b), args)
        p = Placement.for_model(view, budget, n_ctx=n_ctx, kv_elem_bytes=kv_elem_bytes)
        by = p.plan.bytes_by_category
        dense = sum(by.get(c, 0) for c in _DENSE_LEVELS)
        hot = min(p.plan.split_budget, layers.total(FFN, a, b))
        placed = (dense, by.get(OUTPUT, 0), p.kv_on_gpu, hot)
    ram, vram, sec, share = stage_cost(layers, a, b, node, placed, last=last, activity=activity)
    spec = StageSpec(range(a, b), node.name, budget / (1 << 30) if budget else None)
    return StagePlan(spec, node, ram, vram, sec, share, placed[2])


def this_node(name: str = "local", *, measure: bool = True) -> Node:
    """This machine as a node: its free RAM and VRAM (the first CUDA device), and, with
    ``measure``, its RAM read bandwidth (a 256 MiB probe) and the device's copy bandwidth."""
    ram = _available_memory() or 0
    vram, host_bw, gpu_bw = 0, HOST_BW, GPU_BW
    import torch

    if torch.cuda.is_available():
        vram = int(torch.cuda.mem_get_info()[0])
    if measure:
        from powerpy.benchmark import BandwidthProbe

        host_bw = BandwidthProbe(256 << 20)(repeats=3) * 1e9
        if vram:
            x = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            import time

            t0 = time.perf_counter()
            for _ in range(5):
                x.clone()
            torch.cuda.synchronize()
            gpu_bw = 2 * 5 * x.numel() / (time.perf_counter() - t0)
    return Node(name, ram, vram, host_bw, gpu_bw)


def parse_nodes(text: str) -> list[Node]:
    """``--nodes NAME:RAM_GIB[:VRAM_GIB[:HOST_GB_S[:GPU_GB_S]]],...`` (to plan for machines
    that are not running).

    Raises:
        ValueError: an entry that does not parse, naming it.
    """
    nodes = []
    for entry in (e.strip() for e in text.split(",")):
        name, *nums = entry.split(":")
        try:
            vals = [float(v) for v in nums]
        except ValueError:
            vals = []
        if not name or not 1 <= len(vals) <= 4 or any(v < 0 or not math.isfinite(v) for v in vals):
            raise ValueError(
                f"--nodes {entry!r}: write NAME:RAM_GIB[:VRAM_GIB[:HOST_GB_S[:GPU_GB_S]]], "
                "e.g. pc1:64:24 or pc2:128"
            )
        gib = [int(v * (1 << 30)) for v in vals[:2]] + [0] * (2 - len(vals[:2]))
        bws = [v * 1e9 for v in vals[2:]] + [HOST_BW, GPU_BW][len(vals[2:]) :]
        nodes.append(Node(name, gib[0], gib[1], bws[0], bws[1]))
    return nodes
