"""The native decode blocks run every family's layout (``powerpy/model/layer_record.py``,
``csrc/blocks.h``): for tiny random models of each family, a decode step through the whole
stack in one call (``stack_decode``), through two calls per layer, and through the per-op path
give the same logits, dense and sparse, with a cut, in several weight types.

Under llama.cpp's numerics (the default) the three paths take the same C steps in the same
order (ggml's RMSNorm and LayerNorm, NEOX or adjacent RoPE, GELU table, f16 attention with the
model's scale, soft-cap and window), so the logits are equal bit for bit. With exact activations
the per-op path runs torch's LayerNorm, RoPE, attention and erf GELU while the blocks keep their
C steps: there the paths agree to 1e-5 of the logit spread (the stack and the per-layer calls
still bit for bit).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from powerpy.api import load
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys, Names, bias_name
from powerpy.formats.gguf_writer import write_gguf
from powerpy.model import kernels, stack_decode, transformer
from powerpy.model.numerics import Numerics
from powerpy.model.options import RunOptions
from powerpy.testing import TinySpec, tiny
from powerpy.testing.tiny import encode_array, vocab_kv

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")

TOKENS = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
N_PROMPT = 3
BASE = dict(n_embd=64, n_layer=2, n_ff=256, n_head=4, n_head_kv=2)
# name: (spec, ModelArgs changes, extra tensors); every layout option appears in some case
CASES = {
    "llama": (TinySpec(**BASE), {}, None),
    "qwen2": (TinySpec(arch="qwen2", **BASE), {}, None),  # q/k/v biases, NEOX RoPE
    "qwen2-partial-rope": (TinySpec(arch="qwen2", **BASE), {"n_rot": 8}, None),
    "qwen3": (TinySpec(arch="qwen3", **BASE), {}, None),  # q/k head norms
    "phi3": (TinySpec(arch="phi3", **BASE), {}, None),  # fused qkv and gate+up
    # key_length 32 (not 64 / 4), window 4 on layer 0, soft-caps, post norms, GeGLU
    "gemma2": (
        TinySpec(arch="gemma2", **BASE),
        {
            "key_length": 32,
            "n_rot": 32,
            "sliding_window": 4,
            "swa_layers": (0,),
            "attn_softcap": 2.0,
            "final_softcap": 30.0,
        },
        None,
    ),
    # gemma2-27B's scale: 1/sqrt(n_embd / n_head) (46 layers), not 1/sqrt(key_length)
    "gemma2-27b": (
        TinySpec(arch="gemma2", **{**BASE, "n_layer": 46}),
        {"key_length": 32, "n_rot": 32},
        None,
    ),
    # six layers: five windowed with the local RoPE base, one global with the file's
    "gemma3": (
        TinySpec(arch="gemma3", **{**BASE, "n_layer": 6}, rope_base=1e6),
        {
            "key_length": 32,
            "n_rot": 32,
            "sliding_window": 3,
            "swa_layers": (0, 1, 2, 3, 4),
            "rope_base_swa": 1e4,
        },
        None,
    ),
    "falcon-7b": (TinySpec(arch="falcon", **{**BASE, "n_head_kv": 1}), {}, "no_norm_2"),
    "falcon-40b": (TinySpec(arch="falcon", **BASE), {}, "biases"),  # attn_norm_2, all biases
    "opt": (TinySpec(arch="opt", **{**BASE, "n_head_kv": 4}, tied=True), {}, None),
}
QUICK = ("llama", "gemma2", "falcon-40b", "opt")  # the other weight types


def write_case(path, name: str, *, sparse: bool, dtype=GGMLType.Q8_0, kv: dict | None = None):
    """A tiny random model of case ``name`` (``CASES``), 2-D tensors in ``dtype``."""
    spec, changes, extra = CASES[name]
    args = dataclasses.replace(tiny.spec_args(spec, sparse=sparse), **changes)
    mp = pytest.MonkeyPatch()
    mp.setattr(tiny, "spec_args", lambda *a, **k: args)  # tensors of these dimensions
    try:
        t = tiny.tiny_tensors(spec, sparse=sparse, seed=5)
    finally:
        mp.undo()
    rng = np.random.default_rng(1)
    for l in range(spec.n_layer):
        if extra == "no_norm_2":  # falcon-7B: one norm feeds attention and the MLP
            del t[Names.ATTN_NORM_2.format(l=l)], t[bias_name(Names.ATTN_NORM_2.format(l=l))]
        if extra == "biases":  # falcon's optional matrix biases
            down = (Names.FFN_DOWN_T if sparse else Names.FFN_DOWN).format(l=l)
            for n in (
                Names.ATTN_QKV.format(l=l),
                Names.ATTN_OUTPUT.format(l=l),
                Names.FFN_UP.format(l=l),
                down,
            ):
                rows = t[n].shape[1] if n == down and sparse else t[n].shape[0]
                t[bias_name(n)] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
    out = []
    for n, a in t.items():
        ty = dtype if a.ndim == 2 else GGMLType.F32
        out.append((n, encode_array(a, ty), ty))
    keys = vocab_kv() | args.to_gguf_kv(name=name) | (kv or {})
    write_gguf(path, keys, out, magic=b"PWRI" if sparse else b"GGUF")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(case, dtype, sparse) -> path, written on first use."""
    root, made = tmp_path_factory.mktemp("native"), {}

    def get(name: str, sparse: bool, dtype=GGMLType.Q8_0, kv: dict | None = None, tag=""):
        key = (name, dtype, sparse, tag)
        if key not in made:
            path = root / f"{name}-{dtype.name}-{int(sparse)}{tag}.gguf"
            made[key] = write_case(path, name, sparse=sparse, dtype=dtype, kv=kv)
        return made[key]

    return get


