"""The routings and layer layouts of the DeepSeek-style mixtures (GLM-4.5's ``glm4moe``):
sigmoid routing with a selection bias, expert groups, renormalized and scaled weights, unscaled
shared experts, leading dense layers and NextN layers, on every runtime path, and the refusals of
files whose keys or tensors do not make such a model.

The logits against llama.cpp are in ``test_moe_oracle.py``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from moe_files import GLM as ORACLE_GLM
from moe_files import refused, write_gguf_py

from powerpy.api import load
from powerpy.errors import FileFormatError, ModelConfigError
from powerpy.formats.constants import GGMLType, Keys, Names
from powerpy.formats.constants import GGUFValueType as V
from powerpy.model import moe, numerics, routing, stack_decode
from powerpy.model.numerics import Numerics
from powerpy.model.options import RunOptions, SparsityStats

# three of eight experts, two shared experts
GLM = replace(ORACLE_GLM, n_expert_used=3, n_expert_shared=2)
GROUPS = {
    "glm4moe.expert_group_count": (4, V.UINT32),
    "glm4moe.expert_group_used_count": (2, V.UINT32),
    "glm4moe.expert_weights_norm": (True, V.BOOL),
    "glm4moe.expert_weights_scale": (2.5, V.FLOAT32),
}
TOKENS = torch.tensor([1, 72, 101, 108, 108, 111, 44, 32, 119, 111])
EXACT = Numerics(quantized_activations=False)


def _reference(t: dict, l: int, x: np.ndarray, k: int, groups: tuple[int, int], scale: float):
    """DeepSeek-V3's / GLM-4.5's routed experts in float64: sigmoid scores, a selection bias,
    the best groups by their two best biased scores, the top k of those, weights the unbiased
    scores renormalized and scaled; x (T, n_embd) -> (T, n_embd)."""
    r = t[Names.FFN_GATE_INP.format(l=l)].astype(np.float64)
    b = t[Names.EXP_PROBS_B.format(l=l)].astype(np.float64)
    g, u = (t[n.format(l=l)].astype(np.float64) for n in (Names.FFN_GATE_EXPS, Names.FFN_UP_EXPS))
    down = t[Names.FFN_DOWN_EXPS.format(l=l)].astype(np.float64)
    p = 1 / (1 + np.exp(-(x @ r.T)))
    out = np.zeros_like(x)
    n_groups, used = groups
    for i in range(len(x)):
        s = (p[i] + b).reshape(n_groups, -1)
        best = np.argsort(-np.sort(s, axis=1)[:, -2:].sum(1), kind="stable")[:used]
        masked = np.full_like(s, -np.inf)
        masked[best] = s[best]
        top = np.argsort(-masked.reshape(-1), kind="stable")[:k]
        w = p[i, top] / p[i, top].sum() * scale
        for e, we in zip(top, w, strict=True):
            gx, ux = g[e] @ x[i], u[e] @ x[i]
            out[i] += we * (down[e] @ (gx / (1 + np.exp(-gx)) * ux))
    return out


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(path, f32 tensors) of a Q8_0 glm4moe file with expert groups."""
    path = tmp_path_factory.mktemp("glm") / "glm-q8_0.gguf"
    return path, write_gguf_py(path, GLM, GGMLType.Q8_0, seed=2, extra_kv=GROUPS)


def test_the_layers_are_dense_first_then_experts_and_nextn_is_not_run(glm):
    llm = load(glm[0])
    a, blk = llm.model.args, llm.model.weights.blk
    assert (a.n_layer, a.n_layer_nextn, a.n_layer_dense) == (3, 1, 1)  # block_count 4
    assert (a.expert_gating, a.n_expert_groups, a.n_group_used) == ("sigmoid", 4, 2)
    assert a.n_ff_shexp == 2 * 32 and a.to_gguf_kv()["glm4moe.block_count"][0] == 4
    assert blk[0].moe is None and blk[0].ffn_up.shape == (128, 64) and blk[0].ffn_up_shexp is None
    for b in blk[1:]:
        assert b.ffn_up is None and b.ffn_gate_inp_shexp is None  # an unscaled shared expert
        assert b.moe.routing.probs_b.shape == (8,) and b.ffn_up_shexp.shape == (64, 64)
    assert blk[1].attn_q.bias.shape == (64,) and blk[1].attn_q_norm.shape == (16,)  # 355B's


