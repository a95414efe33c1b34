"""Mutations of the model file for the load-path fuzzer: KV types and values, hyperparameters,
tokenizer arrays, tensor types and data, alignment, predictor shapes (see ``cases``)."""

from __future__ import annotations

import math

import numpy as np

from powerpy.formats import quants
from powerpy.formats.constants import GGMLType, Keys, Names, TokenType
from powerpy.formats.constants import GGUFValueType as V
from powerpy.formats.gguf_types import file_type_id
from powerpy.testing.fuzz.files import (
    FLAG_KEYS,
    FLOAT_KEYS,
    FLOATS,
    HP_KEYS,
    INTS,
    SIGNED,
    SPEC,
    SPECIAL_KEYS,
    Draft,
    Tensor,
    any_value,
    mutation,
    pick,
    scalar_key,
)


# --- kv: value types ------------------------------------------------------------------------------
@mutation("kv")
def scalar_as_array(d: Draft, rng: np.random.Generator) -> str:
    """A scalar key given as an array."""
    key = scalar_key(d, rng)
    n = int(rng.integers(0, 4))
    item = pick(rng, (V.UINT32, V.INT32, V.FLOAT32, V.STRING, V.BOOL))
    vals = {V.STRING: ["a"] * n, V.BOOL: [True] * n, V.FLOAT32: [1.0] * n}.get(item, [64] * n)
    d.kv[key] = (vals, V.ARRAY, item)
    return f"{key} = {item.name}[{n}]"


@mutation("kv")
def array_as_scalar(d: Draft, rng: np.random.Generator) -> str:
    """A tokenizer array given as a scalar."""
    key = pick(rng, (Keys.TOKENS, Keys.SCORES, Keys.TOKEN_TYPE, Keys.MERGES))
    d.kv[key] = pick(rng, (("x", V.STRING), (3, V.UINT32), (1.5, V.FLOAT32), (True, V.BOOL)))
    return f"{key} = {d.kv[key][:2]}"


@mutation("kv")
def empty_array(d: Draft, rng: np.random.Generator) -> str:
    """A special-token id, flag or tokenizer array given as an empty array."""
    key = pick(rng, SPECIAL_KEYS + FLAG_KEYS + (Keys.TOKENS, Keys.SCORES, Keys.TOKEN_TYPE))
    d.kv[key] = ([], V.ARRAY, pick(rng, (V.UINT32, V.BOOL, V.STRING, V.FLOAT32)))
    return f"{key} = []"


@mutation("kv")
def float_token_id(d: Draft, rng: np.random.Generator) -> str:
    """A special-token id given as a float (inf, NaN, fractions, huge)."""
    key = pick(rng, SPECIAL_KEYS)
    d.kv[key] = (
        pick(rng, (math.inf, -math.inf, math.nan, 1.0, 1.5, 1e20)),
        pick(rng, (V.FLOAT32, V.FLOAT64)),
    )
    return f"{key} = {d.kv[key][0]}"


@mutation("kv")
def wrong_type(d: Draft, rng: np.random.Generator) -> str:
    """Any key given a random value of any type."""
    key = pick(rng, sorted(d.kv))
    d.kv[key] = any_value(rng)
    return f"{key} = {d.kv[key]!r:.80}"


@mutation("kv")
def drop_key(d: Draft, rng: np.random.Generator) -> str:
    """Any key removed."""
    key = pick(rng, sorted(d.kv))
    del d.kv[key]
    return f"without {key}"


@mutation("kv")
def extra_key(d: Draft, rng: np.random.Generator) -> str:
    """An optional key added with a random value of any type."""
    keys = (
        Keys.ALIGNMENT,
        d.key(Keys.VOCAB_SIZE),
        Keys.SPARSE_ACTIVATION,
        Keys.CHAT_TEMPLATE,
        Keys.MERGES,
        Keys.TOKENIZER_PRE,
        "llama.rope.scaling.type",
    )
    key = pick(rng, keys)
    d.kv[key] = any_value(rng)
    return f"{key} = {d.kv[key]!r:.80}"


# --- hparams: values that make no model -----------------------------------------------------------
@mutation("hparams")
def count_value(d: Draft, rng: np.random.Generator) -> str:
    """A size hyperparameter set to a negative, zero, odd or huge count."""
    key = d.key(pick(rng, HP_KEYS))
    if rng.integers(3) == 0:
        d.kv[key] = (pick(rng, SIGNED), pick(rng, (V.INT32, V.INT64)))
    else:
        v = pick(rng, INTS)
        d.kv[key] = (v, V.UINT32 if v < 2**32 else V.UINT64)
    return f"{key} = {d.kv[key][0]}"


