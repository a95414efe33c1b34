"""Model forward against an independent float64 reference, cache consistency, sparse = dense."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from powerpy.api import load
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.gguf_writer import write_gguf
from powerpy.model.ffn import ffn_dense, ffn_rows, glu
from powerpy.model.matrices import DenseWeight
from powerpy.model.numerics import Numerics
from powerpy.testing import TinySpec, tiny_kv, tiny_tensors, write_tiny_model

SPEC = TinySpec(n_embd=64, n_layer=2, n_ff=256, n_head=4, n_head_kv=2)


# ---------------------------------------------------------------- independent reference
def reference_logits(t: dict[str, np.ndarray], spec: TinySpec, tokens: list[int], variant: str):
    """Plain float64 numpy forward of the whole sequence (no cache), llama.cpp semantics."""
    d, hd = spec.n_embd, spec.n_embd // spec.n_head
    n = len(tokens)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + spec.norm_eps) * w

    def rope(x):  # x (n, heads, hd): rotate pairs (2i, 2i+1) by pos * base^(-2i/hd)
        z = x[..., 0::2] + 1j * x[..., 1::2]
        freqs = spec.rope_base ** (-np.arange(0, hd, 2) / hd)
        z = z * np.exp(1j * np.arange(n)[:, None, None] * freqs[None, None, :])
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out

    x = t["token_embd.weight"].astype(np.float64)[tokens]
    for l in range(spec.n_layer):
        g = {k: v.astype(np.float64) for k, v in t.items() if k.startswith(f"blk.{l}.")}
        h = rms(x, g[f"blk.{l}.attn_norm.weight"])
        q = rope((h @ g[f"blk.{l}.attn_q.weight"].T).reshape(n, spec.n_head, hd))
        k = rope((h @ g[f"blk.{l}.attn_k.weight"].T).reshape(n, spec.n_head_kv, hd))
        v = (h @ g[f"blk.{l}.attn_v.weight"].T).reshape(n, spec.n_head_kv, hd)
        att = np.zeros((n, spec.n_head, hd))
        rep = spec.n_head // spec.n_head_kv
        for head in range(spec.n_head):
            s = q[:, head] @ k[:, head // rep].T / math.sqrt(hd)
            s[np.triu_indices(n, 1)] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            att[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, head // rep]
        x = x + att.reshape(n, d) @ g[f"blk.{l}.attn_output.weight"].T
        h = rms(x, g[f"blk.{l}.ffn_norm.weight"])
        gate, up = h @ g[f"blk.{l}.ffn_gate.weight"].T, h @ g[f"blk.{l}.ffn_up.weight"].T
        if variant == "swiglu":
            a = gate / (1 + np.exp(-gate)) * up
        elif variant == "reglu":
            a = np.maximum(gate, 0) * up
        else:
            a = np.maximum(gate, 0) * np.maximum(up, 0)
        down_t = g.get(f"blk.{l}.ffn_down_t.weight")
        down_t = down_t if down_t is not None else g[f"blk.{l}.ffn_down.weight"].T
        x = x + a @ down_t
    x = rms(x, t["output_norm.weight"].astype(np.float64))
    return x @ t["output.weight"].astype(np.float64).T


TOKENS = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture
def dense_path(tmp_path):
    path = tmp_path / "tiny-dense.gguf"
    return path, write_tiny_model(path, SPEC, sparse=False, seed=1)


@pytest.fixture
def sparse_path(tmp_path):
    path = tmp_path / "tiny.powerinfer.gguf"
    return path, write_tiny_model(path, SPEC, sparse=True, seed=2)


def _logits(llm, tokens):
    return llm.logits(tokens, cache_dtype=torch.float32).double().numpy()  # exact KV cache


def test_dense_forward_matches_reference(dense_path):
    path, t = dense_path
    llm = load(path)
    assert not llm.model.args.sparse and llm.model.args.ffn_variant == "swiglu"
    ref = reference_logits(t, SPEC, TOKENS, "swiglu")
    np.testing.assert_allclose(_logits(llm, TOKENS), ref, atol=1e-4, rtol=0)


def test_sparse_file_dense_mode_is_reglu_reference(sparse_path):
    path, t = sparse_path
    llm = load(path, dense=True)
    assert llm.model.args.sparse and llm.model.args.ffn_variant == "reglu"
    ref = reference_logits(t, SPEC, TOKENS, "reglu")
    np.testing.assert_allclose(_logits(llm, TOKENS), ref, atol=1e-4, rtol=0)


def test_ffn_act_overrides_what_the_file_implies(dense_path, sparse_path):
    path, t = dense_path  # a dense GGUF of a ReLU model: only the user knows
    llm = load(path, ffn_act="relu")
    assert llm.model.args.ffn_variant == "reglu"
    ref = reference_logits(t, SPEC, TOKENS, "reglu")
    np.testing.assert_allclose(_logits(llm, TOKENS), ref, atol=1e-4, rtol=0)
    path, t = sparse_path
    llm = load(path, ffn_act="silu", dense=True)
    ref = reference_logits(t, SPEC, TOKENS, "swiglu")
    np.testing.assert_allclose(_logits(llm, TOKENS), ref, atol=1e-4, rtol=0)
    assert load(dense_path[0], ffn_act="gelu").model.args.ffn_variant == "geglu"
    with pytest.raises(ValueError, match=r"tiny-dense\.gguf: FFN activation 'tanh'"):
        load(dense_path[0], ffn_act="tanh")


def test_mmap_or_read_into_memory_give_the_same_logits(sparse_path, tmp_path):
    path, _ = sparse_path
    read_in, mapped = load(path), load(path, use_mmap=True)
    assert read_in.file.in_memory and not read_in.file.mapped
    assert mapped.file.mapped and not mapped.file.in_memory
    np.testing.assert_array_equal(_logits(read_in, TOKENS), _logits(mapped, TOKENS))
    res = subprocess.run(
        [sys.executable, "-m", "powerpy", "infer", "-m", str(path), "-p", "Hi", "-n", "2"]
        + ["--mmap", "--temp", "0"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("which", ["dense", "sparse"])
def test_prefill_then_decode_equals_full_forward(which, dense_path, sparse_path):
    path, _ = dense_path if which == "dense" else sparse_path
    llm = load(path)
    full = _logits(llm, TOKENS)
    cache = llm.model.new_cache(len(TOKENS), dtype=torch.float32)
    n_prefill = 5
    got = [llm.model.forward(torch.tensor(TOKENS[:n_prefill]), cache, all_logits=True)]
    for tok in TOKENS[n_prefill:]:
        got.append(llm.model.forward(torch.tensor([tok]), cache))
    got = torch.cat(got).double().numpy()
    assert np.abs(got - full).max() <= 1e-4


def test_sparse_at_minus_inf_equals_dense_relu(sparse_path):
    path, _ = sparse_path
    dense = load(path, dense=True)
    sparse = load(path, threshold=-math.inf)
    assert sparse.model.can_gate and sparse.options.sparse
    ref = _logits(dense, TOKENS)
    # prefill path (masked batch) and the one-token row-gather path
    np.testing.assert_allclose(_logits(sparse, TOKENS), ref, atol=1e-5, rtol=0)
    cache = sparse.model.new_cache(len(TOKENS), dtype=torch.float32)
    rows = [sparse.model.forward(torch.tensor([tok]), cache, sparse.options) for tok in TOKENS]
    np.testing.assert_allclose(torch.cat(rows).double().numpy(), ref, atol=1e-4, rtol=0)
    assert np.all(sparse.sparsity.active_fraction() == 1.0)


def test_oracle_mask_equals_dense():
    """Neurons with h == 0 contribute nothing: gathering only h != 0 rows equals dense."""
    g = torch.Generator().manual_seed(0)
    d, ff = 64, 512
    gate, up, down_t = (DenseWeight(torch.randn(ff, d, generator=g) / 8) for _ in range(3))
    x = torch.randn(d, generator=g)
    for variant in ("reglu", "drelu"):
        h = glu(gate.linear(x[None]), up.linear(x[None]), variant)[0]
        idx = (h != 0).nonzero().squeeze(1)
        assert 0 < idx.numel() < ff
        y_sparse = ffn_rows(x, gate, up, down_t, variant, idx)
        y_dense = ffn_dense(x[None], gate, up, down_t, variant)[0]
        torch.testing.assert_close(y_sparse, y_dense, atol=1e-5, rtol=1e-5)


def test_threshold_gates_and_reports_sparsity(sparse_path):
    path, t = sparse_path
    llm = load(path, threshold=0.0)
    llm.logits(TOKENS)
    frac = llm.sparsity.active_fraction()
    assert frac.shape == (SPEC.n_layer,)
    assert np.all((frac > 0.05) & (frac < 0.95)), frac
    # layer 0's predictor input is known exactly: recompute its mask by hand
    ref_inp = None

    def grab(layer, ffn_inp, h):
        nonlocal ref_inp
        if layer == 0:
            ref_inp = ffn_inp.clone()

    llm.options = dataclasses.replace(llm.options, observer=grab)
    llm.sparsity.reset()
    llm.logits(TOKENS)
    fc1, fc2 = t["blk.0.fc1.weight"], t["blk.0.fc2.weight"]
    logits = np.maximum(ref_inp.double().numpy() @ fc1.T, 0) @ fc2.T
    expect = (logits >= 0).sum() / (len(TOKENS) * SPEC.n_ff)
    assert abs(llm.sparsity.active_fraction()[0] - expect) < 1e-9


def test_threshold_key_precedence(tmp_path):
    path = tmp_path / "thr.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, threshold=-1.5)
    assert load(path).options.threshold == -1.5
    assert load(path, threshold=0.25).options.threshold == 0.25


def test_the_threshold_env_var_is_the_cli_default_not_the_library(tmp_path, monkeypatch):
    """``LLAMA_SPARSE_PRED_THRESHOLD`` is read by the command line as the default of
    ``--sparse-threshold``; ``load`` takes its parameter, then the file's key."""
    import argparse

    from powerpy.commands.common import sparse_threshold

    path = tmp_path / "thr.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, threshold=-1.5)
    monkeypatch.setenv("LLAMA_SPARSE_PRED_THRESHOLD", "0.75")
    assert load(path).options.threshold == -1.5  # the library does not read the environment
    assert sparse_threshold(argparse.Namespace(sparse_threshold=None)) == 0.75
    assert sparse_threshold(argparse.Namespace(sparse_threshold=0.25)) == 0.25  # the flag wins
    monkeypatch.setenv("LLAMA_SPARSE_PRED_THRESHOLD", "x")
    with pytest.raises(ValueError, match="LLAMA_SPARSE_PRED_THRESHOLD='x' is not a number"):
        sparse_threshold(argparse.Namespace(sparse_threshold=None))
    monkeypatch.delenv("LLAMA_SPARSE_PRED_THRESHOLD")
    assert sparse_threshold(argparse.Namespace(sparse_threshold=None)) is None


