"""Mutations of Falcon and OPT files for the load-path fuzzer (family "arch"), and their seed
cases: what these families add to a file (the fused attn_qkv, attn_norm_2, biases, learned
positions, the LayerNorm epsilon) and what they must not have (ffn_gate). Each mutation says
which architectures it applies to (``fn.archs``); ``cases.prepare`` builds that family's draft
(``files.arch_draft``) before calling it. See ``cases``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from powerpy.families import family
from powerpy.formats.constants import GGMLType, Keys, Names, bias_name
from powerpy.formats.constants import GGUFValueType as V
from powerpy.testing.fuzz.files import (
    ARCHS,
    FLOATS,
    MODEL_FAMILIES,
    MUTATIONS,
    SPEC,
    Draft,
    Mutation,
    Tensor,
    mutation,
    pick,
)

F32 = GGMLType.F32


def archs(*names: str) -> Callable[[Mutation], Mutation]:
    """Mark a mutation as one of the architectures ``names`` (its draft is of one of them)."""

    def deco(fn: Mutation) -> Mutation:
        fn.archs = names  # type: ignore[attr-defined]
        return fn

    return deco


def _matrix(rows: int, cols: int, seed: int = 3) -> np.ndarray:
    """A random f32 matrix (rows, cols) scaled like a weight."""
    g = np.random.default_rng(seed)
    return (g.standard_normal((rows, cols)) / math.sqrt(max(cols, 1))).astype(np.float32)


def _set_tensor(t: Tensor, a: np.ndarray) -> None:
    t.data, t.shape, t.ggml_type, t.type_id = a, a.shape, F32, None


def _layer(rng: np.random.Generator) -> int:
    return int(rng.integers(SPEC.n_layer))


def _gqa(d: Draft) -> int:
    """n_embd_gqa of the draft as written (its tensors, not its possibly mutated keys)."""
    if d.arch == "falcon":
        return (d.tensor(Names.ATTN_QKV.format(l=0)).shape[0] - SPEC.n_embd) // 2
    return d.tensor(Names.ATTN_K.format(l=0)).shape[0]


# --- mutations ------------------------------------------------------------------------------------
@mutation("arch")
@archs(*ARCHS)
def gate_tensor(d: Draft, rng: np.random.Generator) -> str:
    """An ffn_gate tensor (these families have no gate) in one layer or in every layer."""
    layers = range(SPEC.n_layer) if rng.integers(2) else [_layer(rng)]
    for l in layers:
        a = _matrix(SPEC.n_ff, SPEC.n_embd, seed=l)
        d.tensors.append(Tensor(Names.FFN_GATE.format(l=l), a, F32, a.shape))
    return f"ffn_gate in layers {list(layers)}"


@mutation("arch")
@archs("falcon")
def qkv_rows(d: Draft, rng: np.random.Generator) -> str:
    """attn_qkv with another row count (a head more or less, no v, q only, one row more), or
    a head_count_kv that does not match its rows."""
    if rng.integers(4) == 0:
        n = pick(rng, (1, 2, 3, 4, 8))
        d.kv[d.key(Keys.HEAD_COUNT_KV)] = (n, V.UINT32)
        return f"head_count_kv {n} for {_gqa(d) * SPEC.n_head // SPEC.n_embd} kv heads"
    t = d.tensor(Names.ATTN_QKV.format(l=_layer(rng)))
    rows, hd = t.shape[0], SPEC.n_embd // SPEC.n_head
    new = pick(rng, (rows - hd, rows + hd, rows - _gqa(d), SPEC.n_embd, 3 * SPEC.n_embd, rows + 1))
    _set_tensor(t, _matrix(new, SPEC.n_embd))
    return f"{t.name} has {new} rows, not {rows}"


@mutation("arch")
@archs("opt")
def position_table(d: Draft, rng: np.random.Generator) -> str:
    """position_embd removed, with fewer rows than the offset, exactly the offset, a few, a row
    more or less than the context, narrower, flat, or quantized."""
    t = d.tensor(Names.POS_EMBD)
    kind = pick(rng, ("drop", "rows", "rows", "cols", "flat", "q8_0"))
    if kind == "drop":
        d.tensors.remove(t)
        return f"without {t.name}"
    a = np.asarray(t.data)
    if kind == "rows":
        n = pick(rng, (0, 1, 2, 3, 10, a.shape[0] - 1, a.shape[0] + 1))
        _set_tensor(t, np.ascontiguousarray(np.resize(a, (n, a.shape[1]))))
        return f"{t.name} has {n} rows (offset {family('opt').position_offset})"
    if kind == "cols":
        _set_tensor(t, np.ascontiguousarray(a[:, : SPEC.n_embd // 2]))
    elif kind == "flat":
        _set_tensor(t, a.reshape(-1))
    else:
        from powerpy.formats import quants

        t.data, t.ggml_type = quants.quantize(a, GGMLType.Q8_0), GGMLType.Q8_0
    return f"{t.name} {kind} {t.shape}"


# optional biases a file may carry (falcon's matrices), with their lengths
def _optional_biases(d: Draft) -> list[tuple[str, int]]:
    l = 0
    out = []
    for t in family(d.arch).block:
        if t.bias == "optional":
            w = d.tensor(t.name.format(l=l)) if len(t.shape) == 2 else None
            if w is not None:
                out.append((bias_name(t.name).format(l=l), w.shape[0]))
    down = Names.FFN_DOWN_T if d.sparse else Names.FFN_DOWN
    if family(d.arch).down_bias == "optional":
        out.append((bias_name(down).format(l=l), SPEC.n_embd))
    return out


@mutation("arch")
@archs(*ARCHS)
def bias(d: Draft, rng: np.random.Generator) -> str:
    """A bias removed, of another length or 2-D, non-finite, or an optional one added (of the
    right length, which must run, or a wrong one)."""
    have = [t for t in d.tensors if t.name.endswith(".bias")]
    optional = [(n, k) for n, k in _optional_biases(d) if n not in {t.name for t in have}]
    kind = pick(rng, ("drop", "length", "2d", "values", "add", "add"))
    if kind == "add" and optional:
        name, n = pick(rng, optional)
        n = n if rng.integers(2) else n + pick(rng, (-1, 1, SPEC.n_embd))
        a = (0.1 * np.random.default_rng(4).standard_normal(max(n, 0))).astype(np.float32)
        d.tensors.append(Tensor(name, a, F32, a.shape))
        return f"{name} added, length {n}"
    t = pick(rng, have)
    a = np.asarray(t.data)
    if kind in ("drop", "add"):
        d.tensors.remove(t)
        return f"without {t.name}"
    if kind == "length":
        _set_tensor(t, np.ascontiguousarray(np.resize(a, a.shape[0] + pick(rng, (-1, 1, 32)))))
    elif kind == "2d":
        _set_tensor(t, np.ascontiguousarray(np.stack([a, a])))
    else:
        b = np.array(a, np.float32)
        b[int(rng.integers(b.size))] = pick(rng, (math.nan, math.inf, -math.inf, 3e38))
        _set_tensor(t, b)
    return f"{t.name} {kind} {t.shape}"


@mutation("arch")
@archs(*ARCHS)
def layer_norm_eps(d: Draft, rng: np.random.Generator) -> str:
    """The LayerNorm epsilon removed, of another type, or an odd value; or only the RMS key."""
    key = d.key(Keys.LAYERNORM_EPS)
    kind = int(rng.integers(4))
    if kind == 0:
        del d.kv[key]
        if rng.integers(2):
            d.kv[Keys.RMS_EPS.format(arch=d.arch)] = (1e-6, V.FLOAT32)
        return f"without {key}"
    if kind == 1:
        d.kv[key] = pick(
            rng,
            (
                ("1e-5", V.STRING),
                ([1e-5, 1e-5], V.ARRAY, V.FLOAT32),
                ([], V.ARRAY, V.FLOAT32),
                (True, V.BOOL),
                (0, V.UINT32),
                (1, V.INT32),
                (1e-5, V.FLOAT64),
                ([1e-5], V.ARRAY, V.FLOAT32),
            ),
        )
    else:
        d.kv[key] = (pick(rng, FLOATS), pick(rng, (V.FLOAT32, V.FLOAT64)))
    return f"{key} = {d.kv[key][:2]!r:.60}"


@mutation("arch")
@archs("falcon")
def attn_norm_2(d: Draft, rng: np.random.Generator) -> str:
    """attn_norm_2 (falcon-40B) in one layer only, without its bias, of another length, or
    added to a multi-query file (where it is valid)."""
    names = [Names.ATTN_NORM_2.format(l=l) for l in range(SPEC.n_layer)]
    present = [t for t in d.tensors if t.name in names]
    if not present:  # multi-query: add it (to one layer or all, with or without its bias)
        layers = range(SPEC.n_layer) if rng.integers(2) else [_layer(rng)]
        with_bias = bool(rng.integers(3))
        for l in layers:
            w = np.ones(SPEC.n_embd, np.float32)
            d.tensors.append(Tensor(names[l], w, F32, w.shape))
            if with_bias:
                b = np.zeros(SPEC.n_embd, np.float32)
                d.tensors.append(Tensor(bias_name(names[l]), b, F32, b.shape))
        return f"attn_norm_2 added in layers {list(layers)}" + ("" if with_bias else " (no bias)")
    t = pick(rng, present)
    kind = pick(rng, ("drop", "drop_bias", "length", "drop_weight"))
    if kind == "drop":
        d.tensors = [x for x in d.tensors if x.name not in (t.name, bias_name(t.name))]
    elif kind == "drop_bias":
        d.tensors.remove(d.tensor(bias_name(t.name)))
    elif kind == "drop_weight":
        d.tensors.remove(t)
    else:
        _set_tensor(t, np.ones(SPEC.n_embd + pick(rng, (-1, 1, 32)), np.float32))
    return f"{t.name}: {kind}"


@mutation("arch")
@archs(*ARCHS)
def arch_label(d: Draft, rng: np.random.Generator) -> str:
    """The file labelled as another family (its keys renamed to match, or not)."""
    new = pick(rng, tuple(a for a in ("llama", "falcon", "opt", "bamboo") if a != d.arch))
    if rng.integers(2):
        prefix = f"{d.arch}."
        d.kv = {
            (f"{new}." + k[len(prefix) :] if k.startswith(prefix) else k): v
            for k, v in d.kv.items()
        }
    d.kv[Keys.ARCHITECTURE] = (new, V.STRING)
    return f"labelled {new}"


@mutation("arch")
@archs(*ARCHS)
def generic(d: Draft, rng: np.random.Generator) -> str:
    """Any mutation of the model file's families (kv, hparams, tensors, ...) on these files."""
    name = pick(rng, [m for m, (f, _) in MUTATIONS.items() if f in MODEL_FAMILIES])
    try:
        return f"{name}: {MUTATIONS[name][1](d, rng)}"
    except (StopIteration, ValueError, KeyError, IndexError, TypeError, OverflowError):
        return f"{name} (not applicable)"  # e.g. predictor edits on a dense model