@mutation("hparams")
def float_value(d: Draft, rng: np.random.Generator) -> str:
    """The RoPE base, RMS epsilon or sparse threshold set to an odd float."""
    key = d.key(pick(rng, FLOAT_KEYS)) if rng.integers(3) else Keys.SPARSE_THRESHOLD
    d.kv[key] = (pick(rng, FLOATS), pick(rng, (V.FLOAT32, V.FLOAT32, V.FLOAT64)))
    return f"{key} = {d.kv[key][0]} {d.kv[key][1].name}"


@mutation("hparams")
def heads(d: Draft, rng: np.random.Generator) -> str:
    """Head counts that do not divide the model (zero, mismatched, too many)."""
    h, hkv = pick(rng, ((0, 2), (3, 3), (4, 3), (8, 2), (4, 8), (2, 2), (32, 32), (4, 0), (64, 1)))
    d.kv[d.key(Keys.HEAD_COUNT)] = (h, V.UINT32)
    d.kv[d.key(Keys.HEAD_COUNT_KV)] = (hkv, V.UINT32)
    return f"head_count {h}, head_count_kv {hkv}"


@mutation("hparams")
def rope_dims(d: Draft, rng: np.random.Generator) -> str:
    """An odd RoPE dimension count."""
    v = pick(rng, (-8, -1, 0, 1, 2, 3, 6, 7, 8, 9, 16, 64))
    d.kv[d.key(Keys.ROPE_DIMENSION_COUNT)] = (v, V.INT32 if v < 0 else V.UINT32)
    return f"rope.dimension_count = {v}"


@mutation("hparams")
def vocab_size(d: Draft, rng: np.random.Generator) -> str:
    """A vocab_size that disagrees with the token list."""
    n = len(d.kv[Keys.TOKENS][0]) + pick(rng, (-259, -1, 1, 100, 2**20))
    d.kv[d.key(Keys.VOCAB_SIZE)] = (n, V.UINT32)
    return f"vocab_size = {n}"


@mutation("hparams")
def block_count(d: Draft, rng: np.random.Generator) -> str:
    """A block count that disagrees with the tensors."""
    n = pick(rng, (0, 1, 3, 100))
    d.kv[d.key(Keys.BLOCK_COUNT)] = (n, V.UINT32)
    return f"block_count = {n}"


@mutation("hparams")
def dims(d: Draft, rng: np.random.Generator) -> str:
    """An embedding, FFN or context length that disagrees with the tensors."""
    key = d.key(pick(rng, (Keys.EMBEDDING_LENGTH, Keys.FEED_FORWARD_LENGTH, Keys.CONTEXT_LENGTH)))
    v = pick(rng, (1, 2, 16, 48, 63, 65, 128, 2**30))
    d.kv[key] = (v, V.UINT32)
    return f"{key} = {v}"


@mutation("hparams")
def architecture(d: Draft, rng: np.random.Generator) -> str:
    """An unknown or oddly spelled architecture."""
    arch = pick(rng, ("bamboo", "gpt2", "LLAMA", "", "generic.gpu_index"))
    d.kv[Keys.ARCHITECTURE] = (arch, V.STRING)
    return f"architecture {arch!r}"


# --- tokenizer arrays ----------------------------------------------------------------------------
@mutation("tokenizer")
def tokens_length(d: Draft, rng: np.random.Generator) -> str:
    """A token list of another length (the other arrays kept or resized)."""
    tokens = list(d.kv[Keys.TOKENS][0])
    n = pick(rng, (0, 1, 3, 258, 260, 1000))
    tokens = (tokens + [f"<extra{i}>" for i in range(n)])[:n]
    d.kv[Keys.TOKENS] = (tokens, V.ARRAY, V.STRING)
    if rng.integers(2):  # keep the other arrays consistent with the new list
        d.kv[Keys.SCORES] = (np.zeros(n, np.float32), V.ARRAY, V.FLOAT32)
        d.kv[Keys.TOKEN_TYPE] = (np.ones(n, np.int32), V.ARRAY, V.INT32)
    return f"{n} tokens"


