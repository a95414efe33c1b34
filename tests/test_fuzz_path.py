"""The whole load path under mutated inputs (issue 13): every mutated model, gpuidx or statistics
file goes through read -> ``powerpy.load`` -> two generated tokens -> detokenize, and the only
allowed outcomes are: it runs, it raises a ``PowerpyError``, or a ``NonFiniteError`` (also a
``PowerpyError``). Any other exception escapes ``powerpy.testing.fuzz.run`` and fails the test.

The generator is ``powerpy.testing.fuzz``; ``tools/fuzz.py`` runs it at scale in subprocesses.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerpy.testing import fuzz as fz

EXAMPLES_PER_FAMILY = 150
FAMILY_MUTATIONS = fz.families()


@pytest.fixture(autouse=True)
def _quiet(one_thread):
    """Tiny models on one thread; the library's logging and warnings are not under test."""
    logging.disable(logging.CRITICAL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


def test_every_family_has_mutations():
    assert set(FAMILY_MUTATIONS) == set(fz.FAMILIES)
    assert all(len(ms) >= 3 for ms in FAMILY_MUTATIONS.values()), FAMILY_MUTATIONS


@pytest.mark.parametrize("family", fz.FAMILIES)
@settings(
    max_examples=EXAMPLES_PER_FAMILY,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_mutated_inputs_give_one_clear_outcome(family, data):
    name = data.draw(st.sampled_from(FAMILY_MUTATIONS[family]), label="mutation")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    with tempfile.TemporaryDirectory() as tmp:
        outcome, what = fz.run_case(name, seed, Path(tmp))  # other exceptions fail the test
    assert outcome in fz.OUTCOMES, (name, seed, what, outcome)


# --- the cases the issue lists, one test each ------------------------------------------------
NON_FINITE = {"weights_nan", "weights_huge"}


@pytest.mark.parametrize("name", sorted(fz.SEED_CASES))
def test_seed_case(name, tmp_path):
    p = fz.prepare_seed_case(name, tmp_path)
    outcome = fz.run(p)
    if name in NON_FINITE:
        assert outcome == "NonFiniteError"
        assert "residual stream became" in p.errors[-1], p.errors
        return
    assert outcome == "PowerpyError", (name, p.errors)
    message = p.errors[0]
    if p.activation is not None:  # the statistics file is named; the load itself still runs
        assert "activation_" in message and str(p.activation) in message, message
        assert len(p.errors) == 1, p.errors
    else:
        assert str(p.model) in message, message


def test_seed_case_messages_say_what_is_wrong(tmp_path):
    """A few messages in full: the key or tensor, the value, and what to do."""
    expected = {
        "head_count_0": ("n_head is 0", "re-convert"),
        "vocab_size_too_large": ("vocab_size 300", "259 tokens"),
        "eos_float_inf": ("tokenizer.ggml.eos_token_id", "inf"),
        "f32_labelled_q4_0": ("blk.0.ffn_up.weight", "Q4_0"),
        "stats_sparse_coo": ("activation_", "sparse"),
        "stats_truncated": ("activation_", "cannot read"),
    }
    for name, parts in expected.items():
        p = fz.prepare_seed_case(name, tmp_path / name)
        assert fz.run(p) == "PowerpyError"
        for part in parts:
            assert part in p.errors[0], (name, p.errors[0])


# Falcon and OPT: the tensor or key each refusal names, and what the family expects
ARCH_MESSAGES = {
    "falcon_ffn_gate": ("tensor 'blk.0.ffn_gate.weight'", "not part of a falcon model", "ffn_up"),
    "falcon_qkv_rows": ("tensor 'blk.1.attn_qkv.weight'", "(40, 32)", "(48, 32)"),
    "falcon_norm_bias_missing": ("tensor 'blk.0.attn_norm.bias' is missing",),
    "falcon_norm_2_bias_missing": ("tensor 'blk.1.attn_norm_2.bias' is missing",),
    "falcon_eps_string": ("'falcon.attention.layer_norm_epsilon'", "'1e-5' (str)"),
    "opt_no_position_embd": ("tensor 'position_embd.weight' is missing",),
    "opt_position_table_short": ("'position_embd.weight' holds 1 rows", "row p + 2"),
    "opt_position_table_offset": ("'position_embd.weight' holds 2 rows", "row p + 2"),
    "opt_bias_missing": ("tensor 'blk.0.attn_k.bias' is missing",),
    "opt_down_bias_missing": ("tensor 'blk.1.ffn_down_t.bias' is missing",),
    "opt_eps_array": ("'opt.attention.layer_norm_epsilon'", "must be one number"),
}


# Gemma and Phi-3: their fused tensors, norms, output, soft-caps, window pattern, head size, RoPE
WINDOWED_MESSAGES = {
    "phi3_ffn_up_rows": ("tensor 'blk.0.ffn_up.weight' has shape (64, 32)", "(128, 32)"),
    "phi3_qkv_rows": ("tensor 'blk.1.attn_qkv.weight' has shape (96, 32)", "(64, 32)"),
    "phi3_rope_factors_zero": ("tensor 'rope_factors_long.weight'", "must be > 0"),
    "stablelm_12b_q_norm": ("tensor 'blk.0.attn_q_norm.weight' is not part of a stablelm model",),
    "phi2_no_output_bias": ("tensor 'output.bias' is missing",),
    "gemma_post_norm": ("tensor 'blk.0.post_ffw_norm.weight' is not part of a gemma model",),
    "gemma_output": ("tensor 'output.weight' is not part of a gemma model", "token_embd"),
    "gemma2_no_post_ffw_norm": ("tensor 'blk.1.post_ffw_norm.weight' is missing",),
    "gemma2_output": ("tensor 'output.weight' is not part of a gemma2 model", "token_embd"),
    "gemma2_softcap_nan": ("gemma2.attn_logit_softcapping", "is nan"),
    "gemma2_pattern_string": ("'gemma2.attention.sliding_window_pattern'", "'2' (str)"),
    "gemma3_q_norm_size": ("tensor 'blk.0.attn_q_norm.weight' has shape (32,)", "(16,)"),
    "gemma3_key_length_mismatch": ("gemma3.attention.value_length", "key length 16"),
    "gemma3_rope_longrope": ("gemma3.rope.scaling.type", "'longrope'"),
}


# mixtures of experts (powerpy.testing.fuzz.experts): counts, routers, stacks, keys
MOE_MESSAGES = {
    "moe_used_over_count": ("llama.expert_used_count is 5", "llama.expert_count (4)"),
    "moe_count_too_small": ("'blk.0.ffn_gate_inp.weight' has shape (4, 32)", "= (3, 32)"),
    "moe_down_transposed": (
        "'blk.1.ffn_down_exps.weight' has shape (4, 64, 32)",
        "(n_expert, n_embd, n_ff_exp) = (4, 32, 64)",
    ),
    "moe_gate_missing": (
        "'blk.0.ffn_gate_exps.weight' is missing",
        "(n_expert, n_ff_exp, n_embd) = (4, 32, 32)",
    ),
    "moe_without_count": ("'blk.0.ffn_gate_inp.weight' belongs to a mixture of experts",),
    "moe_norm_not_bool": ("'qwen3moe.expert_weights_norm' must be a BOOL",),
    "moe_shared_width_zero": ("qwen2moe.expert_shared_feed_forward_length is 0", "must be > 0"),
    "moe_shared_down_missing": (
        "'blk.1.ffn_down_shexp.weight' is missing",
        "(n_embd, n_ff_shexp) = (32, 48)",
    ),
    # glm4moe (powerpy.testing.fuzz.routing): the gating, groups, selection bias, dense layers
    "moe_gating_unknown": ("glm4moe.expert_gating_func is 4",),
    "moe_groups_uneven": ("glm4moe.expert_group_count 3", "do not fit glm4moe.expert_count (4)"),
    "moe_probs_bias_missing": ("'blk.2.exp_probs_b.bias' is missing", "(n_expert) = (4,)"),
    "moe_dense_lead_over_layers": ("glm4moe.leading_dense_block_count is 5",),
    # deepseek2 (powerpy.testing.fuzz.latent): the latent attention's tensors and widths
    "mla_k_b_missing": ("'blk.1.attn_k_b.weight' is missing", "needs attn_q_a"),
    "mla_kv_lora_rank_zero": ("deepseek2.attention.kv_lora_rank is 0",),
    "mla_key_length_too_small": ("deepseek2.attention.key_length_mla is 8",),
    # gpt-oss (powerpy.testing.fuzz.oss): sinks, expert biases, the window's keys
    "oss_sinks_missing": ("'blk.0.attn_sinks.weight' is missing", "(n_head) = (4,)"),
    "oss_sinks_cut": ("'blk.1.attn_sinks.weight' has shape (3,)", "(n_head) = (4,)"),
    "oss_expert_bias_missing": ("'blk.1.ffn_up_exps.bias' is missing",),
    "oss_window_missing": ("required key 'gpt-oss.attention.sliding_window' is missing",),
    "oss_window_pattern_odd": ("'gpt-oss.attention.sliding_window_pattern' must be one integer",),
    "oss_sinks_in_qwen3moe": ("'blk.0.attn_sinks.weight' is not part of a qwen3moe model",),
}


@pytest.mark.parametrize(
    "family, expected", [("arch", ARCH_MESSAGES | WINDOWED_MESSAGES), ("moe", MOE_MESSAGES)]
)
def test_family_seed_cases_name_what_is_wrong(tmp_path, family, expected):
    """Every Falcon/OPT/Gemma/Phi-3 and mixture-of-experts seed case is refused at load with one
    message naming the file and the tensor or key (test_seed_case runs them too)."""
    assert set(expected) == {n for n, (f, _) in fz.SEED_CASES.items() if f == family}
    for name, parts in expected.items():
        p = fz.prepare_seed_case(name, tmp_path / name)
        assert fz.run(p) == "PowerpyError", (name, p.errors)
        assert len(p.errors) == 1 and str(p.model) in p.errors[0], (name, p.errors)
        for part in parts:
            assert part in p.errors[0], (name, p.errors[0])


@pytest.mark.parametrize("arch", ["falcon", "opt", "gemma", "gemma2", "gemma3", "phi3", "stablelm"])
def test_valid_arch_models_run(tmp_path, arch):
    """The unmutated Falcon (multi-query and 40B-like), OPT, Gemma and Phi-3 drafts run sparse,
    dense and placed (phi3's fused gate+up is refused a placement by name), so the "arch"
    family's refusals are the mutations'."""
    for seed in (0, 1):
        for sparse, load in ((True, {}), (False, {}), (True, {"vram_budget": fz.BUDGET_GIB})):
            d = fz.arch_draft(arch, sparse, seed)
            d.load = dict(load, device="cpu") if load else {}
            p = fz.finish(d, "none", "base", seed, "base", tmp_path / f"{seed}{sparse}{bool(load)}")
            if arch == "phi3" and load:
                assert fz.run(p) == "PowerpyError" and "fuses the gate and up" in p.errors[0]
                continue
            assert fz.run(p) == "ok", (seed, sparse, load, p.errors)


def test_valid_model_runs(tmp_path):
    """The unmutated base model (sparse and dense, and placed) runs: outcomes are not vacuous."""
    for sparse, load in ((True, {}), (False, {}), (True, {"vram_budget": fz.BUDGET_GIB})):
        d = fz.base_draft(sparse)
        d.load = dict(load, device="cpu") if load else {}
        p = fz.finish(d, "none", "base", 0, "base", tmp_path / f"{sparse}{bool(load)}")
        assert fz.run(p) == "ok", p.errors


def test_unexpected_error_is_not_swallowed(tmp_path, monkeypatch):
    """The harness lets a non-PowerpyError through (so a leak fails the tests above)."""
    from powerpy import api

    def boom(*a, **k):
        raise IndexError("leaked")

    monkeypatch.setattr(api, "load", boom)
    p = fz.prepare_seed_case("head_count_0", tmp_path)
    with pytest.raises(IndexError, match="leaked"):
        fz.run(p)
