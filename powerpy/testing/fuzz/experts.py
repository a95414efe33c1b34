"""Mutations of mixture-of-experts files for the load-path fuzzer (family "moe"), and their
seed cases: what a MoE file adds (expert counts and widths, the router, the expert stacks, the
routing weights' keys) and what it must not have (a dense FFN beside the experts, experts
without a count, a PWRI magic), and a shared expert's tensors and width (qwen2moe). Drafts are
tiny Mixtral-style llama, qwen3moe and qwen2moe files (``moe_draft``), F32 or with Q8_0 expert
stacks. See ``cases``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from powerpy.formats import quants
from powerpy.formats.constants import GGMLType, Keys, Names
from powerpy.formats.constants import GGUFValueType as V
from powerpy.testing import TinySpec, tiny_tensors, vocab_kv
from powerpy.testing.fuzz.files import (
    FLOATS,
    INTS,
    MODEL_FAMILIES,
    MUTATIONS,
    SIGNED,
    Draft,
    Tensor,
    mutation,
    pick,
)
from powerpy.testing.tiny import spec_args

MOE_ARCHS = ("llama", "qwen3moe", "qwen2moe", "glm4moe", "deepseek2", "gpt-oss")
MOE_SPECS = {
    "llama": TinySpec(
        n_embd=32, n_layer=2, n_ff=64, n_head=4, n_head_kv=2, n_expert=4, n_expert_used=2
    ),
    "qwen3moe": TinySpec(
        n_embd=32,
        n_layer=2,
        n_ff=64,
        n_head=4,
        n_head_kv=2,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=32,
        arch="qwen3moe",
    ),
    "qwen2moe": TinySpec(
        n_embd=32,
        n_layer=2,
        n_ff=64,
        n_head=4,
        n_head_kv=2,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=32,
        n_ff_shexp=48,
        arch="qwen2moe",
    ),
    # a leading dense layer, then two MoE layers, and a NextN layer
    "glm4moe": TinySpec(
        n_embd=32,
        n_layer=3,
        n_ff=64,
        n_head=4,
        n_head_kv=2,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=32,
        arch="glm4moe",
        n_layer_dense=1,
        n_nextn=1,
        n_rot=4,
        biases=True,
    ),
    # the latent attention (q's low rank, attn_k_b/attn_v_b), a leading dense layer
    "deepseek2": TinySpec(
        n_embd=32,
        n_layer=3,
        n_ff=64,
        n_head=2,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=32,
        arch="deepseek2",
        n_layer_dense=1,
        n_rot=8,
        q_lora_rank=16,
        kv_lora_rank=16,
        key_length_mla=24,
        value_length_mla=16,
    ),
    # biases on attention and experts, sinks, a window of 4 on layer 0, q wider than n_embd
    "gpt-oss": TinySpec(
        n_embd=32,
        n_layer=2,
        n_ff=64,
        n_head=4,
        n_head_kv=2,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=32,
        arch="gpt-oss",
        sliding_window=4,
        key_length=16,
    ),
}
SHARED = (Names.FFN_GATE_INP_SHEXP, Names.FFN_GATE_SHEXP, Names.FFN_UP_SHEXP, Names.FFN_DOWN_SHEXP)
STACKS = (Names.FFN_GATE_EXPS, Names.FFN_UP_EXPS, Names.FFN_DOWN_EXPS)
F32, Q8_0 = GGMLType.F32, GGMLType.Q8_0


def moe_draft(arch: str, seed: int = 0, *, quantized: bool = False) -> Draft:
    """The unmutated tiny MoE model of ``arch`` (a dense GGUF; 4 experts, 2 routed), F32, or
    with quantized expert stacks (Q8_0; gpt-oss: MXFP4, as its files ship them)."""
    spec = MOE_SPECS[arch]
    kv = spec_args(spec, sparse=False).to_gguf_kv(name=f"powerpy-fuzz-{arch}-moe") | vocab_kv()
    qtype = GGMLType.MXFP4 if arch == "gpt-oss" else Q8_0
    tensors = []
    for name, a in tiny_tensors(spec, sparse=False, seed=seed).items():
        if quantized and any(name.endswith(s[7:]) for s in STACKS):
            tensors.append(Tensor(name, quants.quantize(a, qtype), qtype, a.shape))
        else:
            tensors.append(Tensor(name, a, F32, a.shape))
    return Draft(False, dict(kv), tensors, arch=arch)


def moe_archs(*names: str) -> Callable:
    """Mark a mutation as one of the MoE families ``names`` (its draft is ``moe_draft``)."""

    def deco(fn):
        fn.moe_archs = names
        return fn

    return deco


def _layer(rng: np.random.Generator, d: Draft) -> int:
    """One of the draft's two mixture-of-experts layers (after its leading dense ones)."""
    return int(rng.integers(2)) + MOE_SPECS[d.arch].n_layer_dense