@mutation("tokenizer")
def array_items(d: Draft, rng: np.random.Generator) -> str:
    """A tokenizer array of another item type or length."""
    key = pick(rng, (Keys.TOKENS, Keys.SCORES, Keys.TOKEN_TYPE, Keys.MERGES))
    n = len(d.kv[Keys.TOKENS][0]) + pick(rng, (0, 0, -1, 1))
    item = pick(rng, (V.STRING, V.INT32, V.FLOAT32, V.BOOL, V.UINT8, V.FLOAT64, V.INT64))
    vals = {V.STRING: ["<0x41>"] * n, V.BOOL: [False] * n}.get(item, list(range(n)))
    if item in (V.FLOAT32, V.FLOAT64):
        vals = [pick(rng, FLOATS) for _ in range(n)]
    d.kv[key] = (vals, V.ARRAY, item)
    return f"{key} = {item.name}[{n}]"


@mutation("tokenizer")
def token_types(d: Draft, rng: np.random.Generator) -> str:
    """Token types set to out-of-range or special values."""
    types = np.array(d.kv[Keys.TOKEN_TYPE][0], np.int32)
    v = pick(
        rng,
        (-5, 0, 7, 99, int(TokenType.CONTROL), int(TokenType.UNUSED), int(TokenType.USER_DEFINED)),
    )
    idx = rng.integers(0, len(types), int(rng.integers(1, len(types))))
    types[idx] = v
    d.kv[Keys.TOKEN_TYPE] = (types, V.ARRAY, V.INT32)
    return f"{len(idx)} token types = {v}"


@mutation("tokenizer")
def special_id(d: Draft, rng: np.random.Generator) -> str:
    """A special-token id outside the vocabulary."""
    key = pick(rng, SPECIAL_KEYS)
    v = pick(rng, (259, 260, 2**31, 2**32 - 1, -1, 3, 258))
    d.kv[key] = (v, V.INT32 if v < 0 else V.UINT32)
    return f"{key} = {v}"


@mutation("tokenizer")
def token_text(d: Draft, rng: np.random.Generator) -> str:
    """Some token texts made empty, blank, invalid UTF-8, huge, NUL or byte-token-like."""
    tokens = list(d.kv[Keys.TOKENS][0])
    what = pick(rng, ("", " ", "\udcff\udcfe", "<s>", "<0xZZ>", "<0x41>", "a" * 5000, "\x00"))
    for i in rng.integers(0, len(tokens), int(rng.integers(1, 40))):
        tokens[int(i)] = what
    d.kv[Keys.TOKENS] = (tokens, V.ARRAY, V.STRING)
    return f"tokens = {what!r:.20}"


@mutation("tokenizer")
def tokenizer_model(d: Draft, rng: np.random.Generator) -> str:
    """Another or unknown tokenizer model (and merges or pre-tokenizer)."""
    model = pick(rng, ("gpt2", "bert", "", "none", "rwkv", "t5", "LLAMA"))
    d.kv[Keys.TOKENIZER_MODEL] = (model, V.STRING)
    if model == "gpt2" and rng.integers(2):
        d.kv[Keys.MERGES] = (
            pick(rng, (["a b"], ["ab"], [""], ["<0x41> <0x42>"])),
            V.ARRAY,
            V.STRING,
        )
    if rng.integers(2):
        d.kv[Keys.TOKENIZER_PRE] = (pick(rng, ("default", "llama3", "qwen2", "??")), V.STRING)
    return f"tokenizer model {model!r}"


@mutation("tokenizer")
def chat_template(d: Draft, rng: np.random.Generator) -> str:
    """A chat template that does not parse or raises."""
    t = pick(
        rng, ("{{", "{% for %}", "{{ messages[0]['content'] }}", "{{ raise_exception('x') }}", "")
    )
    d.kv[Keys.CHAT_TEMPLATE] = (t, V.STRING)
    return f"chat template {t!r}"


# --- tensor types and data ------------------------------------------------------------------------
def _some_tensor(d: Draft, rng: np.random.Generator, *, matrix: bool = False) -> Tensor:
    pool = [t for t in d.tensors if not matrix or len(t.shape) == 2]
    return pick(rng, pool)


