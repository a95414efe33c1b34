"""Profiler counts against an independent forward, label consistency, and predictor training."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from powerpy.api import load
from powerpy.cli import main
from powerpy.formats.constants import Keys
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.stats import load_activation_stats
from powerpy.pipeline.calibrate import calibrate_predictors
from powerpy.pipeline.convert import convert
from powerpy.pipeline.corpus import window_starts
from powerpy.pipeline.profile import load_samples, profile, sample_arrays, write_profile
from powerpy.pipeline.train import TrainOptions, predictor_logits, train_predictors
from powerpy.testing import TinySpec, write_tiny_model

SPEC = TinySpec(n_embd=32, n_layer=2, n_ff=64, n_head=4, n_head_kv=2, n_pred_hidden=8)


pytestmark = pytest.mark.usefixtures("one_thread")


TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep. "
) * 4


def reference_ffn_preacts(t: dict[str, np.ndarray], tokens: list[int]) -> list[tuple]:
    """Float64 numpy forward of one window (ggml RoPE); per layer (gate, up) pre-activations."""
    d, nh, nkv = SPEC.n_embd, SPEC.n_head, SPEC.n_head_kv
    hd, n = d // nh, len(tokens)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + SPEC.norm_eps) * w

    def rope(x):  # adjacent pairs
        z = x[..., 0::2] + 1j * x[..., 1::2]
        z = z * np.exp(1j * np.arange(n)[:, None, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd))
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out

    g = {k: v.astype(np.float64) for k, v in t.items()}
    x = g["token_embd.weight"][tokens]
    out = []
    for l in range(SPEC.n_layer):
        p = f"blk.{l}."
        h = rms(x, g[p + "attn_norm.weight"])
        q = rope((h @ g[p + "attn_q.weight"].T).reshape(n, nh, hd))
        k = rope((h @ g[p + "attn_k.weight"].T).reshape(n, nkv, hd))
        v = (h @ g[p + "attn_v.weight"].T).reshape(n, nkv, hd)
        att = np.zeros((n, nh, hd))
        for head in range(nh):
            s = q[:, head] @ k[:, head // (nh // nkv)].T / math.sqrt(hd)
            s[np.triu_indices(n, 1)] = -np.inf
            pr = np.exp(s - s.max(-1, keepdims=True))
            att[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, head // (nh // nkv)]
        x = x + att.reshape(n, d) @ g[p + "attn_output.weight"].T
        h = rms(x, g[p + "ffn_norm.weight"])
        gate, up = h @ g[p + "ffn_gate.weight"].T, h @ g[p + "ffn_up.weight"].T
        out.append((gate, up))
        x = x + (np.maximum(gate, 0) * up) @ g[p + "ffn_down_t.weight"]
    return out


@pytest.fixture(scope="module")
def relu_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("relu") / "tiny.powerinfer.gguf"
    tensors = write_tiny_model(path, SPEC, sparse=True)  # PWRI llama: ReGLU
    llm = load(path, weight_format="f32")
    yield llm, tensors, path
    llm.file.close()


def test_relu_counts_equal_independent_forward(relu_model, tmp_path) -> None:
    llm, tensors, _ = relu_model
    ids = llm.tokenize(TEXT, add_bos=False)
    ctx, budget = 32, 96
    res = profile(
        llm.model, ids, ctx=ctx, max_tokens=budget, dump_dir=tmp_path, dump_samples=10_000
    )
    assert res.kind == "relu" and res.n_tokens == 96 and res.n_samples == 96
    want = [np.zeros(SPEC.n_ff, np.int64) for _ in range(SPEC.n_layer)]
    for s in window_starts(len(ids), ctx, budget):
        for l, (gate, up) in enumerate(reference_ffn_preacts(tensors, ids[s : s + ctx])):
            want[l] += ((gate > 0) & (up != 0)).sum(0)
    for l in range(SPEC.n_layer):
        diff = np.abs(res.counts[l] - want[l])
        assert diff.sum() <= 2, (l, np.flatnonzero(diff))  # fp32 vs fp64 sign flips at ~0 only
    paths = write_profile(res, tmp_path / "act")
    loaded = load_activation_stats(tmp_path / "act", SPEC.n_layer, SPEC.n_ff)
    assert len(paths) == SPEC.n_layer
    for l in range(SPEC.n_layer):
        np.testing.assert_array_equal(loaded[l], res.counts[l])
    # the dumped |h| gives exactly the counted labels
    meta = load_samples(res.samples_dir)
    for l in range(SPEC.n_layer):
        _, a, _ = sample_arrays(meta, l)
        np.testing.assert_array_equal((np.asarray(a) != 0).sum(0), res.counts[l])


def test_silu_labels_are_consistent(tmp_path) -> None:
    path = tmp_path / "dense.gguf"
    write_tiny_model(path, SPEC, sparse=False)  # dense llama: SwiGLU
    llm = load(path)
    ids = llm.tokenize(TEXT, add_bos=False)
    with pytest.raises(ValueError, match="target sparsity"):
        profile(llm.model, ids, ctx=32)
    res = profile(
        llm.model, ids, ctx=32, target_sparsity=0.7, dump_dir=tmp_path, dump_samples=10_000
    )
    assert res.kind == "silu" and res.thresholds.shape == (SPEC.n_layer,)
    frac = res.active_fraction()
    assert np.all(np.abs(frac - 0.3) < 0.05), frac  # calibrated on the run itself
    meta = load_samples(res.samples_dir)
    for l in range(SPEC.n_layer):
        _, a, dn = sample_arrays(meta, l)
        labels = np.asarray(a).astype(np.float32) * dn > meta["thresholds"][l]
        mismatch = np.abs(labels.sum(0) - res.counts[l]).sum()
        assert mismatch <= 0.002 * labels.size  # only fp16 rounding at the threshold
    llm.file.close()


@pytest.fixture(scope="module")
def trained(relu_model, tmp_path_factory):
    """Predictors trained on the tiny ReLU model, with the sample dump kept."""
    llm, _, _ = relu_model
    d = tmp_path_factory.mktemp("trained")
    text = TEXT * 4 + "The LORD is my shepherd; I shall not want. " * 30
    ids = llm.tokenize(text, add_bos=False)
    opts = TrainOptions(hidden=64, epochs=20, patience=4, batch=256, lr=3e-3)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report, prof = train_predictors(
            llm.model, ids, d / "pred", opts, tokens=None, ctx=64, work_dir=d / "work"
        )
    finally:
        torch.set_num_threads(n)
    return report, prof, d, ids, opts


def test_train_reaches_recall_and_converts(relu_model, trained, tmp_path) -> None:
    _, _, path = relu_model
    report, _, d, ids, _ = trained
    s = report.summary()
    assert s["recall_mean"] >= 0.9, report.layers
    assert 0 < s["pred_active_mean"] < 1 and abs(s["true_active_mean"] - 0.5) < 0.2
    cfg = json.loads((d / "pred" / "config.json").read_text())
    assert cfg["sparse_threshold"] == 0.0 and "sparse_activation" not in cfg
    sd = torch.load(d / "pred" / "model_1.pt", weights_only=True)
    assert sd["fc1.weight"].dtype == torch.float16 and sd["fc1.weight"].shape == (64, 32)
    assert (d / "pred" / "activation" / "activation_1.pt").is_file()

    # the trained predictors gate a real PWRI model built by the converter
    out = convert(path, d / "pred", tmp_path / "trained.powerinfer.gguf", outtype="f32")
    with read_gguf(out) as gf:
        assert gf.kv[Keys.SPARSE_THRESHOLD] == 0.0
    m = load(out)
    m.logits(ids[:40])
    assert 0 < m.sparsity.active_fraction().mean() < 1
    m.file.close()


def test_calibration_folds_per_layer_thresholds_into_fc2(trained, tmp_path) -> None:
    _, prof, d, _, opts = trained
    records = calibrate_predictors(
        d / "pred", prof.samples_dir, tmp_path / "cal", 0.35, seed=opts.seed
    )
    assert abs(np.mean([r["active"] for r in records]) - 0.65) < 0.02
    cfg = json.loads((tmp_path / "cal" / "config.json").read_text())
    assert cfg["sparse_threshold"] == -1.0 and len(cfg["powerpy"]["calibration"]["layers"]) == 2
    meta = load_samples(prof.samples_dir)
    for l, r in enumerate(records):
        assert r["threshold"] < 0
        x = torch.from_numpy(np.asarray(sample_arrays(meta, l)[0], dtype=np.float32))
        raw = torch.load(d / "pred" / f"model_{l}.pt", weights_only=True)
        cal = torch.load(tmp_path / "cal" / f"model_{l}.pt", weights_only=True)
        z_raw = predictor_logits(x, raw["fc1.weight"].float(), raw["fc2.weight"].float())
        z_cal = predictor_logits(x, cal["fc1.weight"].float(), cal["fc2.weight"].float())
        agree = ((z_raw >= r["threshold"]) == (z_cal >= -1.0)).float().mean()
        assert agree > 0.999  # equal up to the fp16 rounding of the scaled fc2


def _curve(active, lost):
    from powerpy.pipeline.calibrate import LayerCurve

    a = np.asarray(active, float)
    return LayerCurve(
        thr=-np.arange(1, len(a) + 1, dtype=float)[::-1], active=a, lost=np.asarray(lost)
    )


def test_allocation_with_a_predictor_cost_leaves_poor_predictors_ungated() -> None:
    """With a fixed predictor cost a layer runs dense unless skipping pays for its predictor;
    the chosen plan meets the cost target and beats every other plan on lost energy."""
    import itertools

    from powerpy.pipeline.calibrate import allocate, plan_cost

    good = _curve([0.3, 0.5, 0.7, 0.9], [0.02, 0.005, 0.001, 0.0])  # skips cheaply
    poor = _curve([0.3, 0.5, 0.7, 0.9], [0.5, 0.2, 0.05, 0.01])  # loses much when skipping
    curves = [good, poor, good, poor]
    cost, target = 0.2, 0.85
    picks = allocate(curves, target, cost)
    assert picks[1] is None and picks[3] is None and picks[0] is not None
    choices = [[None, 0, 1, 2, 3]] * 4

    def lost(p):
        return sum(0.0 if k is None else c.lost[k] for c, k in zip(curves, p, strict=True))

    assert plan_cost(curves, picks, cost) <= target + 1e-9
    plans = [p for p in itertools.product(*choices) if plan_cost(curves, p, cost) <= target + 1e-9]
    assert lost(picks) <= min(lost(p) for p in plans) + 1e-12
    # without a cost every layer is gated, at mean active <= target (PowerInfer's behaviour)
    plain = allocate(curves, 0.6)
    assert None not in plain and plan_cost(curves, plain) <= 0.6


def test_calibration_with_a_cost_writes_dense_layers_into_the_file(
    relu_model, trained, tmp_path
) -> None:
    """calibrate (predictor cost) -> config.json dense_layers -> convert -> powerpy.dense_layers
    -> those layers load ungated."""
    _, _, path = relu_model
    _, prof, d, ids, opts = trained
    records = calibrate_predictors(
        d / "pred", prof.samples_dir, tmp_path / "cal", 0.0, predictor_cost=0.5, seed=opts.seed
    )
    assert all(r["dense"] for r in records)  # nothing can pay for a predictor this dear
    cfg = json.loads((tmp_path / "cal" / "config.json").read_text())
    assert cfg["powerpy"]["calibration"]["dense_layers"] == [0, 1]
    out = convert(path, tmp_path / "cal", tmp_path / "c.powerinfer.gguf", outtype="f32")
    with read_gguf(out) as gf:
        assert list(gf.kv[Keys.DENSE_LAYERS]) == [0, 1]
    m = load(out)
    assert not any(b.sparse_layer for b in m.model.weights.blk)
    m.logits(ids[:20])
    assert np.all(m.sparsity.active_fraction() == 1.0)
    m.file.close()
    records = calibrate_predictors(
        d / "pred", prof.samples_dir, tmp_path / "cal2", 0.2, predictor_cost=0.05, seed=opts.seed
    )
    plan = np.mean([1.0 if r["dense"] else 0.05 + r["active"] for r in records])
    assert plan <= 0.8 + 0.02 and not all(r["dense"] for r in records)


def test_cli_profile_and_train_from_samples(tmp_path, capsys) -> None:
    path = tmp_path / "dense.gguf"
    write_tiny_model(path, SPEC, sparse=False)
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 3)
    out = tmp_path / "prof"
    rc = main(
        [
            "profile",
            "-m",
            str(path),
            "--text",
            str(text),
            "--ctx",
            "64",
            "-o",
            str(out),
            "--dump-samples",
            "300",
            "--target-sparsity",
            "0.6",
        ]
    )
    assert rc == 0 and (out / "activation_1.pt").is_file() and (out / "profile.json").is_file()
    rc = main(
        [
            "train-predictors",
            "--from-samples",
            str(out / "samples"),
            "-o",
            str(tmp_path / "pred"),
            "--hidden",
            "16",
            "--epochs",
            "2",
        ]
    )
    assert rc == 0
    cfg = json.loads((tmp_path / "pred" / "config.json").read_text())
    assert cfg["sparse_activation"] == "silu" and len(cfg["magnitude_thresholds"]) == 2
    assert "mean recall" in capsys.readouterr().out
    cal = tmp_path / "cal"
    rc = main(
        [
            "train-predictors",
            "--from-samples",
            str(out / "samples"),
            "--calibrate-from",
            str(tmp_path / "pred"),
            "--skip-fraction",
            "0.3",
            "-o",
            str(cal),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0 and "layer   1  threshold" in printed and "planned mean active" in printed
    plan = json.loads((cal / "config.json").read_text())["powerpy"]["calibration"]
    assert plan["skip_fraction"] == 0.3 and len(plan["layers"]) == 2
    # a SiLU predictor set converts into a file marked as SiLU
    conv = tmp_path / "s.powerinfer.gguf"
    assert main(["convert", str(path), str(tmp_path / "pred"), "-o", str(conv)]) == 0
    with read_gguf(conv) as gf:
        assert gf.kv[Keys.SPARSE_ACTIVATION] == "silu"


def test_cli_profiles_a_dense_relu_gguf_with_ffn_act(tmp_path, capsys) -> None:
    path = tmp_path / "dense-relu.gguf"  # a dense GGUF has no activation key: the user says relu
    tensors = write_tiny_model(path, SPEC, sparse=False, seed=4)
    for l in range(SPEC.n_layer):
        tensors[f"blk.{l}.ffn_down_t.weight"] = tensors[f"blk.{l}.ffn_down.weight"].T
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "prof"
    args = ["profile", "-m", str(path), "--text", str(text), "--ctx", "32", "-o", str(out)]
    assert main([*args, "--tokens", "64", "--ffn-act", "relu", "-t", "1"]) == 0
    assert "(relu)" in capsys.readouterr().err
    ids = load(path).tokenize(TEXT, add_bos=False)
    counts = load_activation_stats(out, SPEC.n_layer, SPEC.n_ff)
    want = [np.zeros(SPEC.n_ff, np.int64) for _ in range(SPEC.n_layer)]
    for s in window_starts(len(ids), 32, 64):
        for l, (gate, up) in enumerate(reference_ffn_preacts(tensors, ids[s : s + 32])):
            want[l] += ((gate > 0) & (up != 0)).sum(0)
    for l in range(SPEC.n_layer):
        assert np.abs(counts[l] - want[l]).sum() <= 2


def test_dense_layers_in_config_are_checked(tmp_path) -> None:
    """A predictor config naming layers the model lacks is one error that names the file."""
    from powerpy.pipeline.predictors import read_dense_layers

    cfg = {"powerpy": {"calibration": {"dense_layers": [1, 0]}}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_dense_layers(tmp_path, 2) == (0, 1)
    for bad in ([2], [0, 0], ["1"], 3):
        cfg["powerpy"]["calibration"]["dense_layers"] = bad
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=r"config\.json: powerpy\.calibration\.dense_layers"):
            read_dense_layers(tmp_path, 2)
