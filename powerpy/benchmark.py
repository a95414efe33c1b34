"""llama-bench-style measurements: prompt processing (pp) and token generation (tg) speed, bytes
read per token against the memory-bandwidth ceiling (docs/kernels.md#bandwidth-limit), and a
per-phase breakdown."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from powerpy._fs import huge_page_buffer
from powerpy.model import stack_decode
from powerpy.model.numerics import DEFAULT as DEFAULT_NUMERICS
from powerpy.model.numerics import Numerics
from powerpy.model.options import SPARSE, RunOptions, SparsityStats
from powerpy.model.timing import PhaseTimer
from powerpy.model.transformer import Model
from powerpy.pipeline.research import Loaded

log = logging.getLogger(__name__)


@dataclass
class BenchRow:
    """One measured test of one mode (``sparse`` or ``dense``) of a model."""

    mode: str
    test: str  # "pp512", "tg128"
    tokens: int
    seconds: float
    tok_s: float
    bytes_per_token: float = 0.0  # tg only: weight + KV bytes touched per token
    gb_s: float = 0.0  # effective bandwidth: bytes_per_token * tok_s
    ceiling_share: float = 0.0  # gb_s / bandwidth_gb_s
    active_fraction: float = 1.0  # mean predicted-active FFN neurons
    # tg: ms per token per phase, from one more timed run (the native phase clock where a
    # token is one native call, else the per-layer calls' timers)
    phases_ms: dict[str, float] = field(default_factory=dict)
    # tg: the attention projections' weight bytes over their phase's time (0: not timed apart)
    attention_gb_s: float = 0.0
    attention_share: float = 0.0  # attention_gb_s / bandwidth_gb_s
    # tg: the read bandwidth this row is judged against (the best probe next to its run)
    bandwidth_gb_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class BandwidthProbe:
    """Memory read bandwidth in GB/s, probed as often as the host drifts: each call returns the
    best of ``repeats`` reads of one ``n_bytes`` buffer, kept between calls.

    Two readers alternate, on ``torch.get_num_threads()`` threads: ``torch.sum`` and, when
    built, the native library's read loop (the GEMV kernels' SIMD loads and prefetch); the
    fastest pass counts, so the ceiling is what this machine has shown it can read. The buffer
    is written first (its pages are resident) and is much larger than any cache. It lives in
    huge pages where the kernel allows them, as the weights ``load`` reads into memory do.
    """

    def __init__(self, n_bytes: int = 1 << 30) -> None:
        from powerpy.model import kernels

        self.n_bytes = n_bytes // 4 * 4
        self._mem = huge_page_buffer(self.n_bytes)
        buf = torch.frombuffer(self._mem, dtype=torch.float32).fill_(1.0)
        lib = kernels.library()
        self._readers = [buf.sum] + ([lambda: lib.stream_read(buf)] if lib is not None else [])

    def __call__(self, repeats: int = 7) -> float:
        best = float("inf")
        for i in range(repeats * len(self._readers)):
            t0 = time.perf_counter()
            self._readers[i % len(self._readers)]()
            best = min(best, time.perf_counter() - t0)
        return self.n_bytes / best / 1e9


def _nbytes(*mats) -> int:
    """Bytes of the matrices and vectors given (None: absent, e.g. an ungated FFN's gate)."""
    total = 0
    for m in mats:
        if isinstance(m, torch.Tensor):
            total += m.numel() * m.element_size()
        elif m is not None:
            total += m.nbytes
    return total


def _ffn_layer_bytes(model: Model, l: int) -> int:
    b = model.weights.blk[l]
    return _nbytes(b.ffn_gate, b.ffn_up, b.ffn_down_t)


def attention_weight_bytes(model: Model, first: int = 0) -> int:
    """Bytes of the q, k, v and output matrices (the attention projections) of layers first.."""
    total = 0
    for b in model.weights.blk[first:]:
        # DeepSeek-2's latent attention has its own projections (attn_q/k/v None)
        mats = (b.attn_q, b.attn_k, b.attn_v) if b.mla is None else b.mla.projections()
        total += _nbytes(*mats, b.attn_output)
    return total


def kv_element_size(model: Model) -> int:
    """Bytes per element of the caches ``model.new_cache()`` makes: the placed KV pool's dtype,
    else the model's host ``cache_dtype`` (f16 by default)."""
    dtype = model.kv.dtype if model.kv is not None else model.cache_dtype
    return torch.empty(0, dtype=dtype).element_size()


def bytes_per_token(
    model: Model, n_past: float, active: np.ndarray | None, down_read: np.ndarray | None = None
) -> dict[str, float]:
    """Bytes one decode step reads, by category (docs/kernels.md#bandwidth-limit).

    Args:
        model: the model (its weights' storage sizes are used).
        n_past: mean number of cached positions attended to.
        active: (n_layer,) active FFN fraction per layer (predicted and not cut), or None for
            dense.
        down_read: dense only: (n_layer,) share of down rows read, where h has exact zeros
            (a ReLU FFN: a zero's down row is skipped); None: all of them.
    """
    w, a = model.weights, model.args
    out: dict[str, float] = {
        "attention": float(attention_weight_bytes(model)),
        "norms": 0.0,
        "ffn": 0.0,
        "predictor": 0.0,
    }
    for l, b in enumerate(w.blk):
        out["norms"] += _nbytes(
            b.attn_norm,
            b.attn_norm_b,
            b.attn_norm_2,
            b.attn_norm_2_b,
            b.ffn_norm,
            b.ffn_norm_b,
            b.ffn_down_b,
        )
        frac = 1.0 if active is None else float(active[l])
        if b.moe is not None:  # the router and the routed experts' matrices, whole: a cut
            ex = b.moe  # zeroes h, but the stored down columns are read row by row anyway
            routed = ex.n_used / ex.n_expert
            out["ffn"] += ex.router.nbytes + routed * (
                ex.gate.nbytes + ex.up.nbytes + ex.down.nbytes
            )
            continue
        gates = active is not None and b.gates(SPARSE)  # the predictor gates it (its own test)
        if active is not None and b.down_tau is not None and not gates:
            # an ungated layer with a cut reads every gate and up row, and the kept down rows
            out["ffn"] += _nbytes(b.ffn_gate, b.ffn_up) + frac * b.ffn_down_t.nbytes
        elif active is None and down_read is not None:
            out["ffn"] += _nbytes(b.ffn_gate, b.ffn_up) + down_read[l] * b.ffn_down_t.nbytes
        else:
            out["ffn"] += frac * _ffn_layer_bytes(model, l)
        if gates:
            out["predictor"] += b.fc1.nbytes + b.fc2.nbytes
    out["output"] = _nbytes(w.output, w.output_norm, w.output_norm_b)
    out["embedding_row"] = w.token_embd.nbytes / a.n_vocab
    if w.position_embd is not None:
        out["embedding_row"] += w.position_embd.nbytes / w.position_embd.shape[0]
    out["kv"] = 2 * a.n_layer * n_past * a.n_embd_gqa * kv_element_size(model)
    return out


def _prompt(model: Model, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.args.n_vocab, (n,), generator=g)


def run_pp(model: Model, n_prompt: int, opts: RunOptions) -> float:
    """Seconds to prefill ``n_prompt`` tokens into a fresh cache."""
    tokens = _prompt(model, n_prompt)
    cache = model.new_cache(n_prompt)
    t0 = time.perf_counter()
    model.forward(tokens, cache, opts)
    return time.perf_counter() - t0


def run_tg(model: Model, n_gen: int, opts: RunOptions, first_token: int = 0) -> float:
    """Seconds to decode ``n_gen`` tokens one by one from an empty cache (greedy feedback).

    The first step (``first_token``, e.g. BOS) is a warm-up run without ``opts.timer`` and
    ``opts.stats``, and is not timed.
    """
    cache = model.new_cache(n_gen + 1)
    tok = torch.tensor([first_token])
    model.forward(tok, cache, dataclasses.replace(opts, timer=None, stats=None))
    t0 = time.perf_counter()
    for _ in range(n_gen):
        tok = model.forward(tok, cache, opts).argmax(-1)
    return time.perf_counter() - t0


def down_rows_read(
    model: Model, n_gen: int, opts: RunOptions, first_token: int = 0
) -> np.ndarray | None:
    """A dense run's (n_layer,) share of down rows read per layer, from one more decode run
    that observes h: the kernels skip the down row of a neuron whose h is exactly 0, which a
    ReLU FFN has for most neurons even without a predictor. None for an FFN without exact
    zeros (SwiGLU, GeGLU, GELU) or with experts."""
    a = model.args
    if a.ffn_variant.activation != "relu" or a.moe:
        return None
    nonzero, seen = np.zeros(a.n_layer), np.zeros(a.n_layer)

    def observer(l: int, x: torch.Tensor, h: torch.Tensor) -> None:
        nonzero[l] += int((h != 0).sum())
        seen[l] += h.numel()

    run_tg(model, n_gen, dataclasses.replace(opts, observer=observer, stats=None), first_token)
    return nonzero / np.maximum(seen, 1)


@dataclass
class _Run:
    """One mode's tests in one round: seconds of the pp and tg runs (inf: not run), the tg
    run's active FFN fractions, the round's timed run's ms per token by phase, and the best
    read probe taken next to the runs (GB/s)."""

    pp: float
    tg: float
    active: np.ndarray | None
    phases: dict[str, float]
    ceiling: float = 0.0


class _ModeBench:
    """One mode ("sparse" or "dense") of a model: its options, built layouts and runs."""

    def __init__(self, model: Model, mode: str, **opts) -> None:
        self.model, self.mode = model, mode
        self.sparse = mode == "sparse" and model.can_gate
        self.opts = RunOptions(sparse=self.sparse, **opts)
        stack_decode.prepare(model, self.opts)  # the mode's layouts (a sparse file's dense FFN)
        self.runs: list[_Run] = []

    def run(self, n_prompt: int, n_gen: int, first_token: int) -> _Run:
        """One pp run, one tg run and one more timed tg run (the phases)."""
        model, opts = self.model, self.opts
        pp = run_pp(model, n_prompt, opts) if n_prompt > 0 else float("inf")
        tg, active, phases = float("inf"), None, {}
        if n_gen > 0:
            stats = SparsityStats.empty(model.args.n_layer, model.args.ffn_neurons)
            tg = run_tg(model, n_gen, dataclasses.replace(opts, stats=stats), first_token)
            active = stats.active_fraction() if self.sparse else None
            # the native phase clock where a token is one call, else the per-layer calls'
            timer = PhaseTimer()
            timed = run_tg(model, n_gen, dataclasses.replace(opts, timer=timer), first_token)
            phases = {k: 1e3 * v / n_gen for k, v in timer.seconds.items()}
            inner = sum(v for k, v in phases.items() if k in ("attention", "ffn", "output"))
            phases["other"] = max(0.0, 1e3 * timed / n_gen - inner)
        self.runs.append(_Run(pp, tg, active, phases))
        return self.runs[-1]

    def rows(self, n_prompt: int, n_gen: int, first_token: int) -> list[BenchRow]:
        """The mode's pp and tg rows: each test's fastest run, judged against its own probes."""
        model, opts, mode = self.model, self.opts, self.mode
        rows = []
        if n_prompt > 0:
            secs = min(r.pp for r in self.runs)
            rows.append(BenchRow(mode, f"pp{n_prompt}", n_prompt, secs, n_prompt / secs))
        if n_gen > 0:
            best = min(self.runs, key=lambda r: r.tg)
            down = None if self.sparse else down_rows_read(model, n_gen, opts, first_token)
            b = sum(bytes_per_token(model, n_gen / 2, best.active, down).values())
            tps = n_gen / best.tg
            proj, plan = best.phases.get("attention_proj", 0.0), stack_decode.plan_for(model, opts)
            attn_gb_s = 0.0  # timed apart in the native step, which runs layers plan.first..
            if proj > 0 and plan is not None:
                attn_gb_s = attention_weight_bytes(model, plan.first) / proj / 1e6
            active = 1.0 if best.active is None else float(np.mean(best.active))
            rows.append(
                BenchRow(
                    mode,
                    f"tg{n_gen}",
                    n_gen,
                    best.tg,
                    tps,
                    bytes_per_token=b,
                    gb_s=b * tps / 1e9,
                    ceiling_share=b * tps / 1e9 / best.ceiling,
                    active_fraction=active,
                    phases_ms=best.phases,
                    attention_gb_s=attn_gb_s,
                    attention_share=attn_gb_s / best.ceiling,
                    bandwidth_gb_s=best.ceiling,
                )
            )
        return rows


def bench_mode(
    model: Model,
    mode: str,
    n_prompt: int,
    n_gen: int,
    bandwidth: float,
    repetitions: int = 1,
    *,
    threshold: float | None = None,
    cut_scale: float = 1.0,
    first_token: int = 0,
    numerics: Numerics = DEFAULT_NUMERICS,
) -> list[BenchRow]:
    """pp and tg rows for one mode ("sparse" or "dense"), best of ``repetitions``, judged
    against a given read ``bandwidth`` (GB/s)."""
    m = _ModeBench(model, mode, threshold=threshold, cut_scale=cut_scale, numerics=numerics)
    for _ in range(repetitions):
        m.run(n_prompt, n_gen, first_token).ceiling = bandwidth
    return m.rows(n_prompt, n_gen, first_token)


def _tiny_mla(a) -> dict:
    """Latent attention's dimensions at the floor model's size (2 heads of n_embd 32)."""
    return dict(
        n_rot=8,
        q_lora_rank=16 if a.q_lora_rank else 0,
        kv_lora_rank=32,
        key_length_mla=24,
        value_length_mla=16,
    )


def dispatch_overhead_ms(
    model: Model, sparse: bool, n_gen: int = 32, numerics: Numerics = DEFAULT_NUMERICS
) -> float:
    """Per-token time of a same-depth model with tiny matrices: the Python/dispatch floor."""
    import tempfile
    from pathlib import Path

    from powerpy.config import ModelArgs
    from powerpy.formats.gguf_reader import read_gguf
    from powerpy.model.loader import load_weights
    from powerpy.testing import TinySpec, write_tiny_model

    a = model.args
    spec = TinySpec(
        n_embd=32,
        n_layer=a.n_layer,
        n_ff=64,
        n_head=2,
        n_head_kv=2,
        arch=a.arch,
        n_expert=a.n_expert,
        n_expert_used=a.n_expert_used,
        # the family's structure at tiny widths: the same kinds of layers and steps
        n_expert_shared=a.n_expert_shared,
        n_layer_dense=a.n_layer_dense,
        sliding_window=8 if a.sliding_window else 0,
        **(_tiny_mla(a) if a.kv_lora_rank else {}),
    )
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "floor.gguf"
        write_tiny_model(path, spec, sparse=a.sparse)
        with read_gguf(path) as gf:
            targs = ModelArgs.from_gguf(gf)
            tiny = Model(targs, load_weights(gf, targs))
            opts = RunOptions(sparse=sparse, numerics=numerics)
            run_tg(tiny, 4, opts)
            secs = run_tg(tiny, n_gen, opts)
    return 1e3 * secs / n_gen


@dataclass
class BenchResult:
    """A ``powerpy bench`` run: its rows and the machine figures they are judged against.

    Attributes:
        model: the model's name.
        rows: pp and tg rows per mode, sparse first.
        bandwidth_gb_s: the best read probe of the run (each tg row's own ceiling is the
            best probe next to its run: ``BenchRow.bandwidth_gb_s``).
        threads: CPU threads.
        size_bytes: the model file's size.
        dispatch_ms: per-token time of a same-depth model with tiny matrices (0: not measured).
        probes: every read probe's GB/s, in the order taken (one before the first round, one
            after each mode's runs).
        tg_ratios: sparse over dense tg speed in each round (empty: not both measured).
    """

    model: str
    rows: list[BenchRow]
    bandwidth_gb_s: float
    threads: int
    size_bytes: int = 0
    dispatch_ms: float = 0.0
    probes: list[float] = field(default_factory=list)
    tg_ratios: list[float] = field(default_factory=list)

    def tg(self, mode: str) -> BenchRow | None:
        """The token-generation row of ``mode`` ("sparse" or "dense"), if measured."""
        return next((r for r in self.rows if r.mode == mode and r.test.startswith("tg")), None)

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "size_gb": self.size_bytes / 1e9,
            "threads": self.threads,
            "bandwidth_gb_s": self.bandwidth_gb_s,
            "python_overhead_ms_per_token": self.dispatch_ms,
            "probes_gb_s": self.probes,
            "sparse_dense_tg_ratios": self.tg_ratios,
            "rows": [r.to_dict() for r in self.rows],
        }

    def speedup(self) -> str | None:
        """The sparse/dense tg line: the median of the rounds' ratios (their range where there
        are several), and the ratio of bytes read; None without both modes' tg rows."""
        s, d = self.tg("sparse"), self.tg("dense")
        if s is None or d is None:
            return None
        rs = self.tg_ratios or [s.tok_s / d.tok_s]
        spread = ""
        if len(rs) > 1:
            spread = f", median of {len(rs)} paired rounds, {min(rs):.2f}-{max(rs):.2f}"
        return (
            f"sparse/dense tg speed: {float(np.median(rs)):.2f}x{spread} (bytes read: "
            f"{d.bytes_per_token / s.bytes_per_token:.2f}x)"
        )

    def table(self) -> str:
        """The llama-bench-style table ``powerpy bench`` prints, with the phase breakdown."""
        out = [
            f"| {'mode':6} | {'test':6} | {'t/s':>9} | {'active':>6} | {'MB/token':>9} | "
            f"{'GB/s':>6} | {'of BW':>6} |",
            "|" + "|".join("-" * w for w in (8, 8, 11, 8, 11, 8, 8)) + "|",
        ]
        for r in self.rows:
            if r.test.startswith("tg"):
                tail = (
                    f"{100 * r.active_fraction:5.1f}% | {r.bytes_per_token / 1e6:9.1f} | "
                    f"{r.gb_s:6.2f} | {100 * r.ceiling_share:5.1f}% |"
                )
            else:
                tail = f"{'':6} | {'':9} | {'':6} | {'':6} |"
            out.append(f"| {r.mode:6} | {r.test:6} | {r.tok_s:9.2f} | " + tail)
        tgs = [r for r in (self.tg("sparse"), self.tg("dense")) if r and r.bandwidth_gb_s]
        if tgs:
            out.append(
                "of BW: against the best read probe next to the run ("
                + ", ".join(f"{r.mode} {r.bandwidth_gb_s:.1f} GB/s" for r in tgs)
                + ")"
            )
        if (line := self.speedup()) is not None:
            out.append(line)
        for r in (self.tg("sparse"), self.tg("dense")):
            if r is not None:
                parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r.phases_ms.items()))
                out.append(f"{r.mode} tg ms/token by phase: {parts}")
                if r.attention_gb_s:
                    out.append(
                        f"{r.mode} attention projections: {r.attention_gb_s:.2f} GB/s, "
                        f"{100 * r.attention_share:.1f}% of BW"
                    )
        if self.dispatch_ms:
            out.append(
                f"python/dispatch floor (same depth, tiny matrices): {self.dispatch_ms:.2f} "
                "ms/token"
            )
        return "\n".join(out)

    def __repr__(self) -> str:
        tests = ", ".join(f"{r.mode} {r.test} {r.tok_s:.1f} tok/s" for r in self.rows)
        return f"<BenchResult {self.model}: {tests}>"

    def _repr_html_(self) -> str:
        from powerpy import _html

        rows = []
        for r in self.rows:
            tg = r.test.startswith("tg")
            rows.append(
                (
                    r.mode,
                    r.test,
                    f"{r.tok_s:.2f}",
                    _html.pct(r.active_fraction) if tg else "",
                    f"{r.bytes_per_token / 1e6:.1f}" if tg else "",
                    f"{r.gb_s:.2f}" if tg else "",
                    _html.pct(r.ceiling_share) if tg else "",
                )
            )
        notes = [f"{self.threads} threads, measured read bandwidth {self.bandwidth_gb_s:.1f} GB/s"]
        if (line := self.speedup()) is not None:
            notes.append(line)
        return _html.table(
            f"{self.model}: speed",
            ("mode", "test", "tok/s", "active", "MB/token", "GB/s", "of BW"),
            rows,
            notes=notes,
        )


