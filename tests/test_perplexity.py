"""Perplexity (llama.cpp method) against a hand computation on a tiny model, and the CLI."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from powerpy.api import load
from powerpy.cli import main
from powerpy.model.options import RunOptions
from powerpy.pipeline import research
from powerpy.pipeline.corpus import kjv_text, window_starts
from powerpy.pipeline.perplexity import compare_dense_sparse, n_chunks_for, perplexity
from powerpy.testing import TinySpec, write_tiny_model

SPEC = TinySpec(n_embd=32, n_layer=2, n_ff=64, n_head=4, n_head_kv=2, n_pred_hidden=8)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "tiny.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True)
    llm = load(path)
    yield llm
    llm.file.close()


def hand_ppl(llm, ids: list[int], ctx: int, n_chunks: int, bos: int | None) -> float:
    """Each chunk in one full forward; score positions ctx/2 … ctx-2 (numpy log-softmax)."""
    nll, count = 0.0, 0
    for c in range(n_chunks):
        chunk = list(ids[c * ctx : (c + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        logits = llm.logits(chunk).double().numpy()  # (ctx, n_vocab)
        for pos in range(ctx // 2, ctx - 1):
            z = logits[pos]
            logp = z - (np.log(np.exp(z - z.max()).sum()) + z.max())
            nll -= logp[chunk[pos + 1]]
            count += 1
    return math.exp(nll / count)


@pytest.mark.parametrize("sparse", [False, True])
def test_matches_hand_computation(tiny, sparse) -> None:
    ids = tiny.tokenize("In the beginning God created the heaven and the earth. " * 6)
    opts, saved = RunOptions(sparse=sparse), tiny.options
    tiny.options = opts  # hand_ppl runs llm.logits with the handle's options
    try:
        r = perplexity(tiny.model, ids, ctx=64, chunks=3, opts=opts)
        want = hand_ppl(tiny, ids, 64, 3, None)
        r_bos = perplexity(tiny.model, ids, ctx=64, chunks=2, bos_id=1, opts=opts)
        want_bos = hand_ppl(tiny, ids, 64, 2, 1)
    finally:
        tiny.options = saved
    assert r.n_chunks == 3 and r.n_scored == 3 * 31
    assert r.ppl == pytest.approx(want, rel=1e-5)
    assert r_bos.ppl == pytest.approx(want_bos, rel=1e-5)
    assert (r.sparsity is not None) == sparse
    if sparse:
        assert 0.0 <= r.sparsity <= 1.0 and r.layer_active.shape == (SPEC.n_layer,)


def test_compare_dense_sparse(tiny) -> None:
    ids = tiny.tokenize("abc " * 40)
    dense, sparse = compare_dense_sparse(tiny.model, ids, ctx=32, chunks=2)
    assert not dense.sparse and sparse is not None and sparse.sparse
    # A threshold nothing passes leaves only attention: the sparse run differs from dense.
    _, none = compare_dense_sparse(tiny.model, ids, ctx=32, chunks=2, threshold=float("inf"))
    assert none.sparsity == 1.0 and none.ppl != pytest.approx(dense.ppl)


def test_errors_and_window_choice() -> None:
    with pytest.raises(ValueError, match="fewer than one 512-token chunk"):
        n_chunks_for(100, 512, None)
    with pytest.raises(ValueError, match="even number"):
        n_chunks_for(100, 7, None)
    assert n_chunks_for(1000, 100, 3) == 3 and n_chunks_for(1000, 100, None) == 10
    np.testing.assert_array_equal(window_starts(1000, 100, 250), [0, 400, 900])
    np.testing.assert_array_equal(window_starts(1000, 100, None), np.arange(10) * 100)


def test_kjv_split_is_disjoint() -> None:
    train, held = kjv_text("train"), kjv_text("heldout")
    assert held.startswith("Hebrews\n") and "Revelation" in held
    assert "Hebrews\n" not in train and train.startswith("Genesis\n")
    assert "Philemon" in train


def test_cli_reports_dense_and_sparse_side_by_side(tmp_path, capsys) -> None:
    path = tmp_path / "t.powerinfer.gguf"
    write_tiny_model(path, SPEC, sparse=True)
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    torch.manual_seed(0)
    base = ["perplexity", "-m", str(path), "-f", str(text), "-c", "64"]
    assert main(base) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["dense", "sparse"] and rows[0][2] == "+0.00%"
    dense_ppl, sparse_ppl = float(rows[0][1]), float(rows[1][1])
    assert rows[1][2] == f"{100 * (sparse_ppl / dense_ppl - 1):+.2f}%"
    assert main([*base, "--sparse-only"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["sparse"] and float(rows[0][1]) == sparse_ppl
    assert main([*base, "--dense"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["dense"] and float(rows[0][1]) == dense_ppl
    assert main(["perplexity", "-m", str(path), "-f", str(tmp_path / "none.txt")]) == 1


def test_sweeps_compute_with_the_handles_numerics(smollm2_path) -> None:
    """A handle loaded with exact activations runs its sweeps' dense perplexity with them (the
    quantized model's llama.cpp rounding gives another value)."""
    text = kjv_text("heldout")[:4000]
    exact = load(smollm2_path, exact_activations=True)
    ids = exact.tokenize(text, add_bos=False)
    got = research.sparsity_sweep(
        exact, ids, oracle=[0.5], ctx=64, chunks=1, progress=False
    ).dense_ppl
    kw = dict(ctx=64, chunks=1, bos_id=exact.tokenizer.bos_id if exact.tokenizer.add_bos else None)
    opts = RunOptions(sparse=False, numerics=exact.options.numerics)
    want = perplexity(exact.model, ids, opts=opts, **kw)
    rounded = perplexity(exact.model, ids, opts=RunOptions(sparse=False), **kw)
    assert got == want.ppl and got != rounded.ppl
