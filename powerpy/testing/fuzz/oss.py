"""Mutations of GPT-OSS files for the load-path fuzzer (family "moe"): the attention sinks, the
biases of q/k/v/o, of the router and of each expert stack, the window's keys, and MXFP4 expert
stacks (their bytes, their scales); with their seed cases. Drafts are ``experts.moe_draft``'s."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from powerpy.formats.constants import GGMLType, Keys, Names, bias_name
from powerpy.formats.constants import GGUFValueType as V
from powerpy.testing.fuzz.experts import (
    STACKS,
    _f32,
    _layer,
    _set,
    drop_tensor,
    moe_archs,
    put_key,
    set_key,
)
from powerpy.testing.fuzz.files import INTS, SIGNED, Draft, Tensor, mutation, pick

ATTENTION = (Names.ATTN_Q, Names.ATTN_K, Names.ATTN_V, Names.ATTN_OUTPUT)


def _odd(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``a`` missing a row, with one more axis, transposed, doubled, or with a non-finite or
    huge value."""
    how = int(rng.integers(5))
    if how == 0:
        return a[:-1]
    if how == 1:
        return a[None]
    if how == 2 and a.ndim == 2:
        return a.T
    if how == 3:
        return np.concatenate([a, a])
    b = a.copy()
    b.flat[int(rng.integers(b.size))] = pick(rng, (np.nan, np.inf, -np.inf, 1e30))
    return b


def _drop_or_odd(d: Draft, name: str, rng: np.random.Generator) -> str:
    """Tensor ``name`` removed (a quarter of the time) or made odd (:func:`_odd`)."""
    t = d.tensor(name)
    if rng.random() < 0.25:
        d.tensors.remove(t)
        return f"no {name}"
    a = _f32(t)
    b = np.ascontiguousarray(_odd(a, rng))
    _set(t, b)
    return f"{name} {a.shape} -> {b.shape}"


@mutation("moe")
@moe_archs("gpt-oss")
def sinks(d: Draft, rng: np.random.Generator) -> str:
    """A layer's attention sinks missing, misshapen, non-finite or huge."""
    return _drop_or_odd(d, Names.ATTN_SINKS.format(l=int(rng.integers(2))), rng)


@mutation("moe")
@moe_archs("gpt-oss")
def biases(d: Draft, rng: np.random.Generator) -> str:
    """A bias of q, k, v, the output, the router or an expert stack missing, misshapen,
    non-finite or huge."""
    if rng.integers(2):
        weight = pick(rng, ATTENTION).format(l=int(rng.integers(2)))
    else:
        weight = pick(rng, (Names.FFN_GATE_INP, *STACKS)).format(l=_layer(rng, d))
    return _drop_or_odd(d, bias_name(weight), rng)


@mutation("moe")
@moe_archs("gpt-oss")
def window(d: Draft, rng: np.random.Generator) -> str:
    """sliding_window 0, 1, longer than the context, huge, negative, a float or gone; a pattern
    that windows every layer, none, or is no pattern; the windowed layers' RoPE base odd."""
    which = int(rng.integers(3))
    if which == 0:
        key = Keys.SLIDING_WINDOW
        spec = pick(
            rng,
            [
                (0, V.UINT32),
                (1, V.UINT32),
                (4096, V.UINT32),
                (pick(rng, INTS), V.UINT64),
                (pick(rng, SIGNED), V.INT32),
                (4.0, V.FLOAT32),
                None,
            ],
        )
    elif which == 1:
        key = Keys.SLIDING_WINDOW_PATTERN
        spec = pick(
            rng,
            [
                (0, V.UINT32),
                (1, V.UINT32),
                (3, V.UINT32),
                ([1, 1], V.ARRAY, V.BOOL),
                ([True], V.ARRAY, V.BOOL),
                ("2", V.STRING),
            ],
        )
    else:
        key = Keys.ROPE_FREQ_BASE_SWA
        spec = pick(
            rng,
            [
                (0.0, V.FLOAT32),
                (-1.0, V.FLOAT32),
                (float("nan"), V.FLOAT32),
                (1e-30, V.FLOAT32),
                (150000.0, V.FLOAT32),
            ],
        )
    return put_key(d, key, spec)


@mutation("moe")
@moe_archs("gpt-oss")
def mxfp4_stack(d: Draft, rng: np.random.Generator) -> str:
    """An MXFP4 expert stack with its bytes cut, its scales the largest or smallest exponents,
    random bytes, or the label MXFP4 over a stack of another type."""
    t = d.tensor(pick(rng, STACKS).format(l=_layer(rng, d)))
    if t.ggml_type != GGMLType.MXFP4:
        t.ggml_type = GGMLType.MXFP4
        d.raw = True
        return f"{t.name} labelled MXFP4"
    raw = np.array(t.data, dtype=np.uint8)  # (n_expert, rows, blocks · 17)
    how = int(rng.integers(3))
    if how == 0:
        t.data = np.ascontiguousarray(raw[..., :-17])
        d.raw = True
        return f"{t.name} one block short per row"
    if how == 1:
        blocks = raw.reshape(-1, 17)
        blocks[:, 0] = pick(rng, (0, 1, 254, 255))
        t.data = blocks.reshape(raw.shape)
        return f"{t.name}'s scales 2^{int(blocks[0, 0]) - 127}"
    t.data = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    return f"{t.name} random bytes"


# --- seed cases -----------------------------------------------------------------------------------
def _sinks_cut(d: Draft) -> None:
    t = d.tensor(Names.ATTN_SINKS.format(l=1))
    _set(t, _f32(t)[:-1])


def _foreign_sinks(d: Draft) -> None:
    a = np.zeros(4, np.float32)
    d.tensors.append(Tensor(Names.ATTN_SINKS.format(l=0), a, GGMLType.F32, a.shape))


# name -> (arch, fn); messages in tests/test_fuzz_path.py
OSS_SEEDS: dict[str, tuple[str, Callable[[Draft], None]]] = {
    "oss_sinks_missing": ("gpt-oss", drop_tensor(Names.ATTN_SINKS.format(l=0))),
    "oss_sinks_cut": ("gpt-oss", _sinks_cut),
    "oss_expert_bias_missing": ("gpt-oss", drop_tensor(bias_name(Names.FFN_UP_EXPS.format(l=1)))),
    "oss_window_missing": ("gpt-oss", lambda d: d.kv.pop(d.key(Keys.SLIDING_WINDOW))),
    "oss_window_pattern_odd": ("gpt-oss", set_key(Keys.SLIDING_WINDOW_PATTERN, ("2", V.STRING))),
    "oss_sinks_in_qwen3moe": ("qwen3moe", _foreign_sinks),
}