@mutation("tensors")
def bad_values(d: Draft, rng: np.random.Generator) -> str:
    """Non-finite or huge values in a tensor."""
    t = _some_tensor(d, rng)
    v = pick(rng, (math.nan, math.inf, -math.inf, 1e30, 3.4e38, -3.4e38, 1e19, 0.0))
    data = np.array(t.data, np.float32)
    flat = data.reshape(-1)
    n = pick(rng, (1, flat.size // 3, flat.size))
    flat[rng.choice(flat.size, size=n, replace=False)] = v
    t.data = data
    return f"{t.name}: {n} values = {v}"


@mutation("tensors")
def mislabelled(d: Draft, rng: np.random.Generator) -> str:
    """F32 bytes labelled as another type (the shape kept): sizes no longer match the data."""
    t = _some_tensor(d, rng, matrix=True)
    new = pick(
        rng, (GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.F16, GGMLType.Q4_1, GGMLType.I32, GGMLType.I8)
    )
    t.type_id, d.raw = file_type_id(new, b"PWRI" if d.sparse else b"GGUF"), True
    t.data = np.ascontiguousarray(t.data).view(np.uint8)
    return f"{t.name}: F32 data labelled {new.name}"


@mutation("tensors")
def converted(d: Draft, rng: np.random.Generator) -> str:
    """A valid conversion (or a plain integer type where floats are expected)."""
    t = _some_tensor(d, rng, matrix=True)
    new = pick(
        rng, (GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.BF16, GGMLType.I32, GGMLType.I8)
    )
    if new is GGMLType.F16:
        t.data = t.data.astype(np.float16)
    elif new in (GGMLType.I32, GGMLType.I8):
        t.data = (t.data * 100).astype(np.int32 if new is GGMLType.I32 else np.int8)
    elif t.shape[-1] % 32:  # no whole blocks: the writer refuses it, the reader too
        t.data, t.type_id, d.raw = quants.quantize(np.zeros((1, 32), np.float32), new), None, True
    else:
        t.data = quants.quantize(t.data, new)
    t.ggml_type = new
    if new is GGMLType.BF16 and d.sparse:  # PWRI has no BF16 id: write upstream's, raw
        t.type_id, d.raw = 30, True
    return f"{t.name} as {new.name}"


@mutation("tensors")
def shape(d: Draft, rng: np.random.Generator) -> str:
    """A tensor transposed, flattened, given a dimension more, or a row less or more."""
    t = _some_tensor(d, rng)
    a = np.ascontiguousarray(t.data)
    kind = int(rng.integers(5))
    if kind == 0 and a.ndim == 2:
        t.data, t.shape = a.T.copy(), a.T.shape
    elif kind == 1:
        t.data, t.shape = a.reshape(-1), (a.size,)
    elif kind == 2:
        t.data, t.shape = a.reshape(1, *a.shape), (1, *a.shape)
    elif kind == 3:
        t.data = np.ascontiguousarray(a[: max(0, a.shape[0] - 1)])
        t.shape = t.data.shape
    else:
        t.data = np.concatenate([a, a[:1]])
        t.shape = t.data.shape
    return f"{t.name} shape {t.shape}"


@mutation("tensors")
def optional_bias(d: Draft, rng: np.random.Generator) -> str:
    """One of llama's optional biases (on attn_output, ffn_gate, ffn_up or the down matrix)
    added: of its matrix's rows (it must run), of another length, 2-D, or non-finite."""
    down = Names.FFN_DOWN_T if d.sparse else Names.FFN_DOWN
    d_, ff = SPEC.n_embd, SPEC.n_ff
    weight, n = pick(
        rng, [(Names.ATTN_OUTPUT, d_), (Names.FFN_GATE, ff), (Names.FFN_UP, ff), (down, d_)]
    )
    name = weight.format(l=int(rng.integers(SPEC.n_layer))).replace(".weight", ".bias")
    kind = pick(rng, ("rows", "rows", "length", "2d", "values"))
    a = (0.1 * np.random.default_rng(5).standard_normal(n)).astype(np.float32)
    if kind == "length":
        a = np.resize(a, n + pick(rng, (-1, 1, 32)))
    elif kind == "2d":
        a = np.stack([a, a])
    elif kind == "values":
        a[int(rng.integers(n))] = pick(rng, (math.nan, math.inf, 3e38))
    d.tensors.append(Tensor(name, np.ascontiguousarray(a), GGMLType.F32, a.shape))
    return f"{name} added ({kind}, shape {a.shape})"


@mutation("tensors")
def missing_or_renamed(d: Draft, rng: np.random.Generator) -> str:
    """A tensor removed or renamed (possibly to a duplicate name)."""
    t = _some_tensor(d, rng)
    if rng.integers(2):
        d.tensors.remove(t)
        return f"without {t.name}"
    t.name = pick(rng, ("blk.9.ffn_up.weight", t.name.replace("weight", "bias"), "output.weight"))
    if sum(x.name == t.name for x in d.tensors) > 1:
        d.raw = True  # duplicate names: the reader refuses them
    return f"renamed to {t.name}"


@mutation("tensors")
def truncated(d: Draft, rng: np.random.Generator) -> str:
    """The end of the file cut off."""
    d.cut = pick(rng, (1, 16, 31, 32, 100, 4096, 10**6))
    return f"last {d.cut} bytes cut"


@mutation("tensors")
def dense_magic(d: Draft, rng: np.random.Generator) -> str:
    """PWRI tensors under a GGUF magic (ffn_down_t, fc1/fc2 but dense), or the reverse."""
    d.sparse = not d.sparse
    return "magic flipped to " + ("PWRI" if d.sparse else "GGUF")


# --- alignment ------------------------------------------------------------------------------------
@mutation("alignment")
def shifted(d: Draft, rng: np.random.Generator) -> str:
    """general.alignment changed without moving the data: every offset is read elsewhere."""
    a = pick(rng, (1, 2, 8, 16, 64, 128, 4096, 3, 0, 2**31))
    d.kv[Keys.ALIGNMENT] = (a, V.UINT32)
    d.raw = True
    return f"general.alignment = {a}, data laid out at 32"


@mutation("alignment")
def consistent(d: Draft, rng: np.random.Generator) -> str:
    """Another alignment, with the data laid out at it."""
    a = pick(rng, (1, 8, 64, 256))
    d.kv[Keys.ALIGNMENT] = (a, V.UINT32)
    d.layout_alignment = a
    return f"general.alignment = {a}, data laid out at {a}"


@mutation("alignment")
def key_type(d: Draft, rng: np.random.Generator) -> str:
    """general.alignment given another type."""
    d.kv[Keys.ALIGNMENT] = pick(
        rng, ((64, V.UINT64), (32.0, V.FLOAT32), ([32], V.ARRAY, V.UINT32), (-32, V.INT32))
    )
    d.raw = True
    return f"general.alignment = {d.kv[Keys.ALIGNMENT][:2]}"


# --- predictor shapes -----------------------------------------------------------------------------
@mutation("predictor")
def fc_shape(d: Draft, rng: np.random.Generator) -> str:
    """A predictor matrix of the wrong shape."""
    layer = int(rng.integers(SPEC.n_layer))
    which = pick(rng, (Names.FC1, Names.FC2)).format(l=layer)
    t = d.tensor(which)
    rows, cols = t.shape
    rows, cols = pick(
        rng,
        ((rows + 1, cols), (rows, cols + 1), (cols, rows), (1, cols), (rows, 1), (rows * 2, cols)),
    )
    t.data = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    t.shape = (rows, cols)
    return f"{which} shape {t.shape}"


@mutation("predictor")
def fc_hidden(d: Draft, rng: np.random.Generator) -> str:
    """A different hidden size in fc1 and fc2 of one layer (each consistent on its own)."""
    layer = int(rng.integers(SPEC.n_layer))
    h = pick(rng, (1, 8, 17, 64))
    fc1, fc2 = d.tensor(Names.FC1.format(l=layer)), d.tensor(Names.FC2.format(l=layer))
    g = np.random.default_rng(2)
    if rng.integers(2):
        fc1.data = g.standard_normal((h, SPEC.n_embd)).astype(np.float32)
        fc1.shape = fc1.data.shape
    if rng.integers(2):
        fc2.data = g.standard_normal((SPEC.n_ff, h)).astype(np.float32)
        fc2.shape = fc2.data.shape
    return f"layer {layer}: fc1 {fc1.shape}, fc2 {fc2.shape}"


@mutation("predictor")
def fc_missing(d: Draft, rng: np.random.Generator) -> str:
    """Predictor matrices removed."""
    names = [t.name for t in d.tensors if ".fc" in t.name]
    drop = set(rng.choice(names, size=int(rng.integers(1, len(names) + 1)), replace=False))
    d.tensors = [t for t in d.tensors if t.name not in drop]
    return f"without {sorted(drop)}"


@mutation("predictor")
def fc_values(d: Draft, rng: np.random.Generator) -> str:
    """A predictor matrix filled with non-finite or huge values."""
    t = d.tensor(pick(rng, (Names.FC1, Names.FC2)).format(l=int(rng.integers(SPEC.n_layer))))
    t.data = np.full(t.shape, pick(rng, (math.nan, math.inf, -math.inf, 1e30, 0.0)), np.float32)
    return f"{t.name} = {t.data.flat[0]}"