def put_key(d: Draft, key: str, spec: tuple | None) -> str:
    """The draft's key ``key`` (a template of its arch) set to ``spec``, or removed (None);
    returns the mutation's description."""
    short = key.split(".")[-1]
    if spec is None:
        d.kv.pop(d.key(key), None)
        return f"no {short}"
    d.kv[d.key(key)] = spec
    return f"{short} = {spec[0]!r}"


def _set(t: Tensor, a: np.ndarray) -> None:
    t.data, t.shape, t.ggml_type, t.type_id = np.ascontiguousarray(a), a.shape, F32, None


def _f32(t: Tensor) -> np.ndarray:
    """The tensor's values as f32 (a quantized stack decoded)."""
    if t.ggml_type == F32:
        return np.asarray(t.data)
    return quants.dequantize(t.data, t.ggml_type, t.shape)


# --- mutations ------------------------------------------------------------------------------------
@mutation("moe")
@moe_archs(*MOE_ARCHS)
def expert_count(d: Draft, rng: np.random.Generator) -> str:
    """expert_count 0, 1, one more or less, huge, negative, or not an integer."""
    n = MOE_SPECS[d.arch].n_expert
    spec = pick(
        rng,
        [(v, V.UINT32) for v in (0, 1, n - 1, n + 1, 2 * n)]
        + [
            (pick(rng, INTS), V.UINT64),
            (pick(rng, SIGNED), V.INT32),
            ("4", V.STRING),
            (4.0, V.FLOAT32),
            ([4, 4], V.ARRAY, V.INT32),
            (True, V.BOOL),
        ],
    )
    d.kv[d.key(Keys.EXPERT_COUNT)] = spec
    return f"expert_count = {spec[0]!r}"


@mutation("moe")
@moe_archs(*MOE_ARCHS)
def expert_used_count(d: Draft, rng: np.random.Generator) -> str:
    """expert_used_count 0, all, more than the experts, huge, negative, or gone."""
    key = d.key(Keys.EXPERT_USED_COUNT)
    choice = int(rng.integers(6))
    if choice == 0:
        del d.kv[key]
        return "no expert_used_count"
    spec = pick(
        rng,
        [
            (0, V.UINT32),
            (4, V.UINT32),
            (5, V.UINT32),
            (pick(rng, INTS), V.UINT64),
            (pick(rng, SIGNED), V.INT32),
            (2.5, V.FLOAT32),
        ],
    )
    d.kv[key] = spec
    return f"expert_used_count = {spec[0]!r}"