def decode(llm, path_kind: str, monkeypatch, opts: RunOptions, cache_dtype=torch.float16):
    """Logits of a prompt then one token at a time, by ``path_kind``: "stack" (one native call
    per token), "layers" (two per layer) or "perop"; and how many native block calls ran."""
    calls = {"attn": 0, "ffn": 0}
    with monkeypatch.context() as mp:
        if path_kind != "stack":
            mp.setattr(stack_decode, "plan_for", lambda *a: None)
        if path_kind == "perop":
            mp.setattr(transformer, "fused_decode", lambda *a, **k: None)
            mp.setattr(transformer, "attention_block", lambda *a, **k: None)
        else:
            for name, key in (("fused_decode", "ffn"), ("attention_block", "attn")):
                fn = getattr(transformer, name)

                def counted(*a, _fn=fn, _key=key, **k):
                    out = _fn(*a, **k)
                    calls[_key] += out is not None
                    return out

                mp.setattr(transformer, name, counted)
        cache = llm.model.new_cache(32, dtype=cache_dtype)
        rows = [llm.model.forward(torch.tensor(TOKENS[:N_PROMPT]), cache, opts)]
        rows += [llm.model.forward(torch.tensor([t]), cache, opts) for t in TOKENS[N_PROMPT:]]
    return torch.cat(rows).numpy(), calls


def three_paths(llm, monkeypatch, opts: RunOptions, cache_dtype=torch.float16):
    """The logits of the three paths, checking that the native ones ran natively."""
    model, n = llm.model, llm.model.args.n_layer
    plan = stack_decode.plan_for(model, model._options(opts))
    assert plan is not None and plan.first == 0  # every layer in the one-call plan
    out = {}
    for kind in ("stack", "layers", "perop"):
        out[kind], calls = decode(llm, kind, monkeypatch, opts, cache_dtype)
        steps = len(TOKENS) - N_PROMPT
        if kind == "layers":
            assert calls == {"attn": n * steps, "ffn": n * steps}, calls
    return out


