"""Mixtures of experts on every runtime path (docs/moe.md): the experts as views of the file,
only the routed experts computed, the routing against a reference, the cut inside routed
experts and its one-command calibration, hybrid placements (emulated and fake CUDA), and the
refusals of files whose experts do not fit their keys.

The logits against llama.cpp are in ``test_moe_oracle.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_cuda import FakeCuda, run_prefill_and_decode
from moe_files import refused, write_gguf_py

from powerpy.api import load
from powerpy.cli import main
from powerpy.errors import FileFormatError, ModelConfigError, PlacementError
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys, Names
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.gpuidx import GpuIndex
from powerpy.formats.stats import save_activation_stats
from powerpy.model import interleave, moe, moe_host, numerics, stack_decode, transformer
from powerpy.model.device import Accelerator
from powerpy.model.matrices import QuantWeight
from powerpy.model.numerics import Numerics
from powerpy.model.options import RunOptions, SparsityStats
from powerpy.placement.placement import Placement
from powerpy.placement.runtime import build_hybrid
from powerpy.testing import TinySpec, tiny_tensors, write_tiny_model
from powerpy.testing.moe import write_moe_model

SPEC = TinySpec(n_layer=2, n_ff=128, n_expert=8, n_expert_used=2)
QWEN = TinySpec(arch="qwen3moe", n_layer=2, n_ff=256, n_ff_exp=64, n_expert=8, n_expert_used=3)
# Qwen2-MoE: a shared expert beside the routed ones; as many expert neurons as SPEC (1024)
SHARED = TinySpec(
    arch="qwen2moe", n_layer=2, n_ff=256, n_ff_exp=128, n_ff_shexp=96, n_expert=8, n_expert_used=2
)
TOKENS = torch.tensor([1, 72, 101, 108, 108, 111, 44, 32, 119, 111])
N_CTX = 32
EXACT = Numerics(quantized_activations=False)  # f32 activations: paths comparable to 1e-5


def _run(model, opts=None, n_prefill=6) -> torch.Tensor:
    """Logits of TOKENS: a prefill of the first n_prefill, then one token at a time (f32 KV)."""
    opts = opts or RunOptions()
    cache = model.new_cache(N_CTX, dtype=torch.float32)
    out = [model.forward(TOKENS[:n_prefill], cache, opts, all_logits=True)]
    out += [model.forward(TOKENS[i : i + 1], cache, opts) for i in range(n_prefill, len(TOKENS))]
    return torch.cat(out)


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "mixtral-q8_0.gguf"
    write_gguf_py(path, SPEC, GGMLType.Q8_0, seed=2)
    return path


def _cut_kv(t: float, n_layer: int = SPEC.n_layer) -> dict:
    return {Keys.FFN_DOWN_THRESHOLD: ([t] * n_layer, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)}


# ------------------------------------------------------------------------------ the experts
def test_the_experts_are_views_of_the_file(q8):
    llm = load(q8)
    a, blk = llm.model.args, llm.model.weights.blk[1]
    assert (a.n_expert, a.n_expert_used, a.n_ff_exp, a.ffn_neurons) == (8, 2, 128, 1024)
    assert blk.ffn_gate is None and blk.ffn_up is None and blk.ffn_down_t is None
    ex = blk.moe
    assert isinstance(ex.gate, QuantWeight) and ex.gate.shape == (8 * 128, 64)
    assert ex.down.shape == (8 * 64, 128) and ex.router.shape == (8, 64)
    raw = llm.file.raw(Names.FFN_GATE_EXPS.format(l=1))
    assert ex.gate.raw.data_ptr() == raw.ctypes.data  # no copy
    gate3, _, down3 = ex.expert(3)
    assert gate3.raw.data_ptr() == raw.ctypes.data + 3 * 128 * raw.shape[1]
    assert down3.shape == (64, 128)


def _reference(t: dict, l: int, x: np.ndarray, k: int, norm=True, scale=0.0) -> np.ndarray:
    """HF's Mixtral / Qwen3-MoE block in float64 from the f32 tensors: x (T, n_embd)."""
    r = t[Names.FFN_GATE_INP.format(l=l)].astype(np.float64)
    g, u = (t[n.format(l=l)].astype(np.float64) for n in (Names.FFN_GATE_EXPS, Names.FFN_UP_EXPS))
    down = t[Names.FFN_DOWN_EXPS.format(l=l)].astype(np.float64)
    logits = x @ r.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    out = np.zeros_like(x)
    for i in range(len(x)):
        top = np.argsort(-p[i], kind="stable")[:k]
        w = p[i, top] / (p[i, top].sum() if norm else 1.0) * (scale or 1.0)
        for e, we in zip(top, w, strict=True):
            gx, ux = g[e] @ x[i], u[e] @ x[i]
            out[i] += we * (down[e] @ (gx / (1 + np.exp(-gx)) * ux))
    return out


