"""The decode plan: one decode step of B sessions, built once per model, options and batch size.

A decode step computes the same thing every token, so what runs where is settled once, when the
plan is built, not asked again each token. A plan has up to two executors:

- the **host executor**, ``stack_decode.StackPlan``: the layers the native block kernels run on
  the CPU, all of them in one call (a CPU-only model's whole step; a partial placement's layers
  from the first one after which everything is on the host);
- the **device executor**, :class:`DeviceStep`, for a model whose every layer's attention,
  norms and predictor (a mixture's router and shared expert), the KV pool and the output are on
  the accelerator (a layer's FFN rows or expert neurons on the host run as host tasks of the
  device's stream, ``host_tasks``): the step
  as one function of fixed buffers (the token's embedding row, each session's position and first
  pool row, the RoPE tables of every position, the logits and the sparsity counts), captured once
  as a graph (``graphs.StepGraph``) and replayed: one replay and one copy of the logits per token.
  A capture that fails runs the same function eagerly, with a one-line warning naming the reason.

Server batches get plans at bucket sizes :data:`BUCKETS`, padded up to the next one: a padded
entry reads and writes the pool's scratch row, and its logits are dropped. The device's part
computes with the device's numerics (torch and the fused ops, as a GPU computes), so the
emulated device (``Accelerator("cpu")``) takes the same branches as CUDA.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from powerpy.families import Rope
from powerpy.model import kernels, numerics, stack_decode
from powerpy.model.attention import layer_rotations
from powerpy.model.cache import KVCache
from powerpy.model.device import OnDevices
from powerpy.model.graphs import CaptureError, StepGraph
from powerpy.model.host_tasks import ColdTasks, HostRowsError, hosted
from powerpy.model.options import RunOptions
from powerpy.model.step import Step

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16)  # batch sizes with plans of their own (a batch pads up to one)
DEVICE_NUMERICS = numerics.Numerics(native=False, quantized_activations=False)


def bucket(n: int) -> int | None:
    """The plan batch size of ``n`` sessions (None above the largest)."""
    return next((b for b in BUCKETS if b >= n), None)


@dataclass(frozen=True)
class PlanKey:
    """What a plan depends on: the options that change the step's computation, and B."""

    sparse: bool
    threshold: float | None
    cut_scale: float
    numerics: numerics.Numerics
    counts: bool  # sparsity statistics are kept
    eager: bool  # no graph: asked for, or a phase timer (its phases are host times)
    defer_cold: bool
    batch: int

    @classmethod
    def of(cls, opts: RunOptions, batch: int) -> PlanKey:
        return cls(
            opts.sparse,
            opts.threshold,
            opts.cut_scale,
            opts.numerics,
            opts.stats is not None,
            opts.timer is not None or not opts.graphs,
            opts.defer_cold,
            batch,
        )


class DeviceCounts:
    """The sparsity statistics of a device step, counted on the device: the FFN records each
    layer's mask here (the ``SparsityStats`` interface) and the counts travel to the host with
    the logits. What it learns in Python (which layers count, which run ungated) is learned at
    capture, so a replay repeats it."""

    def __init__(self, accel, n_layer: int, batch: int) -> None:
        self.accel = accel
        self.buf = accel.zeros(n_layer, batch, dtype=torch.int64)
        self.out = accel.pinned(n_layer, batch, dtype=torch.int64)
        self.masked: list[int] = []  # layers whose counts are in buf
        self.dense: list[int] = []  # layers that ran every neuron

    def record(self, layer: int, act: Tensor) -> None:
        self.buf[layer].copy_(act.sum(dim=1))
        self.masked.append(layer)

    def record_counts(self, layer: int, counts: Tensor) -> None:
        if counts.device.type == "cpu" and not self.accel.emulated:
            raise CaptureError(f"layer {layer} counts its neurons on the host")
        self.buf[layer].copy_(counts)
        self.masked.append(layer)

    def record_dense(self, layer: int, tokens: int) -> None:
        self.dense.append(layer)

    def record_count(self, layer: int, active: int) -> None:
        raise CaptureError(f"layer {layer} counts its neurons on the host")

    def copy_out(self) -> None:
        self.accel.copy_out(self.out, self.buf)

    def apply(self, stats, n: int) -> None:
        """Add one step's counts of its first ``n`` sessions to ``stats``."""
        for layer in self.masked:
            stats.record_counts(layer, self.out[layer, :n])
        for layer in self.dense:
            stats.record_dense(layer, n)