def rel_to_spread(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| per row over the row's logit spread (max - min of b), the worst row."""
    return float((np.abs(a - b).max(1) / (b.max(1) - b.min(1))).max())


@pytest.mark.parametrize("mode", ["dense-file", "sparse", "sparse-file-dense"])
@pytest.mark.parametrize("name", list(CASES))
def test_native_blocks_equal_the_per_op_path_bit_for_bit(files, monkeypatch, name, mode):
    llm = load(files(name, sparse=mode != "dense-file"), threshold=0.0)
    opts = RunOptions(sparse=mode == "sparse", threshold=0.0)
    assert all(blk.native for blk in llm.model.weights.blk)
    out = three_paths(llm, monkeypatch, opts)
    np.testing.assert_array_equal(out["stack"], out["layers"])
    np.testing.assert_array_equal(out["stack"], out["perop"])
    assert np.isfinite(out["stack"]).all() and np.ptp(out["stack"]) > 0


@pytest.mark.parametrize("name", list(CASES))
def test_exact_activations_agree_within_1e5_of_the_spread(files, monkeypatch, name):
    """Torch's LayerNorm, RoPE, attention and erf GELU on the per-op path, the blocks' C: within
    1e-5 of the logit spread with an f32 cache, 1e-3 with an f16 one."""
    llm = load(files(name, sparse=True), threshold=0.0)
    exact = Numerics(quantized_activations=False)
    # an f16 cache rounds k and v: a last-bit difference of f32 can move a value by one f16
    # step; over 46 random layers (gemma2-27b) such steps grow chaotically, so f32 only there
    caches = ((torch.float32, 1e-5), (torch.float16, 1e-3))
    for cache, tol in caches[: 1 if CASES[name][0].n_layer > 6 else 2]:
        out = three_paths(llm, monkeypatch, RunOptions(threshold=0.0, numerics=exact), cache)
        np.testing.assert_array_equal(out["stack"], out["layers"])
        rel = rel_to_spread(out["stack"], out["perop"])
        print(f"{name} exact, {cache}: {rel:.2e} of the spread")
        assert rel <= tol, (name, cache, rel)


@pytest.mark.parametrize("name", list(CASES))
def test_a_threshold_of_minus_inf_equals_dense(files, monkeypatch, name):
    llm = load(files(name, sparse=True))
    every = three_paths(llm, monkeypatch, RunOptions(threshold=-np.inf))["stack"]
    dense = three_paths(llm, monkeypatch, RunOptions(sparse=False))["stack"]
    np.testing.assert_array_equal(every, dense)


@pytest.mark.parametrize("name", QUICK + ("gemma3", "qwen3"))
def test_the_cut_runs_natively_and_counts_alike(files, monkeypatch, name):
    """A cut (powerpy.ffn_down_threshold) drops rows in the native blocks as on the per-op path:
    the same logits and the same statistics, fewer rows than the predictor keeps."""
    n_layer = CASES[name][0].n_layer
    kv = {Keys.FFN_DOWN_THRESHOLD: ([0.3] * n_layer, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)}
    cut, plain = files(name, True, kv=kv, tag="-cut"), files(name, True)
    fractions = {}
    for kind in ("stack", "layers", "perop"):
        llm = load(cut, threshold=0.0)
        llm.sparsity.reset()
        fractions[kind] = (
            decode(llm, kind, monkeypatch, llm.options)[0],
            llm.sparsity.active_fraction().copy(),
        )
    for kind in ("layers", "perop"):
        np.testing.assert_array_equal(fractions["stack"][0], fractions[kind][0])
        np.testing.assert_array_equal(fractions["stack"][1], fractions[kind][1])
    ref = load(plain, threshold=0.0)
    ref.sparsity.reset()
    decode(ref, "stack", monkeypatch, ref.options)
    kept, active = fractions["stack"][1], ref.sparsity.active_fraction()
    assert np.all(kept < active) and np.all(kept > 0), (kept, active)


@pytest.mark.parametrize("dtype", [GGMLType.F32, GGMLType.F16, GGMLType.Q4_0])
@pytest.mark.parametrize("name", QUICK)
def test_other_weight_types_agree_bit_for_bit(files, monkeypatch, name, dtype):
    llm = load(files(name, sparse=True, dtype=dtype), threshold=0.0)
    out = three_paths(llm, monkeypatch, RunOptions(threshold=0.0))
    np.testing.assert_array_equal(out["stack"], out["layers"])
    np.testing.assert_array_equal(out["stack"], out["perop"])


def test_the_layouts_are_what_the_cases_claim(files):
    """The fixtures exercise what they are named for (a guard against a silent default)."""
    g2 = load(files("gemma2", sparse=False)).model
    assert g2.args.head_dim == 32 != g2.args.n_embd // g2.args.n_head
    assert g2.args.swa_layers == (0,) and g2.args.attn_softcap == 2.0
    g3 = load(files("gemma3", sparse=False)).model
    assert g3.args.swa_layers == (0, 1, 2, 3, 4) and g3.args.rope_base_swa == 1e4
    f40, f7 = (
        load(files(n, sparse=False)).model.weights.blk[0] for n in ("falcon-40b", "falcon-7b")
    )
    assert f40.attn_norm_2 is not None and f7.attn_norm_2 is None
    assert (
        f40.ffn_down_b is not None and f40.ffn_up.bias is not None and f40.attn_q.bias is not None
    )
    q = load(files("qwen2-partial-rope", sparse=False)).model.args
    assert q.n_rot == 8 < q.head_dim
    assert load(files("gemma2-27b", sparse=False)).model.args.attn_scale == 0.25  # 16 ** -0.5
    assert load(files("phi3", sparse=False)).model.args.family.scale_q  # q scaled before q·k