@pytest.mark.parametrize("norm, scale", [(True, 0.0), (False, 2.5)])
def test_the_routed_experts_match_a_float64_reference(tmp_path, norm, scale):
    extra = {} if norm else {"qwen3moe.expert_weights_norm": (False, GGUFValueType.BOOL)}
    extra |= {"qwen3moe.expert_weights_scale": (scale, GGUFValueType.FLOAT32)} if scale else {}
    t = write_gguf_py(tmp_path / "q.gguf", QWEN, GGMLType.F32, seed=4, extra_kv=extra)
    llm = load(tmp_path / "q.gguf")
    ex = llm.model.weights.blk[1].moe
    assert (ex.norm, ex.scale) == (norm, scale)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    opts = RunOptions(numerics=EXACT)
    from powerpy.model import numerics

    with numerics.using(EXACT):
        got = moe.moe_ffn(1, ex, x, opts, None)
        one = torch.cat([moe.moe_ffn(1, ex, x[i : i + 1], opts, None) for i in range(5)])
    want = _reference(t, 1, x.double().numpy(), 3, norm, scale)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=2e-5)
    np.testing.assert_allclose(one.numpy(), want, rtol=0, atol=2e-5)  # the decode path


def test_only_the_routed_experts_are_read(q8, monkeypatch):
    """Prefill (every layer but the last): each expert some token routes to, once for its gate
    and up rows and once for its down matrix; decode (one native call, or the per-op path with
    the same bits): one GLU pass over exactly the routed experts' rows, then their down
    matrices. No other expert of the stacks is touched."""
    llm = load(q8)
    layer_of = {id(b.moe): l for l, b in enumerate(llm.model.weights.blk)}
    routed, glus, touched = [], [], []
    route, glu, expert = moe.route, moe_host.glu_rows, moe.Experts.expert

    def spy_route(ex, x):
        routed.append(route(ex, x)[0])
        return route(ex, x)

    def spy_glu(x, gate, up, idx, variant):
        glus.append(idx)
        return glu(x, gate, up, idx, variant)

    def spy_expert(self, e):
        touched.append((layer_of[id(self)], e))
        return expert(self, e)

    monkeypatch.setattr(moe, "route", spy_route)
    monkeypatch.setattr(moe_host, "glu_rows", spy_glu)
    monkeypatch.setattr(moe.Experts, "expert", spy_expert)
    cache = llm.model.new_cache(N_CTX)
    llm.model.forward(TOKENS[:6], cache)
    for l in range(SPEC.n_layer):
        # the last layer's FFN runs for the last token alone (the only logits a prompt returns,
        # as in llama.cpp), on the one-token path: one GLU pass, then each down matrix
        last = l == SPEC.n_layer - 1
        assert routed[l].shape == (1 if last else 6, 2)
        want = sorted(torch.unique(routed[l]).tolist() * (1 if last else 2))
        assert sorted(e for k, e in touched if k == l) == want
    routed.clear(), glus.clear(), touched.clear()
    native_cache = llm.model.new_cache(N_CTX)
    llm.model.forward(TOKENS[:6], native_cache)
    routed.clear(), glus.clear(), touched.clear()
    stats = SparsityStats.empty(SPEC.n_layer, llm.model.args.ffn_neurons)
    native = llm.model.forward(TOKENS[6:7], native_cache, RunOptions(stats=stats))  # one call:
    # every layer's attention and experts in pp_decode_layers
    assert stats.active.tolist() == [2 * SPEC.n_ff] * SPEC.n_layer  # per layer: 2 experts' rows
    assert not routed and not touched  # the native block ran
    monkeypatch.setattr(transformer, "moe_decode", lambda *a: None)  # the per-op path
    monkeypatch.setattr(stack_decode, "usable", lambda *a: False)  # in the per-layer loop
    per_op = llm.model.forward(TOKENS[6:7], cache)
    assert torch.equal(per_op, native)  # the same bits
    for l in range(SPEC.n_layer):
        ids = routed[l][0].tolist()
        rows = torch.cat([torch.arange(e * SPEC.n_ff, (e + 1) * SPEC.n_ff) for e in ids])
        assert torch.equal(glus[l], rows)  # 2 of 8 experts' gate and up rows, one call
        assert sorted(e for k, e in touched if k == l) == sorted(ids)  # their down matrices