def test_sigmoid_group_routing_matches_a_float64_reference(tmp_path):
    t = write_gguf_py(tmp_path / "f32.gguf", GLM, GGMLType.F32, seed=4, extra_kv=GROUPS)
    ex = load(tmp_path / "f32.gguf").model.weights.blk[2].moe
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    opts = RunOptions(numerics=EXACT)
    with numerics.using(EXACT):
        got = moe.moe_ffn(2, ex, x, opts, None)
        one = torch.cat([moe.moe_ffn(2, ex, x[i : i + 1], opts, None) for i in range(6)])
        ids = routing.route(ex, x)[0]
    want = _reference(t, 2, x.double().numpy(), 3, (4, 2), 2.5)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=2e-5)
    np.testing.assert_allclose(one.numpy(), want, rtol=0, atol=2e-5)  # the decode path
    groups = (ids // 2).sort(dim=1).values  # each token's experts come from 2 of 4 groups
    assert all(len(set(g.tolist())) <= 2 for g in groups)


def test_the_selection_bias_chooses_but_does_not_weigh():
    """A large bias on expert 5 makes every token route to it; its weight stays its sigmoid."""
    r = routing.Routing("sigmoid", torch.tensor([0, 0, 0, 0, 0, 10.0, 0, 0]))
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    p = routing.probabilities(r, logits)
    torch.testing.assert_close(p, torch.sigmoid(logits))
    s = routing.selection(r, p)
    assert (s.argmax(1) == 5).all() and torch.equal(s[:, :5], p[:, :5])
    grouped = routing.selection(routing.Routing("sigmoid", None, 4, 1), p)
    assert ((grouped == -torch.inf).sum(1) == 6).all()  # 3 of 4 groups of 2 masked


def test_the_native_block_runs_every_layer_with_the_per_op_bits(glm, monkeypatch):
    """Decode: one native call for the whole stack (the dense layer's FFN, the grouped sigmoid
    routing, the unscaled shared experts) with the per-op path's bits."""
    llm = load(glm[0])
    assert stack_decode.plan_for(llm.model, RunOptions()) is not None
    native_cache, cache = llm.model.new_cache(32), llm.model.new_cache(32)
    llm.model.forward(TOKENS[:6], native_cache)
    llm.model.forward(TOKENS[:6], cache)
    stats = SparsityStats.empty(3, llm.model.args.ffn_neurons)
    routed = []
    monkeypatch.setattr(moe, "route", lambda ex, x: routed.append(1) or routing.route(ex, x))
    native = llm.model.forward(TOKENS[6:7], native_cache, RunOptions(stats=stats))
    assert not routed and stats.active.tolist()[1:] == [3 * 32] * 2  # 3 experts of 32 rows
    traced = llm.model.forward(TOKENS[6:7], cache, RunOptions(observer=lambda *a: None))
    assert routed and torch.equal(native, traced)


def test_profile_and_cut_leave_the_dense_layers_out(glm, tmp_path, capsys):
    """The leading dense layer is placed whole: profile counts only the experts' neurons, and
    the cut applies inside routed experts (0 in the dense layer)."""
    from powerpy.cli import main

    text = tmp_path / "t.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 20)
    common = ["-m", str(glm[0]), "--text", str(text), "--ctx", "64", "-t", "1"]
    argv = ["profile", *common, "--target-sparsity", "0.4", "-o", str(tmp_path / "prof")]
    assert main(argv) == 0
    counts = [torch.load(tmp_path / "prof" / f"activation_{l}.pt") for l in range(3)]
    assert all(c.shape == (8 * 32,) for c in counts)
    assert not counts[0].any() and counts[1].any() and counts[2].any()
    out = tmp_path / "cut.gguf"
    assert main(["cut", *common, "--tokens", "256", "-s", "0.4", "-o", str(out)]) == 0
    cut = load(out)
    cuts = cut.model.args.down_thresholds
    assert cuts[0] == 0 and cuts[1] > 0 and cuts[2] > 0
    blk = cut.model.weights.blk
    assert blk[0].down_tau is None and blk[1].moe.tau is not None


# ------------------------------------------------------------------------------ refusals
def _refused(tmp_path, err, match, *, spec=GLM, **kw):
    refused(tmp_path, spec, err, match, **kw)


def test_a_missing_selection_bias_or_shared_expert_is_named(tmp_path):
    _refused(
        tmp_path,
        FileFormatError,
        r"tensor 'blk\.2\.exp_probs_b\.bias' is missing",
        drop=[Names.EXP_PROBS_B.format(l=2)],
    )
    _refused(
        tmp_path,
        FileFormatError,
        r"tensor 'blk\.1\.ffn_down_shexp\.weight' is missing",
        drop=[Names.FFN_DOWN_SHEXP.format(l=1)],
    )


def test_experts_in_a_leading_dense_layer_and_a_dense_ffn_beside_experts_are_refused(tmp_path):
    def experts_in_layer_0(t):
        for name in list(t):
            if name.startswith("blk.1.ffn_") and "exps" in name:
                t[name.replace("blk.1.", "blk.0.")] = t[name]

    _refused(
        tmp_path,
        ModelConfigError,
        r"'blk\.0\.ffn_gate_exps\.weight' belongs to a mixture of experts, but layer 0 is "
        r"one of the 1 leading dense layers \(glm4moe\.leading_dense_block_count\)",
        edit=experts_in_layer_0,
    )

    def dense_in_layer_1(t):
        t["blk.1.ffn_up.weight"] = t["blk.0.ffn_up.weight"]

    _refused(
        tmp_path,
        ModelConfigError,
        r"'blk\.1\.ffn_up\.weight' is not part of a glm4moe model, whose mixture-of-experts "
        r"layers hold",
        edit=dense_in_layer_1,
    )


@pytest.mark.parametrize(
    "kv, match",
    [
        (
            {"glm4moe.expert_group_count": (3, V.UINT32)},
            r"expert_group_count 3 and glm4moe\.expert_group_used_count 2 do not fit "
            r"glm4moe\.expert_count \(8\)",
        ),
        (
            {"glm4moe.expert_group_used_count": (1, V.UINT32)},
            r"expert_used_count is 3, more than the 2 experts of the 1 groups",
        ),
        ({"glm4moe.expert_gating_func": (4, V.UINT32)}, r"expert_gating_func is 4"),
        (
            {"glm4moe.leading_dense_block_count": (4, V.UINT32)},
            r"leading_dense_block_count is 4, it must be between 0 and the 3 layers",
        ),
        ({"glm4moe.nextn_predict_layers": (4, V.UINT32)}, r"block_count is 4 with 4 NextN layers"),
        ({"glm4moe.expert_shared_count": (0, V.UINT32)}, r"expert_shared_count is 0"),
    ],
)
def test_routing_keys_that_make_no_mixture_are_refused(tmp_path, kv, match):
    _refused(tmp_path, ModelConfigError, match, extra_kv=GROUPS | kv)


def test_a_required_key_llama_cpp_needs_is_named_when_missing(tmp_path):
    path = tmp_path / "nokey.gguf"
    write_gguf_py(path, GLM, GGMLType.F32)
    from powerpy.formats.gguf_reader import read_gguf

    with read_gguf(path) as f:
        kv = dict(f.kv)
    del kv[Keys.EXPERT_SHARED_COUNT.format(arch="glm4moe")]
    from powerpy.config import ModelArgs

    with pytest.raises(ModelConfigError, match=r"required key 'glm4moe\.expert_shared_count'"):
        ModelArgs.from_gguf_kv(kv, sparse=False)
