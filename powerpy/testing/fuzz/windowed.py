"""Gemma 2, Gemma 3 and Phi-3 for the load-path fuzzer (family "arch"): their drafts and the
mutations of what these families add to a file: the sliding window and its pattern, soft-caps,
a head size of its own (``key_length``/``value_length``), RoPE scaling and the local base, the
attention scale, the post norms and q/k norms, phi3's fused ``attn_qkv`` and gate+up
``ffn_up`` and its long/short RoPE factors; and their seed cases. ``files.arch_draft`` builds
these drafts; ``cases`` registers the mutations by importing this module. See ``cases``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from powerpy.config import ModelArgs
from powerpy.formats.constants import GGMLType, Keys, Names
from powerpy.formats.constants import GGUFValueType as V
from powerpy.testing import spec_args, tiny_tensors, vocab_kv
from powerpy.testing.fuzz.files import (
    DRAFTS,
    FLOATS,
    INTS,
    MODEL_FAMILIES,
    MUTATIONS,
    SPEC,
    WINDOWED_ARCHS,
    Draft,
    Tensor,
    mutation,
    pick,
)

F32 = GGMLType.F32
HEAD = 16  # gemma's key_length, not n_embd / n_head (8)
WINDOW = 2  # the prompt and two tokens run past it
PHI3_ROT = 6  # phi3's rotary dims of its 8: partial, as Phi-4-mini's
ORIG_CTX = 64  # phi3's original context: the fuzzer's sessions are shorter (short factors)


def _archs(*names: str) -> Callable:
    def deco(fn):
        fn.archs = names
        return fn

    return deco


def windowed_draft(arch: str, sparse: bool = True, seed: int = 0) -> Draft:
    """The unmutated tiny model of ``arch`` (``WINDOWED_ARCHS``) in ``SPEC``'s dimensions:
    gemma with a head of 16, a 2-position window (gemma ignores it, as llama.cpp), soft-caps
    (gemma2; gemma ignores them too) or a local base, linear scaling and a window pattern of 2
    (gemma3); phi3 with fused tensors, 6 rotary dims, long/short factors, an original context
    and attn_factor, and a window key that it ignores; stablelm and phi2 with LayerNorm biases
    and 4 of 16 rotary dims (the window and soft-cap keys ignored). F32, with predictors when
    ``sparse``."""
    spec = dataclasses.replace(SPEC, arch=arch)
    kv = dict(spec_args(spec, sparse=sparse).to_gguf_kv(name=f"powerpy-fuzz-{arch}"))
    u32, f32 = V.UINT32, V.FLOAT32
    keys: dict[str, tuple] = {Keys.SLIDING_WINDOW: (WINDOW, u32)}
    if arch == "phi3":
        keys |= {
            Keys.ROPE_DIMENSION_COUNT: (PHI3_ROT, u32),
            Keys.ROPE_SCALING_ORIG_CTX: (ORIG_CTX, u32),
            Keys.ROPE_SCALING_ATTN_FACTOR: (1.19, f32),
        }
    else:
        keys |= {
            Keys.KEY_LENGTH: (HEAD, u32),
            Keys.VALUE_LENGTH: (HEAD, u32),
            Keys.ROPE_DIMENSION_COUNT: (HEAD, u32),
            Keys.FINAL_SOFTCAP: (30.0, f32),
        }
    if arch == "gemma2":
        keys[Keys.ATTN_SOFTCAP] = (50.0, f32)
    if arch in ("stablelm", "phi2"):  # a quarter of each head turns (StableLM 2; phi-2: 0.4)
        keys[Keys.ROPE_DIMENSION_COUNT] = (HEAD // 4, u32)
    if arch == "gemma3":
        keys |= {
            Keys.ROPE_FREQ_BASE: (1e6, f32),
            Keys.ROPE_FREQ_BASE_SWA: (1e4, f32),
            Keys.ROPE_SCALING_TYPE: ("linear", V.STRING),
            Keys.ROPE_SCALING_FACTOR: (8.0, f32),
            Keys.SLIDING_WINDOW_PATTERN: (2, u32),
        }
    kv |= {k.format(arch=arch): v for k, v in keys.items()}
    if sparse:
        kv[Keys.SPARSE_THRESHOLD] = (0.0, f32)
    kv |= vocab_kv()
    args = ModelArgs.from_gguf_kv({k: v[0] for k, v in kv.items()}, sparse=sparse)
    tensors = tiny_tensors(spec, sparse=sparse, seed=seed, args=args)
    if arch == "phi3":  # divisors of the angles, >= 1, as LongRoPE's
        tensors[Names.ROPE_FACTORS_SHORT] = np.array([1.0, 1.1, 1.5], np.float32)
        tensors[Names.ROPE_FACTORS_LONG] = np.array([1.0, 2.0, 8.0], np.float32)
    return Draft(sparse, kv, [Tensor(n, a, F32, a.shape) for n, a in tensors.items()], arch=arch)


def _typed_odd(rng: np.random.Generator, good: float) -> tuple:
    """A value of the wrong kind for a number key: a string, an array, an empty array, a bool,
    or a signed integer."""
    return pick(
        rng,
        (
            (str(good), V.STRING),
            ([good, good], V.ARRAY, V.FLOAT32),
            ([], V.ARRAY, V.FLOAT32),
            (True, V.BOOL),
            (-1, V.INT32),
            ([good], V.ARRAY, V.FLOAT32),
        ),
    )


def _number(rng: np.random.Generator, good: float, integer: bool) -> tuple:
    """An odd value for a number key: out of range, non-finite, huge, tiny, or of a wrong kind."""
    if rng.integers(4) == 0:
        return _typed_odd(rng, good)
    if integer:
        return (pick(rng, INTS), pick(rng, (V.UINT32, V.UINT64)))
    return (pick(rng, FLOATS), pick(rng, (V.FLOAT32, V.FLOAT64)))


def _set_or_drop(d: Draft, rng: np.random.Generator, template: str, good: float, integer: bool):
    key = d.key(template)
    if rng.integers(5) == 0:
        d.kv.pop(key, None)
        return f"without {key}"
    d.kv[key] = _number(rng, good, integer)
    return f"{key} = {d.kv[key][:2]!r:.60}"


DRAFTS.update(dict.fromkeys(WINDOWED_ARCHS, windowed_draft))


# --- mutations ------------------------------------------------------------------------------------
@mutation("arch")
@_archs(*WINDOWED_ARCHS)
def window(d: Draft, rng: np.random.Generator) -> str:
    """The sliding window removed, 0, 1, huge, negative, fractional or of a wrong kind (phi3's
    is ignored, as llama.cpp does)."""
    return _set_or_drop(d, rng, Keys.SLIDING_WINDOW, WINDOW, integer=True)


@mutation("arch")
@_archs("gemma2", "gemma3")
def window_pattern(d: Draft, rng: np.random.Generator) -> str:
    """The window pattern: a period (0, 1, huge, negative), flags of any length, integer or
    not, or a value of another kind."""
    key = d.key(Keys.SLIDING_WINDOW_PATTERN)
    d.kv[key] = pick(
        rng,
        (
            (0, V.UINT32),
            (1, V.UINT32),
            (3, V.UINT32),
            (2**32 - 1, V.UINT32),
            (2**40, V.UINT64),
            (-1, V.INT32),
            (1.5, V.FLOAT32),
            ("2", V.STRING),
            ([], V.ARRAY, V.BOOL),
            ([True], V.ARRAY, V.BOOL),
            ([False, True, True, False, True], V.ARRAY, V.BOOL),
            ([0, 7], V.ARRAY, V.INT32),
            ([0.5, 1.0], V.ARRAY, V.FLOAT32),
            (["1"], V.ARRAY, V.STRING),
        ),
    )
    return f"{key} = {d.kv[key][:2]!r:.60}"


@mutation("arch")
@_archs(*WINDOWED_ARCHS)
def softcaps(d: Draft, rng: np.random.Generator) -> str:
    """The attention or final soft-cap removed, 0, negative, tiny, huge, non-finite or of a
    wrong kind (gemma3 ignores the attention cap, phi3 both)."""
    template = pick(rng, (Keys.ATTN_SOFTCAP, Keys.FINAL_SOFTCAP))
    return _set_or_drop(d, rng, template, 30.0, integer=False)


@mutation("arch")
@_archs("gemma2", "gemma3")
def head_length(d: Draft, rng: np.random.Generator) -> str:
    """key_length or value_length removed, 0, odd, huge, n_embd / n_head (the tensors' rows
    disagree), negative, or the two different."""
    template = pick(rng, (Keys.KEY_LENGTH, Keys.VALUE_LENGTH))
    key = d.key(template)
    kind = int(rng.integers(4))
    if kind == 0:
        d.kv.pop(key)
        return f"without {key}"
    if kind == 1:
        d.kv[key] = (pick(rng, (SPEC.n_embd // SPEC.n_head, HEAD + 2, HEAD // 2, 7)), V.UINT32)
    else:
        d.kv[key] = _number(rng, HEAD, integer=True)
    return f"{key} = {d.kv[key][:2]!r:.60}"


@mutation("arch")
@_archs(*WINDOWED_ARCHS)
def rope_keys(d: Draft, rng: np.random.Generator) -> str:
    """RoPE scaling (type, factor, attn_factor, original context), the local base or the rotary
    dims: removed, another scaling type, odd numbers, or values of a wrong kind."""
    template, good, integer = pick(
        rng,
        (
            (Keys.ROPE_SCALING_FACTOR, 8.0, False),
            (Keys.ROPE_SCALING_ATTN_FACTOR, 1.19, False),
            (Keys.ROPE_SCALING_ORIG_CTX, ORIG_CTX, True),
            (Keys.ROPE_FREQ_BASE_SWA, 1e4, False),
            (Keys.ROPE_DIMENSION_COUNT, HEAD, True),
            (Keys.ROPE_SCALING_TYPE, 0, False),
        ),
    )
    if template == Keys.ROPE_SCALING_TYPE:
        key = d.key(template)
        d.kv[key] = pick(
            rng,
            (
                ("yarn", V.STRING),
                ("longrope", V.STRING),
                ("", V.STRING),
                ("LINEAR", V.STRING),
                ("none", V.STRING),
                (1, V.UINT32),
                (["linear"], V.ARRAY, V.STRING),
            ),
        )
        if rng.integers(2):
            d.kv[d.key(Keys.ROPE_SCALING_FACTOR)] = (pick(rng, (0.0, 2.0, 1e-30)), V.FLOAT32)
        return f"{key} = {d.kv[key][:2]!r:.60}"
    return _set_or_drop(d, rng, template, good, integer)


@mutation("arch")
@_archs(*WINDOWED_ARCHS)
def attention_scale(d: Draft, rng: np.random.Generator) -> str:
    """attention.scale of any value (these families ignore the key, as llama.cpp does)."""
    return _set_or_drop(d, rng, Keys.ATTENTION_SCALE, 0.125, integer=False)


def _vector(n: int, value: float = 1.0) -> np.ndarray:
    return np.full(n, value, np.float32)


@mutation("arch")
@_archs("gemma2", "gemma3")
def gemma_norms(d: Draft, rng: np.random.Generator) -> str:
    """A post norm or a q/k norm missing, of another length, 2-D, non-finite; q/k norms in a
    gemma2 file or attn_norm_2 in a gemma3 one (not their layout); an output matrix (gemma2 has
    none, gemma3 may)."""
    l = int(rng.integers(SPEC.n_layer))
    names = [Names.POST_ATTN_NORM, Names.POST_FFW_NORM]
    if d.arch == "gemma3":
        names += [Names.ATTN_Q_NORM, Names.ATTN_K_NORM]
    kind = pick(rng, ("drop", "length", "2d", "values", "foreign", "output"))
    if kind == "output":
        a = np.zeros((len(d.tensor(Names.TOKEN_EMBD).data), SPEC.n_embd), np.float32)
        d.tensors.append(Tensor(Names.OUTPUT, a, F32, a.shape))
        return f"{Names.OUTPUT} added"
    if kind == "foreign":  # gemma2 has no q/k norms; attn_norm_2 is falcon's
        name, n = (
            (Names.ATTN_Q_NORM, HEAD) if d.arch == "gemma2" else (Names.ATTN_NORM_2, SPEC.n_embd)
        )
        d.tensors.append(Tensor(name.format(l=l), _vector(n), F32, (n,)))
        return f"{name.format(l=l)} added"
    t = d.tensor(pick(rng, names).format(l=l))
    if kind == "drop":
        d.tensors.remove(t)
        return f"without {t.name}"
    n = len(t.data)
    if kind == "length":
        a = _vector(pick(rng, (n - 1, n + 1, SPEC.n_embd if n == HEAD else HEAD, 1)))
    elif kind == "2d":
        a = np.ones((2, n), np.float32)
    else:
        a = _vector(n, pick(rng, (math.nan, math.inf, 0.0, 3e38)))
    t.data, t.shape, t.ggml_type = a, a.shape, F32
    return f"{t.name} {kind} {t.shape}"


@mutation("arch")
@_archs("phi3")
def phi3_tensors(d: Draft, rng: np.random.Generator) -> str:
    """The fused ffn_up or attn_qkv of another height; attn_q beside the fused attn_qkv (both
    layouts) or a gate beside the fused ffn_up; attn_qkv split into attn_q/k/v (the other
    layout llama.cpp loads), whole or with a part dropped; a RoPE factor table missing, of
    another length, 2-D, zero, negative or non-finite."""
    l = int(rng.integers(SPEC.n_layer))
    kind = pick(rng, ("up", "qkv", "foreign", "split", "factors", "factors"))
    d_, ff = SPEC.n_embd, SPEC.n_ff
    if kind == "split":
        t = d.tensor(Names.ATTN_QKV.format(l=l))
        n_kv = (t.shape[0] - d_) // 2
        rows = np.asarray(t.data).reshape(t.shape[0], -1)
        parts = zip(
            (Names.ATTN_Q, Names.ATTN_K, Names.ATTN_V),
            (0, d_, d_ + n_kv),
            (d_, d_ + n_kv, t.shape[0]),
            strict=True,
        )
        i = d.tensors.index(t)
        d.tensors[i : i + 1] = [
            Tensor(n.format(l=l), np.ascontiguousarray(rows[a:b]), t.ggml_type, (b - a, d_))
            for n, a, b in parts
        ]
        drop = pick(rng, (None, None, 0, 1, 2))
        if drop is not None:
            del d.tensors[i + drop]
        return f"{t.name} split{'' if drop is None else f', part {drop} dropped'}"
    if kind in ("up", "qkv"):
        t = d.tensor((Names.FFN_UP if kind == "up" else Names.ATTN_QKV).format(l=l))
        rows = pick(
            rng,
            (ff, 2 * ff - 1, 2 * ff + 1, 3 * ff)
            if kind == "up"
            else (d_, 3 * d_, t.shape[0] - 1, t.shape[0] + 8),
        )
        a = np.zeros((rows, d_), np.float32)
        t.data, t.shape = a, a.shape
        return f"{t.name} has {rows} rows"
    if kind == "foreign":
        name = pick(rng, (Names.ATTN_Q, Names.FFN_GATE)).format(l=l)
        a = np.zeros((ff if "gate" in name else d_, d_), np.float32)
        d.tensors.append(Tensor(name, a, F32, a.shape))
        return f"{name} added"
    t = d.tensor(pick(rng, (Names.ROPE_FACTORS_LONG, Names.ROPE_FACTORS_SHORT)))
    how = pick(rng, ("drop", "length", "2d", "zero", "negative", "nan"))
    if how == "drop":
        d.tensors.remove(t)
        return f"without {t.name}"
    a = {
        "length": _vector(PHI3_ROT),
        "2d": np.ones((2, PHI3_ROT // 2), np.float32),
        "zero": _vector(3, 0.0),
        "negative": _vector(3, -1.0),
        "nan": _vector(3, math.nan),
    }[how]
    t.data, t.shape = a, a.shape
    return f"{t.name} {how} {t.shape}"


@mutation("arch")
@_archs(*WINDOWED_ARCHS)
def windowed_generic(d: Draft, rng: np.random.Generator) -> str:
    """Any mutation of the model file's families (kv, hparams, tensors, ...) on these files."""
    name = pick(rng, [m for m, (f, _) in MUTATIONS.items() if f in MODEL_FAMILIES])
    try:
        return f"{name}: {MUTATIONS[name][1](d, rng)}"
    except (StopIteration, ValueError, KeyError, IndexError, TypeError, OverflowError):
        return f"{name} (not applicable)"


