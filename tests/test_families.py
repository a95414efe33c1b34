"""Falcon and OPT on the one forward: dense and sparse, the cut, hybrid placements (emulated and
fake CUDA), and the refusals of files that do not fit their family.

Their logits against transformers are in ``test_convert_families.py`` and against llama.cpp in
``test_families_oracle.py``; here the tiny random models of ``powerpy.testing.tiny`` check that
every path of the runtime computes the same function for these layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_cuda import FakeCuda, run_prefill_and_decode
from torch._subclasses.fake_tensor import FakeTensor

from powerpy.api import load
from powerpy.errors import FileFormatError, ModelConfigError
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys, Names, bias_name
from powerpy.formats.gpuidx import GpuIndex
from powerpy.model.device import Accelerator
from powerpy.model.options import RunOptions
from powerpy.placement.placement import Placement
from powerpy.placement.runtime import build_hybrid
from powerpy.testing import TinySpec, tiny_tensors, write_tiny_model

SPECS = {
    "falcon-mqa": TinySpec(arch="falcon", n_embd=64, n_ff=256, n_head=4, n_head_kv=1),
    "falcon-gqa": TinySpec(arch="falcon", n_embd=64, n_ff=256, n_head=4, n_head_kv=2),
    "opt": TinySpec(arch="opt", n_embd=64, n_ff=256, n_head=4, n_head_kv=4, tied=True),
}
TOKENS = torch.tensor([1, 72, 101, 108, 108, 111, 44, 32, 119, 111])
N_CTX = 32
F32 = dict(weight_format="f32")


def _write(path, spec, tensors, *, sparse=True, dtype=GGMLType.F32, extra_kv=None):
    """Write ``tensors`` (f32 numpy, GGUF names) with the spec's keys; 2-D ones as ``dtype``."""
    write_tiny_model(path, spec, sparse=sparse, dtype=dtype, extra_kv=extra_kv, tensors=tensors)
    return path


@pytest.fixture(scope="module", params=list(SPECS))
def family_file(request, tmp_path_factory):
    """(name, spec, PWRI path): a tiny random model with predictors, f32."""
    spec = SPECS[request.param]
    path = tmp_path_factory.mktemp("fam") / f"{request.param}.powerinfer.gguf"
    write_tiny_model(path, spec, sparse=True, seed=3)
    return request.param, spec, path


def _prefill_then_decode(model, opts, n_prefill=6) -> torch.Tensor:
    """Logits of TOKENS: a prefill of the first n_prefill, then one token at a time."""
    cache = model.new_cache(N_CTX, dtype=torch.float32)
    out = [model.forward(TOKENS[:n_prefill], cache, opts, all_logits=True)]
    out += [model.forward(TOKENS[i : i + 1], cache, opts) for i in range(n_prefill, len(TOKENS))]
    return torch.cat(out)


def test_a_family_loads_with_its_layout(family_file):
    name, spec, path = family_file
    llm = load(path, **F32)
    a, blk = llm.model.args, llm.model.weights.blk[0]
    assert a.arch == spec.arch and a.ffn_variant == "relu" and a.sparse
    assert blk.ffn_gate is None and blk.native  # the native blocks run every layout
    if spec.arch == "falcon":
        assert blk.ffn_norm is None and blk.attn_q.shape == (64, 64)
        assert blk.attn_k.shape == (16 * spec.n_head_kv, 64)  # row views of attn_qkv
        assert llm.model.weights.position_embd is None
    else:
        assert blk.ffn_down_b is not None and blk.attn_norm_b is not None
        assert llm.model.weights.position_embd.shape == (N_CTX * 8 + 2, 64)
        assert llm.model.weights.output is llm.model.weights.token_embd  # tied


def test_sparse_at_minus_inf_equals_dense_in_prefill_and_decode(family_file):
    _, _, path = family_file
    llm = load(path, **F32)
    dense = _prefill_then_decode(llm.model, RunOptions(sparse=False))
    every = _prefill_then_decode(llm.model, RunOptions(sparse=True, threshold=-float("inf")))
    torch.testing.assert_close(every, dense, rtol=0, atol=2e-5)
    gated = _prefill_then_decode(llm.model, RunOptions(sparse=True, threshold=0.0))
    assert (gated - dense).abs().max() > 1e-3  # the predictor really skips neurons