def test_threshold_key_must_be_float32(tmp_path):
    from powerpy.formats.constants import GGMLType, GGUFValueType

    kv = tiny_kv(SPEC)
    kv[Keys.SPARSE_THRESHOLD] = (1, GGUFValueType.INT32)
    tensors = [(n, a, GGMLType.F32) for n, a in tiny_tensors(SPEC, sparse=True).items()]
    path = tmp_path / "bad.powerinfer.gguf"
    write_gguf(path, kv, tensors, magic=b"PWRI")
    with pytest.raises(ValueError, match="FLOAT32"):
        load(path)


def test_missing_predictor_is_a_clear_error(tmp_path):
    from powerpy.formats.constants import GGMLType

    tensors = tiny_tensors(SPEC, sparse=True)
    del tensors["blk.1.fc2.weight"]
    path = tmp_path / "nopred.powerinfer.gguf"
    write_gguf(
        path, tiny_kv(SPEC), [(n, a, GGMLType.F32) for n, a in tensors.items()], magic=b"PWRI"
    )
    with pytest.raises(ValueError, match=r"blk\.1\.fc2\.weight.*powerpy convert"):
        load(path)


def test_bamboo_uses_drelu(tmp_path):
    spec = TinySpec(arch="bamboo")
    path = tmp_path / "bamboo.powerinfer.gguf"
    t = write_tiny_model(path, spec, sparse=True, seed=3)
    llm = load(path, dense=True)
    assert llm.model.args.ffn_variant == "drelu"
    ref = reference_logits(t, spec, TOKENS, "drelu")
    np.testing.assert_allclose(_logits(llm, TOKENS), ref, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="bamboo's FFN is dReLU"):
        load(path, ffn_act="silu")