def test_decode_equals_prefill_and_stats_count_the_routed_share(tmp_path):
    write_gguf_py(tmp_path / "f32.gguf", SPEC, GGMLType.F32, seed=3)
    llm = load(tmp_path / "f32.gguf")
    cache = llm.model.new_cache(N_CTX, dtype=torch.float32)
    whole = llm.model.forward(TOKENS, cache, all_logits=True)
    torch.testing.assert_close(_run(llm.model, n_prefill=1), whole, rtol=0, atol=2e-5)
    stats = SparsityStats.empty(SPEC.n_layer, llm.model.args.ffn_neurons)
    _run(llm.model, RunOptions(stats=stats))
    np.testing.assert_allclose(stats.active_fraction(), 2 / 8)


@pytest.mark.parametrize("dtype", [GGMLType.Q4_K, GGMLType.Q4_0])
def test_interleaved_experts_run_alike_in_every_path(tmp_path, dtype):
    """Q4_K and Q4_0 stacks of experts interleaved as llama.cpp repacks them: the native decode
    block and the Python path (an observer turns the native block off) give the same bits, and
    the prompt's experts run every token by the GEMV, so a prefill of any length equals decode."""
    spec = TinySpec(n_embd=256, n_layer=2, n_ff=256, n_expert=4, n_expert_used=2)
    write_gguf_py(tmp_path / "q.gguf", spec, dtype, seed=3)
    model = load(tmp_path / "q.gguf").model
    seen: list[int] = []
    native = _run(model)
    traced = _run(model, RunOptions(observer=lambda l, x, h: seen.append(l)))
    assert seen and torch.equal(native, traced)
    ex = model.weights.blk[0].moe
    assert all(m is not None and m.code in interleave.STACKS for m in ex.interleaved()[1:])
    x = torch.randn(5, 256)
    ids, w = torch.tensor([[0, 3]] * 5), torch.full((5, 2), 0.5)
    many = moe.experts_host(0, ex, x, ids, w, None, RunOptions())[0]
    one = torch.cat(
        [
            moe.experts_host(0, ex, x[i : i + 1], ids[:1], w[:1], None, RunOptions())[0]
            for i in range(5)
        ]
    )
    assert torch.equal(many, one)


# ------------------------------------------------------------------------------ the cut
def test_the_cut_drops_small_contributions_inside_routed_experts(tmp_path):
    t = tiny_tensors(SPEC, sparse=False, seed=3)
    write_gguf_py(tmp_path / "ref.gguf", SPEC, GGMLType.F32, tensors=t)
    ref = load(tmp_path / "ref.gguf")
    write_gguf_py(tmp_path / "cut.gguf", SPEC, GGMLType.F32, tensors=t, extra_kv=_cut_kv(2.0))
    llm = load(tmp_path / "cut.gguf")
    assert llm.model.can_gate and not ref.model.can_gate
    base = _run(ref.model)
    torch.testing.assert_close(_run(llm.model, RunOptions(cut_scale=0.0)), base, rtol=0, atol=1e-5)
    torch.testing.assert_close(_run(llm.model, RunOptions(sparse=False)), base, rtol=0, atol=1e-5)
    stats = SparsityStats.empty(SPEC.n_layer, llm.model.args.ffn_neurons)
    on = _run(llm.model, RunOptions(stats=stats))
    frac = float(stats.active_fraction().mean())
    assert 0.02 < frac < 0.24, frac  # some of the 2/8 routed neurons are cut
    assert 0 < float((on - base).abs().max()) < 0.5 * float(base.max() - base.min())
    cache = llm.model.new_cache(N_CTX, dtype=torch.float32)  # decode = prefill with the cut
    whole = llm.model.forward(TOKENS, cache, all_logits=True)
    torch.testing.assert_close(_run(llm.model, n_prefill=1), whole, rtol=0, atol=2e-5)