# --- seed cases -----------------------------------------------------------------------------------
def _key(template: str, *value) -> Callable[[Draft], None]:
    def fn(d: Draft) -> None:
        d.kv[d.key(template)] = value

    return fn


def _drop(name: str) -> Callable[[Draft], None]:
    def fn(d: Draft) -> None:
        d.tensors.remove(d.tensor(name))

    return fn


def _rows(name: str, rows: int) -> Callable[[Draft], None]:
    def fn(d: Draft) -> None:
        t = d.tensor(name)
        t.data = np.zeros((rows, SPEC.n_embd), np.float32)
        t.shape = t.data.shape

    return fn


def _vec(name: str, a: np.ndarray) -> Callable[[Draft], None]:
    def fn(d: Draft) -> None:
        t = d.tensor(name)
        t.data, t.shape = a, a.shape

    return fn


def _add(name: str, a: np.ndarray) -> Callable[[Draft], None]:
    return lambda d: d.tensors.append(Tensor(name, a, F32, a.shape))


def _add_output(d: Draft) -> None:
    a = np.zeros((len(d.tensor(Names.TOKEN_EMBD).data), SPEC.n_embd), np.float32)
    d.tensors.append(Tensor(Names.OUTPUT, a, F32, a.shape))


# name -> (arch, fn); the messages they must give are in tests/test_fuzz_path.py
_SEEDS: dict[str, tuple[str, Callable[[Draft], None]]] = {
    "phi3_ffn_up_rows": ("phi3", _rows("blk.0.ffn_up.weight", SPEC.n_ff)),
    "phi3_qkv_rows": ("phi3", _rows("blk.1.attn_qkv.weight", 3 * SPEC.n_embd)),
    "phi3_rope_factors_zero": ("phi3", _vec(Names.ROPE_FACTORS_LONG, _vector(3, 0.0))),
    "stablelm_12b_q_norm": (
        "stablelm",
        _add("blk.0.attn_q_norm.weight", np.ones((4, HEAD), np.float32)),
    ),
    "phi2_no_output_bias": ("phi2", _drop("output.bias")),
    "gemma_post_norm": ("gemma", _add("blk.0.post_ffw_norm.weight", _vector(SPEC.n_embd))),
    "gemma_output": ("gemma", _add_output),
    "gemma2_no_post_ffw_norm": ("gemma2", _drop("blk.1.post_ffw_norm.weight")),
    "gemma2_output": ("gemma2", _add_output),
    "gemma2_softcap_nan": ("gemma2", _key(Keys.ATTN_SOFTCAP, math.nan, V.FLOAT32)),
    "gemma2_pattern_string": ("gemma2", _key(Keys.SLIDING_WINDOW_PATTERN, "2", V.STRING)),
    "gemma3_q_norm_size": ("gemma3", _vec("blk.0.attn_q_norm.weight", _vector(SPEC.n_embd))),
    "gemma3_key_length_mismatch": ("gemma3", _key(Keys.VALUE_LENGTH, 8, V.UINT32)),
    "gemma3_rope_longrope": ("gemma3", _key(Keys.ROPE_SCALING_TYPE, "longrope", V.STRING)),
}
WINDOWED_SEED_CASES = {name: ("arch", fn) for name, (_, fn) in _SEEDS.items()}
WINDOWED_SEED_ARCHS = {name: (arch, 0) for name, (arch, _) in _SEEDS.items()}