def _held(accel, *items) -> bool:
    """Every tensor or matrix in ``items`` (None: skipped) lives on the accelerator."""
    for it in items:
        if it is None:
            continue
        t = it if isinstance(it, Tensor) else it.storage
        if not accel.holds(t):
            return False
    return True


def device_refusal(model) -> str | None:
    """Why ``model``'s decode step cannot be one device step, or None when it can: every
    layer's attention, norms and predictor, the KV pool and the output placed (a layer's FFN
    rows on the host run as host tasks of the stream: ``host_tasks``)."""
    accel, w = model.accel, model.weights
    if accel is None:
        return "no accelerator"
    if model.kv is None:
        return "the KV cache stays on the host"
    if w.token_embd is None or w.output is None:
        return "a pipeline stage (it passes the residual stream on)"
    if not _held(accel, w.output_norm, w.output, w.output_norm_b):
        return "the output matrix stays on the host"
    for l, blk in enumerate(w.blk):
        if blk.mla is not None or blk.attn_sinks is not None:
            return f"layer {l}'s attention (latent, or with sinks) is not in the device step yet"
        attn = (blk.attn_norm, blk.attn_norm_b, blk.attn_q, blk.attn_k, blk.attn_v)
        attn += (blk.attn_output, blk.attn_q_norm, blk.attn_k_norm, blk.post_attention_norm)
        if not _held(accel, *attn):
            return f"layer {l}'s attention is not all placed"
        if not _held(accel, blk.ffn_norm, blk.ffn_norm_b, blk.post_ffw_norm, blk.ffn_down_b):
            return f"layer {l}'s FFN norms are not placed"
        if hosted(blk, accel) and kernels.library() is None:
            return f"layer {l} keeps FFN rows on the host, and the native kernels are off"
        if blk.moe is not None and (why := _moe_refusal(accel, blk)):
            return f"layer {l}'s {why}"
        if blk.fc1 is not None and not _held(accel, blk.fc1, blk.fc2):
            return f"layer {l}'s predictor stays on the host"
    return None


def _moe_refusal(accel, blk) -> str | None:
    """Why a mixture's layer is not in the device step, or None."""
    ex = blk.moe
    r = ex.routing
    if not _held(accel, ex.router, r.probs_b, r.router_b):
        return "router stays on the host"
    shexp = (blk.ffn_gate_inp_shexp, blk.ffn_gate_shexp, blk.ffn_up_shexp, blk.ffn_down_shexp)
    if not _held(accel, *shexp):
        return "shared expert stays on the host"
    if not ex.plain or ex.down_b is not None:
        return "experts (biased, or GPT-OSS's activation) are not in the device step yet"
    return None


def defer_refusal(model) -> str | None:
    """Why ``model``'s cold rows cannot be added a layer late (``RunOptions.defer_cold``), or
    None: a layer with host rows whose FFN output is normalized before it joins the residual
    stream (the hot and the cold parts cannot then be added apart)."""
    for l, blk in enumerate(model.weights.blk):
        if hosted(blk, model.accel) and blk.post_ffw_norm is not None:
            return f"layer {l} normalizes its FFN's output (post_ffw_norm)"
    return None


def _hybrid(model) -> bool:
    """Some layer keeps FFN rows on the host."""
    return any(hosted(b, model.accel) for b in model.weights.blk)