def run_bench(
    model: Model,
    *,
    name: str = "",
    n_prompt: int = 512,
    n_gen: int = 128,
    repetitions: int = 1,
    modes: tuple[str, ...] | None = None,
    threshold: float | None = None,
    cut_scale: float = 1.0,
    first_token: int = 0,
    size_bytes: int = 0,
    floor: bool = True,
    numerics: Numerics = DEFAULT_NUMERICS,
) -> BenchResult:
    """Measure pp and tg speed per mode in paired rounds: each round runs every mode once, in
    turn, with a read probe (``BandwidthProbe``) after each, so that a shared host's drift
    falls on both modes of a round alike.

    Each row is its test's fastest run, and its share of the bandwidth is judged against the
    best probe next to that run (before or after it). The sparse/dense ratios
    (``BenchResult.tg_ratios``) are per round.

    Args:
        model: the model.
        name: its name, for tables and plots.
        n_prompt, n_gen: tokens of the pp and tg tests (0 skips a test).
        repetitions: rounds (each mode's best of this many runs).
        modes: ("sparse", "dense") by default for a model with predictors, else ("dense",).
        threshold: the predictor threshold (None: the file's).
        cut_scale: the scale of the file's FFN cuts in sparse runs (``RunOptions.cut_scale``).
        first_token: the warm-up token of tg (e.g. BOS).
        size_bytes: the model file's size, for the record.
        floor: also measure the dispatch floor (``dispatch_overhead_ms``).
        numerics: how the runs compute (``RunOptions.numerics``).

    Raises:
        ValueError: negative token counts or an unknown mode.
    """
    if n_prompt < 0 or n_gen < 0 or repetitions < 1:
        raise ValueError(
            f"bench needs n_prompt >= 0, n_gen >= 0 and repetitions >= 1 (got {n_prompt}, "
            f"{n_gen}, {repetitions})"
        )
    if modes is None:
        modes = ("sparse", "dense") if model.can_gate else ("dense",)
    bad = [m for m in modes if m not in ("sparse", "dense")]
    if bad:
        raise ValueError(f"unknown bench mode {bad[0]!r}: use 'sparse' or 'dense'")
    benches = [
        _ModeBench(model, m, threshold=threshold, cut_scale=cut_scale, numerics=numerics)
        for m in modes
    ]
    probe = BandwidthProbe()
    probes = [probe()]
    for _ in range(repetitions):
        for m in benches:
            run = m.run(n_prompt, n_gen, first_token)
            probes.append(probe(repeats=2))
            run.ceiling = max(probes[-2:])
    rows = [row for m in benches for row in m.rows(n_prompt, n_gen, first_token)]
    by_mode = {m.mode: m.runs for m in benches}
    ratios = []
    if n_gen > 0 and "sparse" in by_mode and "dense" in by_mode:
        ratios = [d.tg / s.tg for s, d in zip(by_mode["sparse"], by_mode["dense"], strict=True)]
    dispatch = 0.0
    if floor and n_gen > 0:
        dispatch = dispatch_overhead_ms(model, modes[0] == "sparse", numerics=numerics)
    return BenchResult(
        name, rows, max(probes), torch.get_num_threads(), size_bytes, dispatch, probes, ratios
    )


def bench(
    llm: Loaded, n_prompt: int = 128, n_gen: int = 32, repetitions: int = 1, **kwargs
) -> BenchResult:
    """Prompt and generation speed of a loaded model (``powerpy.load``'s ``LLM``), sparse and
    dense: :func:`run_bench` with its threshold, cut scale, numerics, name, BOS and file size.
    ``kwargs``: further keywords of :func:`run_bench` (``modes``, ``floor``)."""
    return run_bench(
        llm.model,
        name=llm.name,
        n_prompt=n_prompt,
        n_gen=n_gen,
        repetitions=repetitions,
        threshold=llm.options.threshold,
        cut_scale=llm.options.cut_scale,
        first_token=llm.tokenizer.bos_id or 0,
        size_bytes=llm.path.stat().st_size,
        numerics=llm.options.numerics,
        **kwargs,
    )