@mutation("moe")
@moe_archs(*MOE_ARCHS)
def stack_shape(d: Draft, rng: np.random.Generator) -> str:
    """An expert stack (or the router) transposed, an expert more or less, rows or columns cut."""
    l = _layer(rng, d)
    name = pick(rng, (*STACKS, Names.FFN_GATE_INP)).format(l=l)
    t = d.tensor(name)
    a = _f32(t)
    how = int(rng.integers(4))
    if how == 0 and a.ndim == 3:
        b = a.transpose(0, 2, 1)
    elif how == 1:
        b = np.concatenate([a, a[:1]], axis=0)  # one expert (router row) more
    elif how == 2:
        b = a[:-1]
    else:
        b = a[..., : a.shape[-1] // 2] if a.ndim == 2 else a[:, : a.shape[1] // 2]
    _set(t, b)
    return f"{name} {a.shape} -> {b.shape}"


@mutation("moe")
@moe_archs(*MOE_ARCHS)
def stack_missing(d: Draft, rng: np.random.Generator) -> str:
    """An expert stack or the router of a layer removed."""
    name = pick(rng, (*STACKS, Names.FFN_GATE_INP)).format(l=_layer(rng, d))
    d.tensors.remove(d.tensor(name))
    return f"no {name}"


@mutation("moe")
@moe_archs(*MOE_ARCHS)
def stack_type(d: Draft, rng: np.random.Generator) -> str:
    """An expert stack's type label changed under its data (F32 bytes labelled Q8_0 or F16),
    or its values NaN or huge."""
    t = d.tensor(pick(rng, STACKS).format(l=_layer(rng, d)))
    if rng.integers(2):
        t.ggml_type = pick(rng, (GGMLType.Q8_0, GGMLType.F16, GGMLType.Q4_0))
        d.raw = True
        return f"{t.name} labelled {t.ggml_type.name}"
    a = _f32(t).copy()
    a.flat[int(rng.integers(a.size))] = pick(rng, (np.nan, 1e30, -np.inf))
    _set(t, a)
    return f"{t.name} holds a non-finite or huge value"


@mutation("moe")
@moe_archs(*MOE_ARCHS)
def routing_keys(d: Draft, rng: np.random.Generator) -> str:
    """expert_weights_norm not a BOOL, expert_weights_scale odd, or (qwen3moe) another
    expert_feed_forward_length."""
    which = int(rng.integers(3 if d.arch == "qwen3moe" else 2))
    if which == 0:
        spec = pick(rng, [(False, V.BOOL), (1, V.UINT32), ("yes", V.STRING)])
        d.kv[d.key(Keys.EXPERT_WEIGHTS_NORM)] = spec
    elif which == 1:
        spec = (pick(rng, FLOATS), V.FLOAT32)
        d.kv[d.key(Keys.EXPERT_WEIGHTS_SCALE)] = spec
    else:
        widths = [(0, V.UINT32), (64, V.UINT32), (16, V.UINT32), (pick(rng, INTS), V.UINT64)]
        spec = pick(rng, widths)
        d.kv[d.key(Keys.EXPERT_FEED_FORWARD_LENGTH)] = spec
    return f"routing key {which} = {spec[0]!r}"


@mutation("moe")
@moe_archs("qwen2moe")
def shared_expert(d: Draft, rng: np.random.Generator) -> str:
    """A shared expert's tensor missing, transposed, cut or as a (1, n) row; its width key 0,
    another width, huge or gone; or its gate row non-finite."""
    name = pick(rng, SHARED).format(l=_layer(rng, d))
    t = d.tensor(name)
    a = _f32(t)
    how = int(rng.integers(5))
    if how == 0:
        d.tensors.remove(t)
        return f"no {name}"
    if how == 1:
        b = a.T if a.ndim == 2 else a[None]  # a (1, n) gate row is llama.cpp's too: it loads
        _set(t, np.ascontiguousarray(b))
        return f"{name} {a.shape} -> {b.shape}"
    if how == 2:
        b = a[: max(a.shape[0] // 2, 1)]
        _set(t, b)
        return f"{name} {a.shape} -> {b.shape}"
    if how == 3:
        key = d.key(Keys.EXPERT_SHARED_FEED_FORWARD_LENGTH)
        spec = pick(rng, [(0, V.UINT32), (96, V.UINT32), (pick(rng, INTS), V.UINT64), None])
        if spec is None:
            d.kv.pop(key, None)  # then feed_forward_length (64), as llama.cpp: a shape error
            return "no expert_shared_feed_forward_length"
        d.kv[key] = spec
        return f"expert_shared_feed_forward_length = {spec[0]!r}"
    b = a.copy()
    b.flat[int(rng.integers(b.size))] = pick(rng, (np.nan, np.inf))
    _set(t, b)
    return f"{name} holds a non-finite value"


@mutation("moe")
@moe_archs(*MOE_ARCHS)
def foreign_ffn(d: Draft, rng: np.random.Generator) -> str:
    """A dense FFN beside the experts, expert stacks without expert_count, or a PWRI magic."""
    which = int(rng.integers(3))
    if which == 0:
        a = np.zeros((64, 32), np.float32)
        d.tensors.append(Tensor(Names.FFN_UP.format(l=_layer(rng, d)), a, F32, a.shape))
        return "a dense ffn_up beside the experts"
    if which == 1:
        del d.kv[d.key(Keys.EXPERT_COUNT)]
        return "no expert_count"
    d.sparse = True
    return "PWRI magic"


@mutation("moe")
@moe_archs(*MOE_ARCHS)
def generic(d: Draft, rng: np.random.Generator) -> str:
    """Any mutation of the model file's families (kv, hparams, tensors, ...) on a MoE file."""
    name = pick(rng, [m for m, (f, _) in MUTATIONS.items() if f in MODEL_FAMILIES])
    try:
        return f"{name}: {MUTATIONS[name][1](d, rng)}"
    except (StopIteration, ValueError, KeyError, IndexError, TypeError, OverflowError):
        return f"{name} (not applicable)"


@mutation("moe")
@moe_archs(*MOE_ARCHS)
def placed(d: Draft, rng: np.random.Generator) -> str:
    """The unmutated file placed on the emulated device under a random budget."""
    d.load = {"vram_budget": pick(rng, (0.0, 0.00005, 0.0002, 0.001, 1.0)), "device": "cpu"}
    return f"placed under {d.load['vram_budget']} GiB"


# --- seed cases -----------------------------------------------------------------------------------
def set_key(template: str, spec: tuple) -> Callable[[Draft], None]:
    """A seed edit: the draft's key ``template`` (of its arch) set to ``spec``."""

    def fn(d: Draft) -> None:
        d.kv[d.key(template)] = spec

    return fn


def _transpose_down(d: Draft) -> None:
    t = d.tensor(Names.FFN_DOWN_EXPS.format(l=1))
    _set(t, _f32(t).transpose(0, 2, 1))


def drop_tensor(name: str) -> Callable[[Draft], None]:
    """A seed edit: the draft's tensor ``name`` removed."""
    return lambda d: d.tensors.remove(d.tensor(name))


# name -> (arch, fn); messages in tests/test_moe.py
_MOE_SEEDS: dict[str, tuple[str, Callable[[Draft], None]]] = {
    "moe_used_over_count": ("llama", set_key(Keys.EXPERT_USED_COUNT, (5, V.UINT32))),
    "moe_count_too_small": ("llama", set_key(Keys.EXPERT_COUNT, (3, V.UINT32))),
    "moe_down_transposed": ("llama", _transpose_down),
    "moe_gate_missing": ("qwen3moe", drop_tensor(Names.FFN_GATE_EXPS.format(l=0))),
    "moe_without_count": ("llama", lambda d: d.kv.pop(d.key(Keys.EXPERT_COUNT))),
    "moe_norm_not_bool": ("qwen3moe", set_key(Keys.EXPERT_WEIGHTS_NORM, (1, V.UINT32))),
    "moe_shared_width_zero": (
        "qwen2moe",
        set_key(Keys.EXPERT_SHARED_FEED_FORWARD_LENGTH, (0, V.UINT32)),
    ),
    "moe_shared_down_missing": ("qwen2moe", drop_tensor(Names.FFN_DOWN_SHEXP.format(l=1))),
}
MOE_SEED_CASES = {name: ("moe", fn) for name, (_, fn) in _MOE_SEEDS.items()}
SEED_MOE_ARCHS = {name: arch for name, (arch, _) in _MOE_SEEDS.items()}
