"""Samplers: greedy, temperature, top-k, top-p, min-p, repeat penalty, seed."""

from __future__ import annotations

import torch

from powerpy.sampling import SamplingParams, apply_repeat_penalty, filter_logits, make_sampler

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])


def test_greedy_is_argmax():
    assert make_sampler(SamplingParams(temperature=0))(LOGITS, []) == 5


def test_top_k_one_is_greedy():
    s = make_sampler(SamplingParams(temperature=1.5, top_k=1, seed=3))
    assert {s(LOGITS, []) for _ in range(20)} == {5}


def test_seed_reproducible_and_varied():
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a = [make_sampler(p)(LOGITS, []) for _ in range(1)]
    s1, s2 = make_sampler(p), make_sampler(p)
    seq1 = [s1(LOGITS, []) for _ in range(50)]
    seq2 = [s2(LOGITS, []) for _ in range(50)]
    assert seq1 == seq2 and len(set(seq1)) > 2 and a[0] == seq1[0]


def test_top_p_keeps_smallest_prefix():
    probs = torch.softmax(LOGITS, -1)  # order: 5, 0, 1, 2, 3, 4
    kept = filter_logits(LOGITS, 0, float(probs[5] + probs[0]) - 1e-6, 0.0)
    assert torch.isfinite(kept).nonzero().squeeze(1).tolist() == [0, 5]
    assert torch.isfinite(filter_logits(LOGITS, 0, 0.01, 0.0)).sum() == 1


def test_min_p_relative_to_max():
    probs = torch.softmax(LOGITS, -1)
    kept = filter_logits(LOGITS, 0, 1.0, 0.3)
    expect = (probs >= 0.3 * probs.max()).nonzero().squeeze(1).tolist()
    assert torch.isfinite(kept).nonzero().squeeze(1).tolist() == expect


def test_repeat_penalty_llama_cpp_rule():
    out = apply_repeat_penalty(LOGITS, [0, 4, 4], 2.0)
    assert out[0] == 1.0 and out[4] == -2.0 and out[5] == 3.0


def test_sampling_distribution_follows_temperature():
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    s = make_sampler(p)
    n = 4000
    counts = torch.bincount(torch.tensor([s(LOGITS, []) for _ in range(n)]), minlength=6)
    probs = torch.softmax(LOGITS, -1)
    assert torch.allclose(counts / n, probs, atol=0.03)