# --- seed cases -----------------------------------------------------------------------------------
def _drop(name: str) -> Callable[[Draft], None]:
    def fn(d: Draft) -> None:
        d.tensors.remove(d.tensor(name))

    return fn


def _add_gate(d: Draft) -> None:
    a = _matrix(SPEC.n_ff, SPEC.n_embd)
    i = d.tensors.index(d.tensor(Names.FFN_UP.format(l=0)))
    d.tensors.insert(i, Tensor(Names.FFN_GATE.format(l=0), a, F32, a.shape))


def _qkv_without_v(d: Draft) -> None:
    t = d.tensor(Names.ATTN_QKV.format(l=1))
    _set_tensor(t, np.ascontiguousarray(np.asarray(t.data)[: SPEC.n_embd + _gqa(d)]))


def _position_rows(n: int) -> Callable[[Draft], None]:
    def fn(d: Draft) -> None:
        t = d.tensor(Names.POS_EMBD)
        _set_tensor(t, np.ascontiguousarray(np.asarray(t.data)[:n]))

    return fn


def _eps(*spec: Any) -> Callable[[Draft], None]:
    def fn(d: Draft) -> None:
        d.kv[d.key(Keys.LAYERNORM_EPS)] = spec

    return fn


# name -> (arch, draft seed: falcon is multi-query for 0, 40B-like for 1), fn
_ARCH_SEEDS: dict[str, tuple[str, int, Callable[[Draft], None]]] = {
    "falcon_ffn_gate": ("falcon", 0, _add_gate),
    "falcon_qkv_rows": ("falcon", 0, _qkv_without_v),
    "falcon_norm_bias_missing": ("falcon", 0, _drop("blk.0.attn_norm.bias")),
    "falcon_norm_2_bias_missing": ("falcon", 1, _drop("blk.1.attn_norm_2.bias")),
    "falcon_eps_string": ("falcon", 0, _eps("1e-5", V.STRING)),
    "opt_no_position_embd": ("opt", 0, _drop(Names.POS_EMBD)),
    "opt_position_table_short": ("opt", 0, _position_rows(1)),
    "opt_position_table_offset": ("opt", 0, _position_rows(2)),
    "opt_bias_missing": ("opt", 0, _drop("blk.0.attn_k.bias")),
    "opt_down_bias_missing": ("opt", 0, _drop("blk.1.ffn_down_t.bias")),
    "opt_eps_array": ("opt", 0, _eps([1e-5, 1e-5], V.ARRAY, V.FLOAT32)),
}
ARCH_SEED_CASES: dict[str, tuple[str, Callable[[Draft], None]]] = {
    name: ("arch", fn) for name, (_, _, fn) in _ARCH_SEEDS.items()
}
SEED_ARCHS: dict[str, tuple[str, int]] = {n: (a, s) for n, (a, s, _) in _ARCH_SEEDS.items()}