@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.MXFP4, GGMLType.Q4_K, GGMLType.F16])
def test_the_cut_down_product_reads_only_kept_groups(t):
    """``down_runs``: a row's products over its runs of kept groups (blocks of the stored down
    matrix) equal the whole product of h with the cut groups zero; every group kept: the
    whole product's bits; none: zeros."""
    from powerpy.formats import quants
    from powerpy.model import kernels

    lib = kernels.library()
    if lib is None:
        pytest.skip("needs the native kernels")
    rng = np.random.default_rng(int(t))
    rows, cols = 40, 1024
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if t == GGMLType.F16:
        m = kernels.Matrix.of_dense(torch.from_numpy(w).half())
        ref = torch.from_numpy(w).half().double()
    else:
        if t == GGMLType.Q4_K:  # no quantizer: gguf-py's random blocks
            from quant_fixtures import random_blocks

            raw = random_blocks(rng, t, rows, cols // 256)
        else:
            raw = quants.quantize(w, t)
        m = kernels.Matrix.of_quant(torch.from_numpy(raw), t, cols)
        ref = torch.from_numpy(quants.dequantize(raw, t, (rows, cols))).double()
    g = 256 if t == GGMLType.Q4_K else 32
    h = torch.from_numpy(rng.standard_normal((3, cols)).astype(np.float32))
    cut = torch.from_numpy(rng.random((3, cols // g)) < 0.4).repeat_interleave(g, dim=1)
    h[cut] = 0.0
    h[2] = 0.0
    h[2, :g] = 1.0  # one kept group
    got = lib.down_runs(m, h).double()
    whole = torch.stack([lib.gather_gemv(m, h[i], None) for i in range(3)]).double()
    bound = h.double().abs() @ ref.abs().T  # the products' magnitudes: f32 summation orders
    assert ((got - whole).abs() <= 2e-5 * bound).all()
    full = torch.randn(1, cols)
    assert torch.equal(lib.down_runs(m, full)[0], lib.gather_gemv(m, full[0], None))
    assert not lib.down_runs(m, torch.zeros(1, cols)).any()


def test_the_cut_is_by_groups_in_c_and_in_torch():
    """A group of 32 neurons is zeroed when w · Σ |h_j| / tau_j < 1: the C helper (the decode
    block's) and the torch one decide alike away from ties, against a float64 sum."""
    ex = type("Ex", (), {"cut_group": 32})()
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(5, 256, generator=gen)
    tau = torch.rand(256, generator=gen) * 20 + 1
    tau[3] = torch.inf  # an all-zero down column: adds nothing
    w = torch.rand(5, generator=gen)
    s = (h.double().abs() * w.double()[:, None] / tau.double()).view(5, 8, 32).sum(-1)
    keep = (s >= 1).repeat_interleave(32, dim=1)
    native = moe_host.cut(ex, h.clone(), w, tau)
    with numerics.using(Numerics(native=False)):
        plain = moe_host.cut(ex, h.clone(), w, tau)
    far = ((s - 1).abs() > 1e-4).repeat_interleave(32, dim=1)
    for got in (native, plain):
        assert torch.equal((got != 0)[far], keep[far])
        assert torch.equal(got[keep & far], h[keep & far])
    assert 0 < int(keep.sum()) < keep.numel()


def test_a_cut_decode_is_one_native_call_with_the_per_op_bits(tmp_path, monkeypatch):
    """Q8_0 with a cut: the native block (its group cut, the kept groups' down products) and
    the per-op decode step (``moe_host``, the same C helpers) give the same logits."""
    path = tmp_path / "cut.gguf"
    write_gguf_py(path, SPEC, GGMLType.Q8_0, seed=2, extra_kv=_cut_kv(2.0))
    llm = load(path)
    a, b = llm.model.new_cache(N_CTX), llm.model.new_cache(N_CTX)
    llm.model.forward(TOKENS[:6], a)
    llm.model.forward(TOKENS[:6], b)
    stats = SparsityStats.empty(SPEC.n_layer, llm.model.args.ffn_neurons)
    native = llm.model.forward(TOKENS[6:7], a, RunOptions(stats=stats))
    assert 0 < int(stats.active.sum()) < 2 * 2 * 128  # some of the routed neurons were cut
    monkeypatch.setattr(moe, "moe_kernels", lambda blk, opts: None)
    monkeypatch.setattr(stack_decode, "plan_for", lambda *args: None)
    per_op = llm.model.forward(TOKENS[6:7], b)
    assert torch.equal(native, per_op)


def test_cut_writes_a_mixture_of_experts_cut_in_one_command(q8, tmp_path, capsys):
    """`powerpy cut` on a MoE GGUF: a copy with one key more (still a GGUF llama.cpp reads) whose
    cuts skip about the share asked for of the routed experts' neurons."""
    text = tmp_path / "t.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 40)
    out = tmp_path / "cut.gguf"
    argv = [
        "cut",
        "-m",
        str(q8),
        "--text",
        str(text),
        "--ctx",
        "64",
        "--tokens",
        "512",
        "-t",
        "1",
        "-s",
        "0.4",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    assert "a copy with per-layer cuts" in capsys.readouterr().err
    llm = load(out)
    cuts = llm.model.args.down_thresholds
    assert len(cuts) == 2 and all(c > 0 for c in cuts)
    with read_gguf(q8) as a, read_gguf(out) as b:  # the same tensors, one key more
        assert not b.sparse and all(np.array_equal(a.raw(n), b.raw(n)) for n in a.tensors)
        assert set(b.kv) - set(a.kv) == {Keys.FFN_DOWN_THRESHOLD}
    stats = SparsityStats.empty(2, llm.model.args.ffn_neurons)
    ids = torch.tensor(llm.tokenize(text.read_text()[:100]))
    llm.model.forward(ids, llm.model.new_cache(256), RunOptions(stats=stats))
    assert 0.6 * 2 / 8 * 0.8 < float(stats.active_fraction().mean()) < 2 / 8
    assert main([*argv[:-1], str(tmp_path / "x.gguf"), "--outtype", "q4_0"]) == 1
    assert "copied with its types and name" in capsys.readouterr().err
    assert main([*argv[:-1], str(q8)]) == 1
    assert "not over the model" in capsys.readouterr().err


def test_profile_counts_every_experts_neurons(q8, tmp_path):
    """`powerpy profile` on a MoE GGUF: one count per expert neuron, gen-gpuidx's input."""
    text = tmp_path / "t.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 10)
    argv = [
        "profile",
        "-m",
        str(q8),
        "--text",
        str(text),
        "--ctx",
        "64",
        "-t",
        "1",
        "--target-sparsity",
        "0.4",
        "-o",
        str(tmp_path / "prof"),
    ]
    assert main(argv) == 0
    counts = torch.load(tmp_path / "prof" / "activation_0.pt", weights_only=True)
    assert counts.shape == (8 * 128,) and 0 < int((counts > 0).sum()) <= 8 * 128


# ------------------------------------------------------------------------------ placement
def _index(hot=300, seed=1, group=1) -> GpuIndex:
    """Random hot neurons, or ``hot // group`` random whole groups of ``group`` (a cut's)."""
    rng = np.random.default_rng(seed)
    n = SPEC.n_expert * SPEC.n_ff

    def one():
        if group == 1:
            return np.sort(rng.choice(n, hot, replace=False))
        g = np.sort(rng.choice(n // group, hot // group, replace=False))
        return (g[:, None] * group + np.arange(group)).reshape(-1)

    return GpuIndex.from_buckets([one() for _ in range(SPEC.n_layer)], n, vram_capacity=0)


@pytest.mark.parametrize(
    "spec, dtype, cut",
    [
        (SPEC, GGMLType.F16, 0.0),
        (SPEC, GGMLType.F16, 2.0),
        (SPEC, GGMLType.Q8_0, 0.0),
        (SPEC, GGMLType.Q8_0, 2.0),
        (SHARED, GGMLType.Q8_0, 0.0),
        (SHARED, GGMLType.F16, 2.0),
    ],
    ids=["f16", "f16-cut", "q8_0", "q8_0-cut", "shared-q8_0", "shared-f16-cut"],
)
def test_hybrid_equals_cpu_only(tmp_path, spec, dtype, cut):
    """The emulated accelerator: router, shared expert and attention placed, 300 hot expert
    neurons per layer; f32 activations (llama.cpp's rounding differs between the paths by
    design)."""
    path = tmp_path / "m.gguf"
    write_gguf_py(path, spec, dtype, seed=2, extra_kv=_cut_kv(cut) if cut else None)
    llm = load(path)
    opts = RunOptions(numerics=EXACT)
    ref = _run(llm.model, opts)
    k = 320 if cut else 300  # a cut's hot rows: whole groups of 32 (10)
    index = _index(k, group=32 if cut else 1)
    placement = Placement.for_model(llm.file, 1 << 30, index, n_ctx=N_CTX, kv_elem_bytes=4)
    assert Names.FFN_GATE_INP.format(l=1) in placement.gpu_tensors
    if cut:  # a partly placed group stays on the host
        part = Placement.for_model(llm.file, 1 << 30, _index(), n_ctx=N_CTX, kv_elem_bytes=4)
        assert part.n_hot < 600 and any("partly placed cut groups" in n for n in part.notes)
    if spec is SHARED:  # the shared expert is dense: placed whole, in the predictors' level
        assert Names.FFN_DOWN_SHEXP.format(l=1) in placement.gpu_tensors
    rt = build_hybrid(llm.model, placement, Accelerator("cpu"), file=llm.file)
    assert rt.placement.n_hot == 2 * k and rt.device_bytes <= placement.budget
    hot = rt.model.weights.blk[0].moe.hot
    assert hot.k == k and llm.model.weights.blk[0].moe.hot is None  # the original untouched
    row = 64 * (2 if dtype == GGMLType.F16 else 34 / 32)
    assert placement.layers[0].neuron_bytes == 2 * row + 2 * 64  # gate, up rows; f16 column
    atol = 1e-4 if dtype == GGMLType.F16 else 2e-3  # a Q8_0 down column placed as f16
    if cut and dtype != GGMLType.F16:  # a neuron at its cut may fall on either side when the
        atol = 1e-2  # device sums its gate and up rows in another order
    torch.testing.assert_close(_run(rt.model, opts), ref, rtol=0, atol=atol)
    stats = SparsityStats.empty(2, 1024)
    _run(rt.model, RunOptions(stats=stats, numerics=EXACT))
    if not cut:
        np.testing.assert_allclose(stats.active_fraction(), 2 / 8)  # hot and cold counted


def test_gen_gpuidx_places_the_hottest_experts(q8, tmp_path, capsys):
    counts = [np.repeat(np.arange(8)[::-1] * 100, 128) for _ in range(2)]  # expert 0 hottest
    save_activation_stats(tmp_path / "activation", [torch.from_numpy(c) for c in counts])
    with read_gguf(q8) as f:
        base = Placement.for_model(f, 1 << 40, n_ctx=64)
        fixed, neuron = base.plan.used, base.layers[0].neuron_bytes
    budget = fixed + 2 * 256 * neuron + 10  # two groups of 256 neurons: experts 0 and 1
    out = tmp_path / "m.gpuidx"
    argv = [
        "gen-gpuidx",
        "-m",
        str(q8),
        "--vram-budget",
        repr(budget / 2**30),
        "--ctx",
        "64",
        "--activation",
        str(tmp_path / "activation"),
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    idx = GpuIndex.read(out, n_layer=2, n_ff=1024)
    hot = np.concatenate(idx.gpu_bucket)
    assert set(hot.tolist()) <= set(range(256)) and len(hot) == 512  # experts 0 and 1, whole
    llm = load(
        q8,
        vram_budget=budget / 2**30,
        device="cpu",
        n_ctx=64,
        activation_dir=tmp_path / "activation",
    )
    assert llm.runtime is not None and llm.runtime.placement.n_hot == 512
    assert llm.runtime.device_bytes <= budget


@pytest.mark.parametrize("spec", [SPEC, SHARED], ids=["mixtral", "qwen2moe"])
@pytest.mark.parametrize("what", ["everything", "dense-only"])
def test_fake_cuda_runs_without_host_syncs_within_the_budget(tmp_path, what, spec):
    """Device tensors are fake CUDA tensors: a host sync or a cross-device op raises."""
    path = tmp_path / "m.gguf"
    write_gguf_py(path, spec, GGMLType.F16, seed=2, extra_kv=_cut_kv(1.0))
    llm = load(path)
    full = Placement.for_model(llm.file, 1 << 40, n_ctx=N_CTX)
    neuron = full.layers[0].neuron_bytes
    budget = full.used + 2 * 320 * neuron if what == "everything" else full.plan.used
    index = _index(320, group=32)  # whole cut groups
    placement = Placement.for_model(llm.file, budget, index, n_ctx=N_CTX, kv_elem_bytes=2)
    rt = build_hybrid(llm.model, placement, FakeCuda(), file=llm.file)
    assert rt.dense_bytes + rt.hot_bytes + placement.kv_bytes <= budget
    assert (rt.model.weights.blk[0].moe.hot is not None) == (what == "everything")
    logits = run_prefill_and_decode(rt.model, TOKENS, N_CTX, 6, 3, llm.options)
    assert logits.shape == (1, rt.model.args.n_vocab) and logits.device.type == "cpu"


# ------------------------------------------------------------------------------ refusals
_refused = refused  # (tmp_path, spec, err, match, ...)


def test_a_missing_or_misshapen_expert_stack_is_named_with_its_shape(tmp_path):
    name = Names.FFN_DOWN_EXPS.format(l=1)
    _refused(
        tmp_path,
        SPEC,
        FileFormatError,
        r"tensor 'blk\.1\.ffn_down_exps\.weight' is missing; .* \(it needs shape "
        r"\(n_expert, n_embd, n_ff_exp\) = \(8, 64, 128\)\)",
        drop=[name],
    )

    def swap(t):
        t[name] = np.ascontiguousarray(t[name].transpose(0, 2, 1))  # (8, 128, 64)

    _refused(
        tmp_path,
        SPEC,
        ModelConfigError,
        r"'blk\.1\.ffn_down_exps\.weight' has shape \(8, 128, 64\), but the hyperparameters "
        r"need \(n_expert, n_embd, n_ff_exp\) = \(8, 64, 128\)",
        edit=swap,
    )
    router = Names.FFN_GATE_INP.format(l=0)
    _refused(
        tmp_path,
        SPEC,
        ModelConfigError,
        r"'blk\.0\.ffn_gate_inp\.weight' has shape \(7, 64\), but the hyperparameters need "
        r"\(n_expert, n_embd\) = \(8, 64\)",
        edit=lambda t: t.__setitem__(router, t[router][:7]),
    )
    up = Names.FFN_UP_EXPS.format(l=0)
    _refused(
        tmp_path,
        QWEN,
        ModelConfigError,
        r"'blk\.0\.ffn_up_exps\.weight' has shape \(8, 32, 64\), but the hyperparameters "
        r"need \(n_expert, n_ff_exp, n_embd\) = \(8, 64, 64\)",
        edit=lambda t: t.__setitem__(up, np.ascontiguousarray(t[up][:, :32])),
    )


@pytest.mark.parametrize(
    "kv, match",
    [
        (
            {"llama.expert_used_count": (9, GGUFValueType.UINT32)},
            r"llama\.expert_used_count is 9, it must be between 1 and llama\.expert_count \(8\)",
        ),
        ({"llama.expert_used_count": (0, GGUFValueType.UINT32)}, r"expert_used_count is 0"),
        (
            {"llama.expert_weights_norm": (1, GGUFValueType.UINT32)},
            r"'llama\.expert_weights_norm' must be a BOOL",
        ),
        (
            {"llama.expert_weights_scale": (-1.0, GGUFValueType.FLOAT32)},
            r"expert_weights_scale is -1\.0",
        ),
        (
            {"llama.expert_count": (4, GGUFValueType.UINT32)},
            r"ffn_gate_inp\.weight' has shape \(8, 64\), but the hyperparameters need "
            r"\(n_expert, n_embd\) = \(4, 64\)",
        ),
    ],
)
def test_expert_keys_that_make_no_mixture_are_refused(tmp_path, kv, match):
    _refused(tmp_path, SPEC, ModelConfigError, match, extra_kv=kv)


def test_expert_tensors_without_a_count_and_experts_where_none_belong(tmp_path):
    t = tiny_tensors(SPEC, sparse=False, seed=1)
    plain = TinySpec(n_layer=2, n_ff=128)
    t |= {k: v for k, v in tiny_tensors(plain, sparse=False).items() if "ffn" in k}
    write_gguf_py(tmp_path / "a.gguf", plain, GGMLType.F32, tensors=t)
    msg = (
        r"tensor 'blk\.0\.ffn_gate_inp\.weight' belongs to a mixture of experts, but the file's "
        r"llama\.expert_count is missing"
    )
    with pytest.raises(ModelConfigError, match=msg):
        load(tmp_path / "a.gguf")
    dense = {k: v for k, v in tiny_tensors(plain, sparse=False).items() if "blk.0.ffn_up" in k}
    _refused(
        tmp_path,
        SPEC,
        ModelConfigError,
        r"tensor 'blk\.0\.ffn_up\.weight' is not part of a llama model, whose layers hold "
        r".*ffn_down_exps",
        edit=lambda t: t.update(dense),
    )
    no_experts = TinySpec(arch="qwen3moe", n_layer=2, n_ff=128)
    write_gguf_py(tmp_path / "q.gguf", no_experts, GGMLType.F32)
    with pytest.raises(
        ModelConfigError,
        match=r"qwen3moe is a mixture of experts, but "
        r"qwen3moe\.expert_count is 0",
    ):
        load(tmp_path / "q.gguf")


def test_the_first_mixtral_layout_of_one_tensor_per_expert_is_refused_by_name(tmp_path):
    def per_expert(t):
        for kind in ("gate", "up", "down"):
            stack = t.pop(f"blk.1.ffn_{kind}_exps.weight")
            t.update({f"blk.1.ffn_{kind}.{e}.weight": stack[e] for e in range(len(stack))})

    _refused(
        tmp_path,
        SPEC,
        ModelConfigError,
        r"tensor 'blk\.1\.ffn_(gate|up|down)\.0\.weight' holds one expert of a mixture "
        r"of experts on its own, the layout of the first Mixtral GGUFs.*download a newer "
        r"conversion",
        edit=per_expert,
    )


def test_a_pwri_file_with_experts_and_a_placement_of_a_plain_gguf_are_refused(q8, tmp_path):
    write_tiny_model(tmp_path / "m.powerinfer.gguf", SPEC, sparse=True)
    with pytest.raises(ModelConfigError, match=r"a PowerInfer \(PWRI\) file with 8 experts"):
        load(tmp_path / "m.powerinfer.gguf")
    write_tiny_model(tmp_path / "d.gguf", TinySpec(), sparse=False)
    with read_gguf(tmp_path / "d.gguf") as f, pytest.raises(PlacementError, match="dense GGUF"):
        Placement.for_model(f, 1 << 30)


# ------------------------------------------------------------------------------ fuzzing
@pytest.mark.parametrize("arch", ["llama", "qwen3moe", "qwen2moe", "gpt-oss"])
def test_valid_moe_drafts_run_plain_and_placed(tmp_path, one_thread, arch):
    """The fuzzer's unmutated MoE drafts run, F32 and Q8_0, CPU-only and placed, so the "moe"
    family's refusals are its mutations'."""
    from powerpy.testing import fuzz as fz
    from powerpy.testing.fuzz.experts import moe_draft

    for quantized in (False, True):
        for load_kw in ({}, {"vram_budget": fz.BUDGET_GIB, "device": "cpu"}):
            d = moe_draft(arch, quantized=quantized)
            d.load = load_kw
            p = fz.finish(d, "moe", "base", 0, "base", tmp_path / f"{quantized}{bool(load_kw)}")
            assert fz.run(p) == "ok", (quantized, load_kw, p.errors)


_BENCH = {
    "glm4moe": TinySpec(
        arch="glm4moe",
        n_layer=2,
        n_ff=128,
        n_ff_exp=32,
        n_expert=4,
        n_expert_used=2,
        n_layer_dense=1,
        n_rot=8,
    ),
    "deepseek2": TinySpec(
        arch="deepseek2",
        n_layer=2,
        n_ff=128,
        n_ff_exp=32,
        n_expert=4,
        n_expert_used=2,
        n_layer_dense=1,
        n_rot=8,
        q_lora_rank=32,
        kv_lora_rank=32,
        key_length_mla=40,
        value_length_mla=32,
    ),
    "gpt-oss": TinySpec(
        arch="gpt-oss",
        n_layer=2,
        n_ff=128,
        n_ff_exp=64,
        n_expert=4,
        n_expert_used=2,
        sliding_window=4,
        key_length=32,
    ),
}


@pytest.mark.parametrize(
    "spec",
    [SPEC, QWEN, SHARED, *_BENCH.values()],
    ids=["mixtral", "qwen3moe", "qwen2moe", *_BENCH],
)
def test_the_benchmark_writer_makes_models_that_run(tmp_path, spec):
    """``python -m powerpy.testing.moe`` (one tensor at a time) writes the tensors the loader
    wants, in one layout (a fused attn_qkv beside its parts was once written and refused);
    gpt-oss with MXFP4 experts."""
    ex = GGMLType.MXFP4 if spec.arch == "gpt-oss" else None
    path = write_moe_model(tmp_path / "m.gguf", spec, GGMLType.Q8_0, experts=ex)
    logits = load(path).logits(TOKENS[:5].tolist())
    assert logits.shape == (5, spec.n_vocab) and bool(torch.isfinite(logits).all())