def test_f16_file_matches_f32_within_half_precision(tmp_path):
    from powerpy.formats.constants import GGMLType

    p32, p16 = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_tiny_model(p32, SPEC, sparse=False, seed=4)
    write_tiny_model(p16, SPEC, sparse=False, seed=4, dtype=GGMLType.F16)
    a, b = _logits(load(p32), TOKENS), _logits(load(p16), TOKENS)
    assert np.abs(a - b).max() < 2e-2
    assert read_gguf(p16).tensors["blk.0.ffn_up.weight"].ggml_type == GGMLType.F16


def test_quant_types_stay_raw_and_f16_without_kernels(smollm2_path):
    """Q4_1 stays raw (memory-mapped blocks, ffn_down as stored); without the kernels it is
    dequantized to f16 at load. With f32 activations both match the f32 model closely."""
    from powerpy.formats.constants import GGMLType
    from powerpy.model.matrices import QuantWeight, TransposedWeight

    ref = load(smollm2_path, weight_format="f32")
    llm = load(smollm2_path)
    blk0 = llm.model.weights.blk[0]
    assert llm.file.tensors["blk.0.ffn_gate.weight"].ggml_type == GGMLType.Q4_1
    assert isinstance(blk0.ffn_gate, QuantWeight) and blk0.ffn_gate.ggml_type == GGMLType.Q4_1
    assert isinstance(blk0.ffn_down_t, TransposedWeight)
    assert blk0.ffn_down_t.shape == (1536, 576) and blk0.ffn_down_t.nbytes == 1536 * 576 * 20 // 32
    assert ref.model.weights.blk[0].ffn_gate.w.dtype == torch.float32
    ids = llm.tokenize("The Lord is my shepherd; I shall not want.")
    b = _logits(ref, ids)
    llm.options = dataclasses.replace(llm.options, numerics=Numerics(quantized_activations=False))
    a = _logits(llm, ids)
    assert np.abs(a - b).max() < 1e-3 * (b.max() - b.min())
    assert (a.argmax(-1) == b.argmax(-1)).all()

    f16 = load(smollm2_path, native_kernels=False)  # as without the kernels: f16 at load
    g16 = f16.model.weights.blk[0].ffn_gate
    assert g16.w.dtype == torch.float16
    np.testing.assert_allclose(  # f16 rounding only: 11 significant bits
        g16.w.float().numpy(), ref.model.weights.blk[0].ffn_gate.w.numpy(), rtol=2**-11
    )