class DeviceStep:
    """A fully placed model's decode step of ``batch`` sessions as one function of fixed
    buffers (see the module doc), replayed as a graph where the device can capture one."""

    def __init__(self, model, opts: RunOptions, batch: int, graph: bool = True) -> None:
        a, accel = model.args, model.accel
        self.model, self.batch = model, batch
        self.opts = opts
        self.accel = accel
        self.x_in = accel.pinned(batch, a.n_embd, dtype=torch.float32)
        self.pos_in = accel.pinned(batch, dtype=torch.int64)
        self.base_in = accel.pinned(batch, dtype=torch.int64)
        self.out = accel.pinned(batch, a.n_vocab, dtype=torch.float32)
        self.x = accel.zeros(batch, a.n_embd, dtype=torch.float32)
        self.pos = accel.zeros(batch, dtype=torch.int64)
        self.base = accel.zeros(batch, dtype=torch.int64)
        self.counts = DeviceCounts(accel, a.n_layer, batch) if opts.stats is not None else None
        self.cold = None
        self.deferred = False  # the cold rows are added a layer late (RunOptions.defer_cold)
        if _hybrid(model):
            why = defer_refusal(model) if opts.defer_cold else None
            if why is not None:
                log.warning("decode step of %d: cold rows not deferred (%s)", batch, why)
            self.deferred = opts.defer_cold and why is None
            self.cold = ColdTasks(model, opts, batch, defer=self.deferred, served=graph)
        kv = model.kv
        self.span = kv.max_ctx
        self.scratch = kv.scratch
        self.tables = self._tables()
        self.graph: StepGraph | None = None
        self.reason: str | None = None  # why the step runs eagerly
        self._pool_cache = None  # the pool's scratch row (holding no session's cache alive)
        self._want_graph = graph
        # the last step's host seconds: until its work was queued (the embedding, the inputs'
        # copies, the replay or the eager launches), running its host tasks (a served worker's),
        # then waiting for its logits
        self.host_s = self.serve_s = self.wait_s = 0.0

    def _tables(self) -> list[Tensor | None] | None:
        """Each layer's RoPE of every position of the pool's longest cache, on the device:
        (positions, n_rot/2, 2) f32 (cos, sin), one tensor per distinct table."""
        a = self.model.args
        if a.family.rope is Rope.LEARNED:
            return None
        pos = torch.arange(self.span)
        with numerics.using(self.opts.numerics):  # the angles the eager step would use
            tables = layer_rotations(a, self.model.weights, pos, self.span)
        placed: dict[int, Tensor] = {}
        for t in tables:
            if id(t) not in placed:
                real = torch.view_as_real(t.contiguous()).contiguous()  # (span, n_rot/2, 2)
                placed[id(t)] = self.accel.to_device(real)
        return [placed[id(t)] for t in tables]

    def body(self) -> None:
        """The step over the fixed buffers: inputs in, layers, head, logits and counts out."""
        m, accel, B = self.model, self.accel, self.batch
        if self.counts is not None:  # learned anew by each run (a graph keeps its capture's)
            self.counts.masked.clear()
            self.counts.dense.clear()
        if self.cold is not None:
            self.cold.pending.clear()  # (a run that raised may have left some)
            self.cold.submitted = 0
        accel.copy_in(self.x, self.x_in)
        accel.copy_in(self.pos, self.pos_in)
        accel.copy_in(self.base, self.base_in)
        opts = self.opts
        if self.counts is not None:
            opts = dataclasses.replace(opts, stats=self.counts)
        with numerics.using(DEVICE_NUMERICS):
            step = Step(
                [self._pool_cache] * B, [1] * B, self.pos, self.base, self.tables, self.cold
            )
            rots = [None] * m.args.n_layer
            if self.tables is not None and not accel.fused:  # RoPE by torch ops: rows of pos
                rots = [
                    OnDevices(accel, torch.view_as_complex(t.index_select(0, self.pos)))
                    for t in self.tables
                ]
            x = m.layers(self.x, step, rots, opts, "batch")
            if self.cold is not None:
                x = self.cold.settle(None, x)  # the last deferred sums
            accel.copy_out(self.out, m.head(x, opts))
        if self.counts is not None:
            self.counts.copy_out()

    def run(self, tokens: Tensor, step, opts: RunOptions) -> Tensor:
        """One step of ``len(step.caches)`` sessions (at most ``batch``): their logits (n,
        n_vocab) f32 on the host."""
        t0 = time.perf_counter()
        if self.graph is None:  # an eager step runs with this call's timer (a graph, its own)
            self.opts = opts
        m, n = self.model, len(step.caches)
        if self._pool_cache is None:  # the pool's scratch row, as a cache the body's Step names
            self._pool_cache = KVCache.in_pool(step.caches[0].pool, self.scratch, 1)
        x = m.embed(tokens, step.positions())  # (n, n_embd) on the host
        self.x_in[:n].copy_(x)
        self.x_in[n:].zero_()
        self.pos_in[:n].copy_(torch.tensor([c.pos for c in step.caches]))
        self.base_in[:n].copy_(torch.tensor([c.base for c in step.caches]))
        self.pos_in[n:] = 0  # padding: the scratch row, position 0
        self.base_in[n:] = self.scratch
        if self.cold is not None:
            self.cold.set_tokens(n)
        if self.graph is None and self.reason is None and self._want_graph:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            t1 = time.perf_counter()
            self._serve()
        else:
            try:
                self.body()
            finally:
                t1 = time.perf_counter()
                self._serve()
        t2 = time.perf_counter()
        self.accel.wait(self.accel.record())
        # the last step's host seconds: queueing, running its host tasks, waiting for the logits
        self.host_s, self.serve_s, self.wait_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        if self.cold is not None:
            self.cold.check()
        logits = self.out[:n].clone()
        if self.counts is not None and opts.stats is not None:
            self.counts.apply(opts.stats, n)
        step.advance()
        return logits

    def _serve(self) -> None:
        """Run the host tasks the last run of the body submitted (or the graph replays), when
        this thread serves them (``host_tasks.ColdTasks.serve``): the stream's host functions
        hand them over as it reaches them."""
        if self.cold is not None:
            self.cold.serve(self.cold.submitted)

    def _capture(self) -> None:
        kind = self.accel.graph_kind()
        if kind is None:
            self.reason = "this device replays no graphs"
            return
        try:
            self.graph = StepGraph.capture(kind, self.body, self.accel.device, self._serve)
        except CaptureError as e:
            self.reason = str(e)
            log.warning(
                "decode step of %d: no %s graph (%s); running it eagerly", self.batch, kind, e
            )


