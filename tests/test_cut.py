"""The FFN cut (``powerpy.ffn_down_threshold``): a computed neuron adds its down row only when
``|h_j| · ‖ffn_down_t[j]‖`` reaches its layer's threshold. Checked against a float64 reference,
across the decode paths (one call per token, per layer, torch), in prefill, in the statistics,
in a hybrid placement, and for bad keys and predictor configs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from powerpy.api import load
from powerpy.config import ModelArgs
from powerpy.errors import ModelConfigError
from powerpy.formats.constants import GGUFValueType, Keys
from powerpy.formats.gguf_reader import read_gguf
from powerpy.model.options import RunOptions
from powerpy.model.split import split_ffn
from powerpy.pipeline import research
from powerpy.testing import TinySpec, write_tiny_model

SPEC = TinySpec(n_embd=64, n_layer=2, n_ff=256, n_head=4, n_head_kv=2)
TOKENS = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
F32 = GGUFValueType.FLOAT32


def _cut_kv(cuts) -> dict:
    return {Keys.FFN_DOWN_THRESHOLD: (list(cuts), GGUFValueType.ARRAY, F32)}


def _cuts_at(t: dict, share: float) -> list[float]:
    """Per-layer thresholds that cut about ``share`` of random inputs' neurons (ReGLU)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, SPEC.n_embd))
    out = []
    for l in range(SPEC.n_layer):
        g, u = (t[f"blk.{l}.ffn_{k}.weight"].astype(np.float64) for k in ("gate", "up"))
        h = np.maximum(x @ g.T, 0) * (x @ u.T)
        score = np.abs(h) * np.linalg.norm(t[f"blk.{l}.ffn_down_t.weight"], axis=1)
        out.append(float(np.quantile(score[h != 0], share)))
    return out


@pytest.fixture(scope="module")
def cut_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cut") / "tiny-cut.powerinfer.gguf"
    t = write_tiny_model(path, SPEC, sparse=True, seed=3)
    cuts = _cuts_at(t, 0.5)
    path.unlink()
    write_tiny_model(path, SPEC, sparse=True, seed=3, extra_kv=_cut_kv(cuts))
    return path, t, cuts


def test_the_key_is_read_and_validated(tmp_path):
    path = tmp_path / "m.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True, extra_kv=_cut_kv([0.5, 0.25]))
    args = ModelArgs.from_gguf_kv(read_gguf(path).kv, sparse=True, source="m.gguf")
    assert args.down_thresholds == (0.5, 0.25)
    written = args.to_gguf_kv(name="m")[Keys.FFN_DOWN_THRESHOLD]
    assert list(written[0]) == [0.5, 0.25] and written[2] == F32
    for i, bad in enumerate(([0.5], [0.5, -1.0], [0.5, float("nan")], [0.5, float("inf")])):
        p = tmp_path / f"bad{i}.powerinfer.gguf"
        write_tiny_model(p, SPEC, sparse=True, extra_kv=_cut_kv(bad))
        with pytest.raises(ModelConfigError, match=rf"{p.name}: powerpy\.ffn_down_threshold"):
            load(p)
    p = tmp_path / "str.powerinfer.gguf"
    s = GGUFValueType.STRING
    write_tiny_model(
        p,
        SPEC,
        sparse=True,
        extra_kv={Keys.FFN_DOWN_THRESHOLD: (["a", "b"], GGUFValueType.ARRAY, s)},
    )
    with pytest.raises(ModelConfigError, match="must be an array of numbers"):
        load(p)


def test_split_ffn_with_a_cut_matches_float64(cut_model):
    path, t, cuts = cut_model
    llm = load(path, threshold=-np.inf)
    blk = llm.model.weights.blk[0]
    x = np.random.default_rng(1).standard_normal((5, SPEC.n_embd)).astype(np.float32)
    g, u, d = (
        t[f"blk.0.{k}.weight"].astype(np.float64) for k in ("ffn_gate", "ffn_up", "ffn_down_t")
    )
    h = np.maximum(x @ g.T, 0) * (x @ u.T)  # (T, n_ff) ReGLU
    keep = np.abs(h) * np.linalg.norm(d, axis=1) >= cuts[0]
    assert 0.2 < keep[h != 0].mean() < 0.8
    for T in (1, 5):  # one token reads its kept rows; a batch masks h
        got = split_ffn(blk, torch.from_numpy(x[:T]), None, "reglu", None, opts=llm.options)
        np.testing.assert_allclose(got.numpy(), (h * keep)[:T] @ d, atol=1e-5, rtol=1e-5)
        dense = split_ffn(blk, torch.from_numpy(x[:T]), None, "reglu", None, opts=RunOptions(False))
        np.testing.assert_allclose(dense.numpy(), h[:T] @ d, atol=1e-5, rtol=1e-5)