@pytest.mark.parametrize("n_rot", [32, 16])
def test_rope_rotates_adjacent_pairs_of_the_first_n_rot_dims(n_rot):
    from powerpy.config import ModelArgs
    from powerpy.model.attention import apply_rope, rope_tables

    args = ModelArgs(
        arch="llama",
        n_vocab=8,
        n_embd=64,
        n_layer=1,
        n_ff=8,
        n_head=2,
        n_head_kv=1,
        n_rot=n_rot,
        rope_base=10000.0,
        norm_eps=1e-5,
        n_ctx_train=64,
        sparse=False,
        ffn_variant="swiglu",
        sparse_threshold=0.0,
    )
    x = torch.randn(5, 2, 32)  # (T, heads, head_dim) at positions 7..11
    got = apply_rope(x, rope_tables(args, torch.arange(7, 12)), n_rot).double().numpy()
    xd = x.double().numpy()
    want = xd.copy()
    for t in range(5):
        for i in range(n_rot // 2):
            ang = (7 + t) * 10000.0 ** (-2 * i / n_rot)
            a, b = xd[t, :, 2 * i], xd[t, :, 2 * i + 1]
            want[t, :, 2 * i] = a * np.cos(ang) - b * np.sin(ang)
            want[t, :, 2 * i + 1] = a * np.sin(ang) + b * np.cos(ang)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.array_equal(got[..., n_rot:], xd[..., n_rot:])  # the tail is not rotated


@pytest.mark.parametrize(
    ("tensor", "value", "where"),
    [
        ("blk.1.ffn_up.weight", float("nan"), r"NaN at blk\.1, in the FFN"),
        # sums overflow: +inf and -inf products meet, so NaN or infinite by the sum's order
        ("blk.0.attn_output.weight", 3e38, r"(infinite|NaN) at blk\.0, in attention"),
        ("token_embd.weight", float("inf"), r"infinite at token_embd\.weight"),
    ],
)
def test_non_finite_weights_name_the_first_bad_layer(tmp_path, tensor, value, where):
    from powerpy.errors import NonFiniteError, PowerpyError
    from powerpy.formats.constants import GGMLType

    t = tiny_tensors(SPEC, sparse=False, seed=2)
    t[tensor] = t[tensor].copy()
    t[tensor].flat[:: 1 if value == 3e38 else t[tensor].size // 64] = value  # 3e38: sums overflow
    path = tmp_path / "bad.gguf"
    write_gguf(path, tiny_kv(SPEC), [(n, a, GGMLType.F32) for n, a in t.items()])
    llm = load(path)
    with pytest.raises(NonFiniteError, match=where) as e:
        llm.generate(TOKENS, max_tokens=2, temperature=0.8, seed=1)
    assert isinstance(e.value, PowerpyError) and "powerpy dump" in str(e.value)


@pytest.mark.parametrize("dense", [False, True])
def test_fused_decode_ffn_equals_the_general_path(sparse_path, monkeypatch, dense):
    """CPU-only decode runs each FFN (predictor included) as one native call; it computes the
    same neurons, statistics and logits as the step-by-step path."""
    from powerpy.model import kernels, stack_decode, transformer

    if not kernels.available():
        pytest.skip("native kernels unavailable")
    path, _ = sparse_path
    llm = load(path, threshold=0.0, dense=dense)
    runs = []
    for mode in ("stack", "layers", "general"):  # one call per token, two per layer, torch
        if mode == "layers":
            monkeypatch.setattr(stack_decode, "plan_for", lambda *a: None)
        if mode == "general":
            monkeypatch.setattr(transformer, "fused_decode", lambda *a: None)
        if llm.sparsity is not None:
            llm.sparsity.reset()
        steps = []
        cache = llm.model.new_cache(16, dtype=torch.float32)
        llm.model.forward(torch.tensor(TOKENS[:4]), cache, llm.options)
        for t in TOKENS[4:10]:
            steps.append(llm.model.forward(torch.tensor([t]), cache, llm.options))
        got = [r.token for r in llm.stream(TOKENS[:4], 12, temperature=0)]
        frac = None if dense else llm.sparsity.active_fraction().copy()
        runs.append((got, frac, torch.cat(steps).numpy()))
    (t1, s1, l1), (t2, s2, l2), (t3, s3, l3) = runs
    assert t1 == t2 == t3
    np.testing.assert_array_equal(l1, l2)  # the same kernels in the same order
    np.testing.assert_allclose(l1, l3, rtol=1e-5, atol=1e-5)
    if not dense:
        np.testing.assert_array_equal(s1, s2)
        np.testing.assert_allclose(s1, s3)
        assert np.all((s1 > 0.05) & (s1 < 0.95)), s1


def test_a_timed_step_reads_the_native_phase_clock(sparse_path, monkeypatch):
    """A per-phase timer keeps a token in one native call: the step's phase clock times its
    blocks (the projections inside attention, the predictor and the down pass inside the FFN)
    and the logits are the untimed step's bits; ``powerpy bench`` reports the projections'
    bandwidth from it."""
    from powerpy import benchmark
    from powerpy.model import kernels, stack_decode
    from powerpy.model.options import RunOptions
    from powerpy.model.timing import PhaseTimer

    if not kernels.available():
        pytest.skip("native kernels unavailable")
    llm = load(sparse_path[0], threshold=0.0)
    calls = []
    run = stack_decode.StackPlan.run
    monkeypatch.setattr(stack_decode.StackPlan, "run", lambda *a: calls.append(1) or run(*a))
    logits = []
    for timer in (None, PhaseTimer()):
        cache = llm.model.new_cache(16, dtype=torch.float32)
        opts = RunOptions(threshold=0.0, timer=timer)
        logits.append([llm.model.forward(torch.tensor([t]), cache, opts) for t in TOKENS[:5]])
    assert len(calls) == 10  # every step, timed or not, was one native call
    for a, b in zip(*logits, strict=True):
        assert torch.equal(a, b)
    ms = timer.seconds
    assert set(stack_decode.PHASES) <= set(ms) and all(ms[k] > 0 for k in stack_decode.PHASES)
    assert ms["attention_proj"] < ms["attention"]
    assert ms["predictor"] + ms["ffn_down"] < ms["ffn"]
    with pytest.raises(ValueError, match="status"):  # a clock of the wrong length is refused
        monkeypatch.setattr(stack_decode, "PHASES", stack_decode.PHASES[:-1])
        llm.model.forward(torch.tensor([1]), cache, opts)
    monkeypatch.undo()
    (row,) = benchmark.bench_mode(llm.model, "sparse", 0, 4, bandwidth=10.0)
    assert set(stack_decode.PHASES) <= set(row.phases_ms)
    want = benchmark.attention_weight_bytes(llm.model) / row.phases_ms["attention_proj"] / 1e6
    assert (
        row.attention_gb_s == pytest.approx(want) and row.attention_share == row.attention_gb_s / 10
    )


def test_bytes_per_token_counts_the_kv_cache_at_its_element_size(sparse_path):
    """A step's KV bytes are the caches' own: 2 bytes an element by default (f16), 4 with
    ``cache_type="f32"``; the predictors count where the model's own ``Block.gates`` says."""
    from powerpy import benchmark
    from powerpy.model.options import RunOptions

    for cache_type, size in (("f16", 2), ("f32", 4)):
        model = load(sparse_path[0], cache_type=cache_type).model
        assert model.new_cache(4).k.element_size() == size
        a = model.args
        got = benchmark.bytes_per_token(model, 10.0, None)["kv"]
        assert got == 2 * a.n_layer * 10.0 * a.n_embd_gqa * size
    active = np.ones(a.n_layer)
    pred = sum(b.fc1.nbytes + b.fc2.nbytes for b in model.weights.blk if b.gates(RunOptions()))
    assert pred > 0 and benchmark.bytes_per_token(model, 10.0, active)["predictor"] == pred


def test_bench_runs_the_modes_in_paired_rounds_beside_read_probes(sparse_path, monkeypatch):
    """``run_bench`` runs sparse and dense in turn each round, with a read probe after each:
    a tg row is its fastest run, judged against the best probe next to that run, and the
    sparse/dense line is the median of the rounds' own ratios."""
    from powerpy import benchmark

    llm = load(sparse_path[0], threshold=0.0)
    probes = iter([10.0, 20.0, 5.0, 40.0, 8.0])  # before; after sparse, dense; sparse, dense
    monkeypatch.setattr(benchmark.BandwidthProbe, "__init__", lambda self: None)
    monkeypatch.setattr(benchmark.BandwidthProbe, "__call__", lambda self, repeats=7: next(probes))
    secs = {True: iter([1.0, 0.5]), False: iter([2.0, 2.5])}  # the untimed tg runs, per round
    order, run_tg = [], benchmark.run_tg

    def fake(model, n_gen, opts, first_token=0):
        took = run_tg(model, n_gen, opts, first_token)
        if opts.stats is None:  # the timed run, or the dense run counting the down rows read
            return took
        order.append(opts.sparse)
        return next(secs[opts.sparse])

    monkeypatch.setattr(benchmark, "run_tg", fake)
    res = benchmark.run_bench(llm.model, n_prompt=0, n_gen=4, repetitions=2, floor=False)
    assert order == [True, False, True, False]
    assert res.probes == [10.0, 20.0, 5.0, 40.0, 8.0] and res.bandwidth_gb_s == 40.0
    s, d = res.tg("sparse"), res.tg("dense")
    assert (s.seconds, s.bandwidth_gb_s, d.seconds, d.bandwidth_gb_s) == (0.5, 40.0, 2.0, 20.0)
    assert s.ceiling_share == pytest.approx(s.gb_s / 40) and d.ceiling_share == d.gb_s / 20
    assert s.attention_share == pytest.approx(s.attention_gb_s / 40)
    assert res.tg_ratios == [2.0, 5.0]
    assert "3.50x, median of 2 paired rounds, 2.00-5.00" in res.speedup()
    assert "sparse 40.0 GB/s, dense 20.0 GB/s" in res.table()
    assert res.to_dict()["sparse_dense_tg_ratios"] == [2.0, 5.0]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_fused_decode_attention_equals_the_torch_path(dense_path, monkeypatch, cache_dtype):
    """CPU-only decode runs attention (q/k/v, RoPE, cache write, GQA softmax, output) as one
    native call; its logits and cache rows match the torch path over many positions."""
    from powerpy.model import kernels, stack_decode, transformer

    if not kernels.available():
        pytest.skip("native kernels unavailable")
    path, _ = dense_path
    model = load(path).model
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(transformer, "attention_block", lambda *a: None)
            monkeypatch.setattr(stack_decode, "plan_for", lambda *a: None)
        cache = model.new_cache(32, dtype=cache_dtype)
        model.forward(torch.tensor(TOKENS[:3]), cache)  # prefill: the torch path
        steps = [model.forward(torch.tensor([t]), cache) for t in TOKENS[3:]]  # decode
        runs.append((torch.cat(steps), cache.k[:, : cache.pos].clone(), cache.v.clone()))
    (l1, k1, v1), (l2, k2, v2) = runs
    tol = 1e-5 if cache_dtype == torch.float32 else 1e-3
    torch.testing.assert_close(l1, l2, rtol=tol, atol=tol)
    torch.testing.assert_close(k1, k2, rtol=tol, atol=tol)
    torch.testing.assert_close(v1, v2, rtol=tol, atol=tol)


@pytest.mark.parametrize("fused", [True, False])
def test_dense_layers_run_ungated(tmp_path, monkeypatch, fused):
    """powerpy.dense_layers: a listed layer's FFN computes every neuron in sparse mode, exactly
    as if its predictor kept them all, and reports them all active; the others stay gated."""
    from powerpy.model import stack_decode, transformer
    from powerpy.model.options import RunOptions, SparsityStats

    if not fused:
        monkeypatch.setattr(transformer, "fused_decode", lambda *a, **k: None)
        monkeypatch.setattr(stack_decode, "plan_for", lambda *a: None)
    t = tiny_tensors(SPEC, sparse=True, seed=3)
    kv = tiny_kv(SPEC)
    listed = tmp_path / "listed.powerinfer.gguf"
    kv[Keys.DENSE_LAYERS] = ([1], GGUFValueType.ARRAY, GGUFValueType.UINT32)
    f32 = GGMLType.F32
    write_gguf(listed, kv, [(n, x, f32) for n, x in t.items()], magic=b"PWRI")
    keep_all = tmp_path / "keep-all.powerinfer.gguf"  # layer 1's predictor outputs 0 >= thr 0
    t2 = dict(t, **{"blk.1.fc1.weight": np.zeros_like(t["blk.1.fc1.weight"])})
    write_gguf(keep_all, tiny_kv(SPEC), [(n, x, f32) for n, x in t2.items()], magic=b"PWRI")
    a, b = load(listed, threshold=0.0), load(keep_all, threshold=0.0)
    assert a.model.args.dense_layers == (1,)
    assert [blk.sparse_layer for blk in a.model.weights.blk] == [True, False]
    for llm in (a, b):
        llm.sparsity.reset()
    got, want = _logits(a, TOKENS), _logits(b, TOKENS)  # prefill
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a.sparsity.active_fraction(), b.sparsity.active_fraction())
    assert a.sparsity.active_fraction()[1] == 1.0 and a.sparsity.active_fraction()[0] < 0.95
    for llm in (a, b):  # decode, token by token
        cache = llm.model.new_cache(32, dtype=torch.float32)
        stats = SparsityStats.empty(SPEC.n_layer, SPEC.n_ff)
        opts = RunOptions(threshold=0.0, stats=stats)
        llm.out = [llm.model.forward(torch.tensor([tok]), cache, opts) for tok in TOKENS]
        llm.frac = stats.active_fraction()
    np.testing.assert_allclose(torch.cat(a.out), torch.cat(b.out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a.frac, b.frac)


@pytest.mark.parametrize(
    "spec",
    [
        TinySpec(
            arch="gpt-oss", n_layer=3, n_ff_exp=32, n_expert=4, n_expert_used=2, sliding_window=8
        ),
        TinySpec(
            arch="deepseek2",
            n_layer=3,
            n_ff_exp=32,
            n_expert=4,
            n_expert_used=2,
            n_layer_dense=1,
            n_rot=16,
            kv_lora_rank=64,
            key_length_mla=48,
            value_length_mla=32,
        ),
        TinySpec(
            arch="glm4moe", n_layer=3, n_ff_exp=32, n_expert=4, n_expert_used=2, n_layer_dense=1
        ),
    ],
    ids=lambda s: s.arch,
)
def test_the_dispatch_floor_is_a_tiny_model_of_the_same_family(tmp_path, spec):
    """``powerpy bench``'s floor writes a tiny model with the family's keys (a window, a
    latent, leading dense layers) and times it; it used to refuse gpt-oss for its window."""
    from powerpy import benchmark
    from powerpy.testing.moe import write_moe_model

    path = write_moe_model(tmp_path / f"{spec.arch}.gguf", spec)
    llm = load(path)
    ms = benchmark.dispatch_overhead_ms(llm.model, sparse=False, n_gen=2)
    assert 0.0 < ms < 1e4
    # the file's projection matrices and biases (deepseek2: its latent ones; attn_q/k/v absent)
    projections = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_a", "attn_q_b")
    projections += ("attn_kv_a_mqa", "attn_k_b", "attn_v_b")
    with read_gguf(path) as gf:
        want = sum(
            t.nbytes
            for name, t in gf.tensors.items()
            if name.startswith("blk.") and name.split(".")[2] in projections  # biases too
        )
    assert benchmark.attention_weight_bytes(llm.model) == want