class DecodePlan:
    """A decode step of up to ``batch`` sessions, its executors chosen once (module doc)."""

    def __init__(self, model, opts: RunOptions, batch: int) -> None:
        self.model, self.batch = model, batch
        self.device: DeviceStep | None = None
        self.refusal = device_refusal(model)
        self._lock = threading.Lock()  # the fixed buffers serve one step at a time
        if self.refusal is None:
            try:
                self.device = DeviceStep(
                    model, opts, batch, graph=opts.graphs and opts.timer is None
                )
            except HostRowsError as e:
                self.refusal = str(e)
                log.info("decode step of %d: the per-layer path (%s)", batch, e)

    def host(self, opts: RunOptions) -> stack_decode.StackPlan | None:
        """The host executor of a one-session step (``stack_decode.plan_for``, kept by the
        model's :class:`Plans` per mode), or None."""
        return stack_decode.plan_for(self.model, opts) if self.batch == 1 else None

    def run(self, tokens: Tensor, step, opts: RunOptions, ffn_mode: str) -> Tensor:
        """The step's logits (n, n_vocab) on the host: the device executor's when it has one
        and every cache is in the pool; else the layer loop, handing its host layers to the
        host executor."""
        if self.device is not None and step.pooled:
            with self._lock:
                return self.device.run(tokens, step, opts)
        return self.model._run(tokens, step, opts, True, ffn_mode, host=self.host(opts))


class Plans:
    """A model's plans, one per :class:`PlanKey`, built on first use and owned by the model
    (they hold its device buffers and graphs), and its host executors
    (``stack_decode.StackPlan``, one per ``stack_decode.plan_key``). Both are derived from the
    model's weights and a call's options, and do not change once built: every session over the
    model reads the same ones, and a run leaves nothing else behind."""

    def __init__(self) -> None:
        self._plans: dict[PlanKey, DecodePlan] = {}
        self._lock = threading.Lock()
        self._host: dict[tuple, stack_decode.StackPlan | None] = {}
        self._host_lock = threading.Lock()

    def host(self, key: tuple, build) -> stack_decode.StackPlan | None:
        """The host executor for ``key``, ``build()`` on first use (None: per-layer calls)."""
        with self._host_lock:
            if key not in self._host:
                self._host[key] = build()
            return self._host[key]

    def host_keys(self) -> list[tuple]:
        """The keys of the host executors built so far."""
        return list(self._host)

    def keys(self) -> list[PlanKey]:
        """The keys of the decode plans built so far."""
        return list(self._plans)

    def get(self, model, opts: RunOptions, n: int) -> DecodePlan | None:
        """The plan of an ``n``-session decode step under ``opts``, or None (observer, oracle,
        more sessions than the largest bucket)."""
        b = bucket(n)
        if b is None or opts.observer is not None or opts.oracle is not None:
            return None
        key = PlanKey.of(opts, b)
        with self._lock:
            if key not in self._plans:
                self._plans[key] = DecodePlan(model, opts, b)
            return self._plans[key]

    def __len__(self) -> int:
        return len(self._plans)