def test_decode_paths_agree_and_count_the_cut(cut_model, monkeypatch):
    """One native call per token, two per layer, and torch: the same logits and statistics; the
    statistics count the neurons whose down rows were added."""
    from powerpy.model import kernels, stack_decode, transformer

    if not kernels.available():
        pytest.skip("native kernels unavailable")
    path, _, _ = cut_model
    runs = []
    for mode in ("stack", "layers", "general"):
        if mode == "layers":
            monkeypatch.setattr(stack_decode, "plan_for", lambda *a: None)
        if mode == "general":
            monkeypatch.setattr(transformer, "fused_decode", lambda *a: None)
        llm = load(path, threshold=-np.inf)
        cache = llm.model.new_cache(16, dtype=torch.float32)
        llm.model.forward(torch.tensor(TOKENS[:4]), cache, llm.options)
        llm.sparsity.reset()
        rows = [llm.model.forward(torch.tensor([t]), cache, llm.options) for t in TOKENS[4:10]]
        runs.append((torch.cat(rows).numpy(), llm.sparsity.active_fraction().copy()))
    (l1, s1), (l2, s2), (l3, s3) = runs
    np.testing.assert_array_equal(l1, l2)
    np.testing.assert_allclose(l1, l3, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_allclose(s1, s3)
    assert np.all((s1 > 0.05) & (s1 < 0.6)), s1  # ReGLU zeros, then about half of the rest


def test_scale_zero_and_dense_runs_ignore_the_cut(cut_model, tmp_path):
    path, _, _ = cut_model
    plain = tmp_path / "plain.powerinfer.gguf"
    write_tiny_model(plain, SPEC, sparse=True, seed=3)
    base = load(plain, threshold=-np.inf).logits(TOKENS)
    llm = load(path, threshold=-np.inf)
    for opts in (RunOptions(cut_scale=0.0, threshold=-np.inf), RunOptions(sparse=False)):
        llm.options = opts
        torch.testing.assert_close(llm.logits(TOKENS), base, atol=1e-5, rtol=0)
    llm.options = RunOptions(threshold=-np.inf)
    assert (llm.logits(TOKENS) - base).abs().max() > 1e-3  # the cut changes the result
    with pytest.raises(ValueError, match="cut_scale"):
        RunOptions(cut_scale=-1.0)


def test_a_hybrid_placement_cuts_its_hot_rows_too(cut_model):
    from powerpy.formats.gpuidx import GpuIndex
    from powerpy.model.device import Accelerator
    from powerpy.placement.placement import Placement
    from powerpy.placement.runtime import build_hybrid

    path, _, _ = cut_model
    cpu = load(path, threshold=-np.inf)
    rng = np.random.default_rng(2)
    buckets = [np.sort(rng.choice(SPEC.n_ff, 100, replace=False)) for _ in range(SPEC.n_layer)]
    index = GpuIndex.from_buckets(buckets, SPEC.n_ff, vram_capacity=0)
    for gather in (False, True):
        llm = load(path, threshold=-np.inf)
        placement = Placement.for_model(llm.file, 1 << 30, index, n_ctx=32, kv_elem_bytes=4)
        rt = build_hybrid(
            llm.model, placement, Accelerator("cpu", gather_hot=gather), file=llm.file
        )
        for tokens in (TOKENS, TOKENS[:1]):  # prefill, then one token
            want = cpu.model.forward(
                torch.tensor(tokens), cpu.model.new_cache(32, torch.float32), cpu.options
            )
            got = rt.model.forward(torch.tensor(tokens), rt.model.new_cache(32), llm.options)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_converter_writes_the_cuts_of_the_predictor_config(tmp_path):
    from powerpy.pipeline.convert import convert

    dense = tmp_path / "dense.gguf"
    write_tiny_model(dense, SPEC, sparse=False, seed=4)
    preds = tmp_path / "preds"
    preds.mkdir()
    rng = np.random.default_rng(0)
    for l in range(SPEC.n_layer):
        fc1, fc2 = rng.standard_normal((16, SPEC.n_embd)), rng.standard_normal((SPEC.n_ff, 16))
        sd = {"fc1.weight": torch.tensor(fc1).float(), "fc2.weight": torch.tensor(fc2).float()}
        torch.save(sd, preds / f"model_{l}.pt")
    cfg = {"sparse_activation": "relu", "ffn_down_threshold": [0.25, 0.5]}
    (preds / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out.powerinfer.gguf"
    convert(dense, preds, out, outtype="f32")
    got = read_gguf(out).kv[Keys.FFN_DOWN_THRESHOLD]
    assert list(map(float, got)) == [0.25, 0.5]
    assert all(b.down_tau is not None for b in load(out).model.weights.blk)
    cfg["ffn_down_threshold"] = [0.25]
    (preds / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json: ffn_down_threshold must hold 2"):
        convert(dense, preds, tmp_path / "bad.powerinfer.gguf", outtype="f32")
    assert not (tmp_path / "bad.powerinfer.gguf").exists()


def test_cut_sweep(cut_model):
    path, _, _ = cut_model
    llm = load(path, threshold=-np.inf)
    text = TOKENS * 4
    res = research.sparsity_sweep(llm, text, cut=[0.0, 1.0, 3.0], ctx=16, chunks=2, progress=False)
    skipped = [p.skipped for p in res.points]
    assert res.kind == "cut" and skipped[0] < skipped[1] < skipped[2], skipped
    assert "cut scale" in res.table()
    plain = load(path, threshold=-np.inf)
    plain.model.weights.blk[0].down_tau = plain.model.weights.blk[1].down_tau = None
    with pytest.raises(ValueError, match="no cuts"):
        research.sparsity_sweep(plain, text, cut=[1.0], ctx=16, chunks=2, progress=False)


def test_cut_scale_at_load_and_on_the_command_line(cut_model, capsys):
    from powerpy.cli import main

    path, _, _ = cut_model
    base = load(path, threshold=-np.inf)
    skipped = []
    for scale in (0.0, 1.0, 2.0):
        llm = load(path, threshold=-np.inf, cut_scale=scale)
        assert llm.options.cut_scale == scale
        assert ("cut x2" in llm.mode) == (scale == 2.0) and ("cut" in llm.mode) == (scale > 0)
        llm.logits(TOKENS)
        skipped.append(1 - llm.sparsity.active_fraction().mean())
        if scale == 1.0:
            torch.testing.assert_close(llm.logits(TOKENS), base.logits(TOKENS), atol=0, rtol=0)
    assert skipped[0] < skipped[1] < skipped[2], skipped
    with pytest.raises(ValueError, match="cut_scale"):
        load(path, cut_scale=float("nan"))
    common = ["-m", str(path), "--sparse-threshold=-1e30"]
    assert main(["infer", *common, "-p", "a", "-n", "2", "--cut-scale", "2"]) == 0
    assert "cut x2 in 2 of 2 layers" in capsys.readouterr().err
    assert main(["infer", *common, "-p", "a", "-n", "2", "--cut-scale=-1"]) == 1
    err = capsys.readouterr().err
    assert "--cut-scale: cut_scale -1.0 must be finite and >= 0" in err and "Traceback" not in err


def test_the_cut_in_one_command_on_a_qwen2_model(tmp_path, capsys):
    """`powerpy cut`: a dense qwen2 GGUF and a text -> a PWRI file, every layer ungated, with
    its cuts at a share of the text's neurons; `perplexity --cut` shows the trade-off."""
    from powerpy.cli import main
    from powerpy.pipeline.corpus import kjv_text

    spec = TinySpec(arch="qwen2", n_embd=64, n_layer=2, n_ff=256, n_head=4, n_head_kv=2)
    src, out, text = tmp_path / "q.gguf", tmp_path / "q.powerinfer.gguf", tmp_path / "t.txt"
    write_tiny_model(src, spec, sparse=False, seed=1)
    text.write_text(kjv_text("train")[:3000], encoding="utf-8")
    args = ["cut", "-m", str(src), "--text", str(text), "--tokens", "512", "--ctx", "64"]
    assert main([*args, "-s", "0.4", "-o", str(out), "-t", "1"]) == 0
    assert "2 layers ungated" in capsys.readouterr().err
    gf = read_gguf(out)
    assert gf.sparse and list(gf.kv[Keys.DENSE_LAYERS]) == [0, 1]
    assert gf.kv[Keys.SPARSE_ACTIVATION] == "silu" and len(gf.kv[Keys.FFN_DOWN_THRESHOLD]) == 2
    dense, cut = load(src), load(out)
    assert cut.model.args.ffn_variant is dense.model.args.ffn_variant
    assert all(not b.sparse_layer and b.down_tau is not None for b in cut.model.weights.blk)
    ids = dense.tokenize(text.read_text(encoding="utf-8"), add_bos=False)[:256]
    off = load(out, cut_scale=0.0)
    # the same values up to the order of the down sums (the dense file's dot products, the PWRI
    # file's row sums over ffn_down_t)
    torch.testing.assert_close(off.logits(ids), dense.logits(ids), atol=3e-4, rtol=1e-4)
    cut.logits(ids)
    skipped = 1 - cut.sparsity.active_fraction().mean()
    assert 0.3 < skipped < 0.5, skipped  # the share asked for, on the calibration text
    ppl = ["perplexity", "-m", str(out), "-f", str(text), "-c", "64", "--chunks", "4", "-t", "1"]
    assert main([*ppl, "--cut", "0.75", "1", "1.25"]) == 0
    rows = [l.split() for l in capsys.readouterr().out.splitlines() if l.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0.75x", "1x", "1.25x"]
    shares = [float(r[1].rstrip("%")) for r in rows]
    assert shares == sorted(shares) and shares[0] > 0, rows
    assert main([*args, "-s", "1.5", "-o", str(tmp_path / "bad.powerinfer.gguf")]) == 1
    assert "cut share 1.5 must be in [0, 1)" in capsys.readouterr().err


def test_a_llama3_file_keeps_its_rope_freqs(tmp_path):
    """llama-3's ``rope_freqs.weight`` survives the conversion to PWRI (``powerpy cut``,
    ``convert``): the sparse file at cut 0 computes the dense file's logits."""
    from powerpy.formats.constants import GGMLType, Names
    from powerpy.formats.gguf_writer import write_gguf
    from powerpy.pipeline.cut import write_cut_model
    from powerpy.testing import tiny_kv, tiny_tensors

    src, out = tmp_path / "l3.gguf", tmp_path / "l3.powerinfer.gguf"
    t = tiny_tensors(SPEC, sparse=False, seed=5)
    hd = SPEC.n_embd // SPEC.n_head
    t[Names.ROPE_FREQS] = np.linspace(1.0, 8.0, hd // 2, dtype=np.float32)
    write_gguf(src, tiny_kv(SPEC), [(n, a, GGMLType.F32) for n, a in t.items()])
    write_cut_model(src, out, [0.1, 0.1], activation="silu")
    dense, cut = load(src), load(out, cut_scale=0.0)
    assert torch.equal(cut.model.weights.rope_freqs, torch.from_numpy(t[Names.ROPE_FREQS]))
    torch.testing.assert_close(cut.logits(TOKENS), dense.logits(TOKENS), atol=1e-4, rtol=1e-4)


def test_the_cut_command_adds_cuts_to_a_pwri_file_and_keeps_its_predictors(tmp_path, capsys):
    """`powerpy cut` on a PWRI file: a copy with the cuts, same magic, tensors and predictors;
    its sparse run skips down rows beyond the predictor's choice."""
    from powerpy.cli import main
    from powerpy.model.options import SparsityStats

    src, out, text = tmp_path / "m.powerinfer.gguf", tmp_path / "c.powerinfer.gguf", tmp_path / "t"
    write_tiny_model(src, SPEC, sparse=True, seed=3, threshold=-1e9)  # the predictor keeps all
    text.write_text("In the beginning God created the heaven and the earth. " * 20)
    args = ["cut", "-m", str(src), "--text", str(text), "--tokens", "256", "--ctx", "64", "-t", "1"]
    assert main([*args, "-s", "0.5", "-o", str(out)]) == 0
    assert "a copy with per-layer cuts" in capsys.readouterr().err
    with read_gguf(src) as a, read_gguf(out) as b:
        assert b.sparse and set(b.tensors) == set(a.tensors)
        assert all(np.array_equal(a.raw(n), b.raw(n)) for n in a.tensors)
        assert set(b.kv) - set(a.kv) == {Keys.FFN_DOWN_THRESHOLD}
    kept = {}
    for path in (src, out):
        llm = load(path)
        stats = SparsityStats.empty(SPEC.n_layer, SPEC.n_ff)
        ids = torch.tensor(llm.tokenize(text.read_text()[:120]))
        llm.model.forward(ids, llm.model.new_cache(len(ids)), RunOptions(stats=stats))
        kept[path] = float(stats.active_fraction().mean())
    assert all(b.fc1 is not None and b.down_tau is not None for b in llm.model.weights.blk)
    assert kept[src] == 1.0  # the predictor keeps every neuron
    assert 0.05 < kept[out] < 0.45, kept  # ReGLU's zeros, then half of the computed ones cut
    assert main([*args, "-s", "0.5", "-o", str(tmp_path / "x.gguf"), "--name", "n"]) == 1
    assert "copied with its types and name" in capsys.readouterr().err