def test_decode_equals_prefill(family_file):
    _, _, path = family_file
    llm = load(path, **F32)
    for opts in (RunOptions(sparse=False), RunOptions(sparse=True)):
        cache = llm.model.new_cache(N_CTX, dtype=torch.float32)
        whole = llm.model.forward(TOKENS, cache, opts, all_logits=True)
        steps = _prefill_then_decode(llm.model, opts, n_prefill=1)
        torch.testing.assert_close(steps, whole, rtol=0, atol=2e-5)


def test_quantized_files_stay_close_to_f32(family_file, tmp_path):
    name, spec, path = family_file
    t = tiny_tensors(spec, sparse=True, seed=3)
    q = _write(tmp_path / "q8.powerinfer.gguf", spec, t, dtype=GGMLType.Q8_0)
    ref = _prefill_then_decode(load(path, **F32).model, RunOptions(sparse=False))
    got = _prefill_then_decode(load(q).model, RunOptions(sparse=False))
    spread = float(ref.max() - ref.min())
    assert float((got - ref).abs().max()) < 0.02 * spread
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_the_cut_drops_small_contributions(family_file, tmp_path):
    name, spec, path = family_file
    cuts = ([0.05] * spec.n_layer, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    t = tiny_tensors(spec, sparse=True, seed=3)
    llm = load(_write(tmp_path / "cut.gguf", spec, t, extra_kv={Keys.FFN_DOWN_THRESHOLD: cuts}))
    ref = _prefill_then_decode(load(path, **F32).model, RunOptions(sparse=True))
    off = _prefill_then_decode(llm.model, RunOptions(sparse=True, cut_scale=0.0))
    torch.testing.assert_close(off, ref, rtol=0, atol=2e-5)
    on = _prefill_then_decode(llm.model, RunOptions(sparse=True))
    assert 0 < float((on - ref).abs().max()) < 0.5 * float(ref.max() - ref.min())


def _index(spec, hot=100, seed=1) -> GpuIndex:
    rng = np.random.default_rng(seed)
    buckets = [np.sort(rng.choice(spec.n_ff, hot, replace=False)) for _ in range(spec.n_layer)]
    return GpuIndex.from_buckets(buckets, spec.n_ff, vram_capacity=0)


@pytest.mark.parametrize("dtype", [GGMLType.F16, GGMLType.Q4_0])
def test_hybrid_equals_cpu_only(family_file, tmp_path, dtype):
    """The emulated accelerator: dense parts and 100 hot rows per layer placed, f32 KV; f32
    activations on both sides (the device's hot rows take them, as a GPU's do)."""
    name, spec, _ = family_file
    path = _write(
        tmp_path / "m.powerinfer.gguf", spec, tiny_tensors(spec, sparse=True), dtype=dtype
    )
    llm = load(path, exact_activations=True)
    opts = RunOptions(sparse=True, numerics=llm.options.numerics)
    ref = _prefill_then_decode(llm.model, opts)
    placement = Placement.for_model(llm.file, 1 << 30, _index(spec), n_ctx=N_CTX, kv_elem_bytes=4)
    rt = build_hybrid(llm.model, placement, Accelerator("cpu"), file=llm.file)
    assert rt.placement.n_hot == 100 * spec.n_layer
    assert rt.device_bytes <= placement.budget
    blk = rt.model.weights.blk[0]
    assert blk.hot is not None and blk.hot.gate is None and blk.hot.k == 100
    torch.testing.assert_close(_prefill_then_decode(rt.model, opts), ref, rtol=0, atol=1e-4)


def test_the_budget_charges_up_and_down_rows_and_the_up_bias(family_file):
    name, spec, path = family_file
    llm = load(path)
    layer = Placement.for_model(llm.file, 1 << 30, _index(spec), n_ctx=N_CTX).layers[0]
    row = 4 * spec.n_embd  # f32 rows
    assert layer.neuron_bytes == 2 * row + (4 if spec.arch == "opt" else 0)


@pytest.mark.parametrize("what", ["everything", "mid-dense"])
def test_fake_cuda_runs_without_host_syncs_within_the_budget(family_file, tmp_path, what):
    """Device tensors are fake CUDA tensors: a host sync or a cross-device op raises."""
    name, spec, _ = family_file
    t = tiny_tensors(spec, sparse=True, seed=3)
    path = _write(tmp_path / "m.powerinfer.gguf", spec, t, dtype=GGMLType.F16)
    llm = load(path, threshold=0.0)
    full = Placement.for_model(llm.file, 1 << 40, n_ctx=N_CTX)
    dense = sum(nb for c, nb in full.bytes_by_category.items() if c not in ("kv", "hot_ffn"))
    neuron = full.layers[0].neuron_bytes
    budget = full.used + spec.n_layer * 100 * neuron if what == "everything" else dense // 2
    placement = Placement.for_model(llm.file, budget, _index(spec), n_ctx=N_CTX, kv_elem_bytes=2)
    accel = FakeCuda()
    rt = build_hybrid(llm.model, placement, accel, file=llm.file)
    assert rt.dense_bytes + rt.hot_bytes + placement.kv_bytes <= budget
    blk = rt.model.weights.blk[0]
    if what == "everything":
        assert isinstance(blk.attn_q.storage, FakeTensor) and isinstance(blk.attn_norm, FakeTensor)
        assert blk.hot is not None and (spec.arch == "opt" or blk.hot.gate_up is not None)
    logits = run_prefill_and_decode(rt.model, TOKENS, N_CTX, 6, 3, llm.options)
    assert logits.shape == (1, rt.model.args.n_vocab) and logits.device.type == "cpu"


# ------------------------------------------------------------------------------ refusals
def _refused(tmp_path, spec, tensors, err, match, **kw):
    path = _write(tmp_path / "bad.powerinfer.gguf", spec, tensors, **kw)
    with pytest.raises(err, match=match):
        load(path)


def test_a_falcon_file_with_a_gate_is_refused_by_name(tmp_path):
    spec = SPECS["falcon-gqa"]
    t = tiny_tensors(spec, sparse=True)
    t[Names.FFN_GATE.format(l=1)] = t[Names.FFN_UP.format(l=1)]
    msg = (
        r"bad\.powerinfer\.gguf: tensor 'blk\.1\.ffn_gate\.weight' is not part of a falcon "
        r"model, whose layers hold attn_norm, attn_norm_2, attn_output, attn_qkv, ffn_up"
    )
    _refused(tmp_path, spec, t, ModelConfigError, msg)


def test_a_falcon_qkv_of_the_wrong_height_is_refused(tmp_path):
    spec = SPECS["falcon-gqa"]
    t = tiny_tensors(spec, sparse=True)
    name = Names.ATTN_QKV.format(l=0)
    t[name] = t[name][:-16]
    _refused(
        tmp_path,
        spec,
        t,
        ModelConfigError,
        r"tensor 'blk\.0\.attn_qkv\.weight' has shape \(112, 64\), but the hyperparameters "
        r"need \(n_embd_qkv, n_embd\) = \(128, 64\)",
    )


def test_an_opt_file_without_positions_or_a_bias_is_refused(tmp_path):
    spec = SPECS["opt"]
    t = tiny_tensors(spec, sparse=True)
    del t[Names.POS_EMBD]
    _refused(tmp_path, spec, t, FileFormatError, r"tensor 'position_embd\.weight' is missing")
    t = tiny_tensors(spec, sparse=True)
    del t[bias_name(Names.ATTN_K.format(l=1))]
    msg = r"tensor 'blk\.1\.attn_k\.bias' is missing; this architecture has a bias there"
    _refused(tmp_path, spec, t, FileFormatError, msg)
    t = tiny_tensors(spec, sparse=True)
    t[Names.POS_EMBD] = t[Names.POS_EMBD][:2]
    _refused(
        tmp_path,
        spec,
        t,
        ModelConfigError,
        r"'position_embd\.weight' holds 2 rows, but opt reads position p at row p \+ 2",
    )
    t[Names.POS_EMBD] = tiny_tensors(spec, sparse=True)[Names.POS_EMBD][:100]
    short = _write(tmp_path / "short.powerinfer.gguf", spec, t)
    assert load(short).model.args.n_ctx_train == 98  # the table bounds the context


def test_a_bias_the_family_lacks_is_refused(tmp_path):
    spec = TinySpec()
    t = tiny_tensors(spec, sparse=True)
    t[bias_name(Names.ATTN_NORM.format(l=0))] = np.zeros(64, np.float32)  # RMSNorm has none
    _refused(
        tmp_path,
        spec,
        t,
        ModelConfigError,
        r"tensor 'blk\.0\.attn_norm\.bias' is a bias that llama models do not have",
    )


def test_learned_positions_bound_the_context(tmp_path):
    spec = SPECS["opt"]
    write_tiny_model(tmp_path / "o.gguf", spec, sparse=False)
    llm = load(tmp_path / "o.gguf")
    assert llm.model.args.n_ctx_train == spec.n_ctx
    cache = llm.model.new_cache(spec.n_ctx + 8)
    llm.model.forward(torch.zeros(spec.n_ctx, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"exceed the 256 positions opt has learned"):
        llm.model.forward(torch.zeros(1, dtype=torch.long), cache)


# ------------------------------------------------------------------------------ pipeline
def test_a_dense_gelu_falcon_gets_magnitude_labels_and_predictors(tmp_path):
    """GELU has no exact zeros: profile and train-predictors label a neuron active when
    |h|·‖down‖ is above the layer's quantile, and the PWRI file runs GELU with predictors."""
    from powerpy.pipeline.convert import convert
    from powerpy.pipeline.profile import profile
    from powerpy.pipeline.train import TrainOptions, train_predictors

    dense = tmp_path / "dense.gguf"
    write_tiny_model(dense, SPECS["falcon-gqa"], sparse=False, seed=3)
    llm = load(dense, **F32)
    assert llm.model.args.ffn_variant == "gelu"
    ids = llm.tokenize("In the beginning God created the heaven and the earth. " * 12)
    with pytest.raises(ValueError, match="a gelu model has no exact zeros"):
        profile(llm.model, ids, ctx=32, max_tokens=128)
    res = profile(llm.model, ids, ctx=32, max_tokens=128, target_sparsity=0.7)
    assert res.kind == "gelu" and 0.2 < float(np.mean(res.active_fraction())) < 0.4
    opts = TrainOptions(hidden=32, epochs=8, patience=3, batch=128, lr=3e-3)
    report, _ = train_predictors(
        llm.model, ids, tmp_path / "pred", opts, ctx=32, tokens=None, target_sparsity=0.7
    )
    assert report.summary()["recall_mean"] > 0.7, report.layers
    sparse = load(convert(dense, tmp_path / "pred", tmp_path / "m.powerinfer.gguf"))
    assert sparse.model.can_gate and sparse.model.args.ffn_variant == "gelu"
    sparse.logits(ids[:24])
    assert 0.1 < float(sparse.sparsity.active_fraction().mean()) < 0.6


@pytest.mark.parametrize("name", ["falcon-gqa", "opt"])
def test_the_pipeline_makes_a_sparse_model_of_a_dense_relu_file(name, tmp_path):
    """profile -> train-predictors -> convert -> sparse run and gen-gpuidx, on a dense GGUF.

    The predictor reads the block input in a parallel (falcon) block and the residual before
    ffn_norm in OPT's; profiling counts h != 0 of the ungated ReLU."""
    from powerpy.formats.gpuidx import GpuIndex, default_gpuidx_path
    from powerpy.formats.stats import load_activation_stats
    from powerpy.pipeline.convert import convert
    from powerpy.pipeline.profile import profile, write_profile
    from powerpy.pipeline.train import TrainOptions, train_predictors
    from powerpy.placement.lifecycle import resolve_placement

    spec = SPECS[name]
    dense = tmp_path / "dense.gguf"
    write_tiny_model(dense, spec, sparse=False, seed=3)
    llm = load(dense, ffn_act="relu", weight_format="f32")
    ids = llm.tokenize("In the beginning God created the heaven and the earth. " * 12)
    res = profile(llm.model, ids, ctx=32, max_tokens=128)
    assert res.kind == "relu" and 0.2 < float(np.mean(res.active_fraction())) < 0.8
    write_profile(res, tmp_path / "act")
    counts = load_activation_stats(tmp_path / "act", spec.n_layer, spec.n_ff)
    assert all(c.sum() > 0 for c in counts)
    opts = TrainOptions(hidden=32, epochs=8, patience=3, batch=128, lr=3e-3)
    report, _ = train_predictors(llm.model, ids, tmp_path / "pred", opts, ctx=32, tokens=None)
    assert report.summary()["recall_mean"] > 0.7, report.layers
    out = convert(dense, tmp_path / "pred", tmp_path / "m.powerinfer.gguf", outtype="f16")
    sparse = load(out)
    assert sparse.model.can_gate and sparse.model.args.ffn_variant == "relu"
    sparse.logits(ids[:24])
    assert 0 < float(sparse.sparsity.active_fraction().mean()) < 1
    full = Placement.for_model(sparse.file, 1 << 40, n_ctx=N_CTX)
    budget = full.used + 100 * full.layers[0].neuron_bytes  # the dense parts and 100 neurons
    act = tmp_path / "act"
    placement = resolve_placement(sparse.file, budget, n_ctx=N_CTX, activation_dir=act, batch=32)
    assert placement.n_hot == 96  # whole groups of 32 neurons
    index = GpuIndex.read(default_gpuidx_path(out), n_layer=spec.n_layer)  # beside the model
    assert sum(len(b) for b in index.gpu_bucket) == placement.n_hot
