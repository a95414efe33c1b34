"""The committed PowerInfer-native example ``models/kjv-relu/`` (built by
``examples/kjv_relu/build_relu_example.py``): format, tokenizer, ReGLU numerics, sparsity and a
golden greedy continuation. The files are committed: a missing one fails the tests."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from powerpy.config import FFNVariant
from powerpy.formats.constants import GPUIDX_SUFFIX, Names
from powerpy.model.options import DENSE, RunOptions, SparsityStats
from powerpy.model.split import ffn

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "kjv-relu"
MODEL = MODEL_DIR / "kjv-relu.powerinfer.gguf"
RECIPE = ROOT / "examples" / "kjv_relu"  # the trainer and the build script


# Held-out text (Hebrews 11:1-2 and Revelation 21:4): never seen by the tokenizer or the model.
HELDOUT = (
    "Now faith is the substance of things hoped for, the evidence of things not seen. For by it "
    "the elders obtained a good report. And God shall wipe away all tears from their eyes; and "
    "there shall be no more death, neither sorrow, nor crying, neither shall there be any more "
    "pain: for the former things are passed away."
)
# Measured at build time on this text: 94.1% of neurons skipped (mean over layers, threshold 0).
MIN_SKIPPED = 0.90
PROMPT = "And God said"
PROMPT_IDS = [1, 300, 394, 390]  # BOS ▁And ▁God ▁said
# 16 greedy tokens after PROMPT (sparse path, threshold 0): " unto him, I will not be a manift,
# and a man that"; the smallest top-1/top-2 logit gap along the way is 0.026.
GOLDEN_IDS = [322, 335, 1999, 298, 399, 351, 299, 262, 406, 424, 1986, 1999, 270, 262, 406, 303]


@pytest.fixture(scope="module")
def llm():
    import powerpy

    return powerpy.load(MODEL)


def test_is_pwri_reglu(llm):
    a = llm.model.args
    assert llm.file.sparse and a.sparse and a.arch == "llama"
    assert a.ffn_variant == FFNVariant.REGLU
    assert llm.model.can_gate and llm.options.sparse
    names = llm.file.tensors
    for l in range(a.n_layer):
        assert Names.FFN_DOWN_T.format(l=l) in names
        assert Names.FFN_DOWN.format(l=l) not in names
        assert Names.FC1.format(l=l) in names and Names.FC2.format(l=l) in names
    assert a.n_ff % 256 == 0  # gen-gpuidx batch 256


def test_tokenizer_round_trip(llm):
    tok = llm.tokenizer
    assert tok.encode(PROMPT) == PROMPT_IDS
    for text in (HELDOUT, "Hello, wörld! 123 ☃\n\tAmen."):  # the second needs byte fallback
        ids = tok.encode(text, add_bos=False)
        assert tok.decode(ids) == text
    assert tok.encode(HELDOUT)[0] == tok.bos_id


def test_threshold_neg_inf_equals_dense_reglu(llm):
    """Gating at threshold -inf keeps every neuron: equal to the dense ReLU (ReGLU) FFN."""
    m = llm.model
    ids = torch.tensor(llm.tokenize(HELDOUT))
    blk = m.weights.blk[0]
    x = torch.randn(5, m.args.n_embd, generator=torch.Generator().manual_seed(0))
    gate, up = blk.ffn_gate.dequantize(), blk.ffn_up.dequantize()
    want = (F.relu(x @ gate.T) * (x @ up.T)) @ blk.ffn_down_t.dequantize()  # ReGLU by hand
    gate_all = RunOptions(threshold=-math.inf)
    dense = m.forward(ids, m.new_cache(len(ids)), DENSE, all_logits=True)
    dense_ffn = ffn(0, blk, x, x, m.args.ffn_variant, 0.0, DENSE, None)
    gated = m.forward(ids, m.new_cache(len(ids)), gate_all, all_logits=True)
    gated_ffn = ffn(0, blk, x, x, m.args.ffn_variant, -math.inf, gate_all, None)
    torch.testing.assert_close(gated, dense, rtol=0, atol=1e-4)
    torch.testing.assert_close(dense_ffn, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gated_ffn, want, rtol=1e-4, atol=1e-4)


def test_predicted_sparsity(llm):
    m = llm.model
    stats = SparsityStats.empty(m.args.n_layer, m.args.n_ff)
    ids = torch.tensor(llm.tokenize(HELDOUT))
    m.forward(ids, m.new_cache(len(ids)), RunOptions(stats=stats), all_logits=True)
    skipped = 1 - float(np.mean(stats.active_fraction()))
    assert skipped >= MIN_SKIPPED


def test_golden_greedy_continuation(llm):
    """The golden greedy ids, teacher-forced: each is the argmax, except at near-ties (< 0.1)
    where another CPU's kernels (AVX2 vs AVX-512 summation order) may legitimately flip it."""
    assert llm.options.sparse
    ids = llm.tokenize(PROMPT)
    logits = llm.logits(ids + GOLDEN_IDS[:-1])[len(ids) - 1 :]  # (16, n_vocab)
    top2 = logits.topk(2, dim=-1)
    golden = torch.tensor(GOLDEN_IDS)
    picked = logits.gather(1, golden[:, None])[:, 0]
    near_tie = top2.values[:, 0] - top2.values[:, 1] < 0.1
    assert torch.all((top2.indices[:, 0] == golden) | (near_tie & (picked >= top2.values[:, 1])))
    assert (top2.indices[:, 0] == golden).sum() >= len(GOLDEN_IDS) - 2


def test_committed_gpuidx_validates(llm):
    path = MODEL.with_name(MODEL.name + GPUIDX_SUFFIX)  # committed: a missing file fails
    from powerpy.formats.gpuidx import GpuIndex

    a = llm.model.args
    idx = GpuIndex.read(path, n_layer=a.n_layer, n_ff=a.n_ff)
    assert all(int(c) % 256 == 0 for c in idx.counts)


@pytest.mark.parametrize("script", ["build_relu_example.py", "train_relu_model.py"])
def test_recipe_scripts_start(script):
    """The recipe beside the model's README: both scripts parse their options."""
    out = subprocess.run(
        [sys.executable, str(RECIPE / script), "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout
