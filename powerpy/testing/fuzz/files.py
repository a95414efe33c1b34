"""Model drafts for the load-path fuzzer (issue 13): a tiny model as key/values and tensors
that mutations edit, written with ``write_gguf`` or, when the writer refuses a mutation, as raw
bytes here (values wrap, types and sizes are not checked). See ``cases``."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from powerpy.families import family
from powerpy.formats.constants import GGMLType, Keys, Names, bias_name
from powerpy.formats.constants import GGUFValueType as V
from powerpy.formats.gguf_types import SCALAR_FORMATS, file_type_id
from powerpy.formats.gguf_writer import write_gguf
from powerpy.testing import BYTE_VOCAB, TinySpec, tiny_kv, tiny_tensors

FAMILIES = (
    "kv",
    "hparams",
    "tokenizer",
    "tensors",
    "alignment",
    "predictor",
    "gpuidx",
    "stats",
    "arch",
    "moe",
)
# the families that mutate the model file itself (a second mutation on top is drawn from these)
MODEL_FAMILIES = ("kv", "hparams", "tokenizer", "tensors", "alignment", "predictor")
ARCHS = ("falcon", "opt")  # the families of ``arch_draft`` built by ``synthetic``
# … and by ``windowed.windowed_draft`` (gemma's and phi3's keys; stablelm's and phi2's partial
# rotary)
WINDOWED_ARCHS = ("gemma", "gemma2", "gemma3", "phi3", "stablelm", "phi2")
# arch -> (arch, sparse, seed) -> Draft: the builders of other modules (``windowed``)
DRAFTS: dict[str, Callable[[str, bool, int], Draft]] = {}
SPEC = TinySpec(n_embd=32, n_layer=2, n_ff=64, n_head=4, n_head_kv=2, n_pred_hidden=16)
PROMPT = "Hi!"
BUDGET_GIB = 0.001  # the tiny model's dense part fits; the FFN rows are split
OUTCOMES = ("ok", "PowerpyError", "NonFiniteError")


@dataclass
class Tensor:
    """One tensor of a draft: its data and the type, shape and type id written."""

    name: str
    data: np.ndarray  # float32 / float16 / raw uint8 bytes
    ggml_type: GGMLType
    shape: tuple[int, ...]  # numpy order
    type_id: int | None = None  # written type id override (raw writer only)


@dataclass
class Draft:
    """A model file (and its side files) before it is written."""

    sparse: bool
    kv: dict[str, tuple]  # key -> (value, type[, item type])
    tensors: list[Tensor]
    layout_alignment: int = 32  # where the data really is (general.alignment may lie)
    raw: bool = False  # bypass write_gguf
    cut: int = 0  # bytes cut from the end of the file
    gpuidx: Callable[[Path, Path], None] | None = None  # (model path, index path) -> writes
    stats: Callable[[Path], None] | None = None  # activation dir -> writes
    load: dict[str, Any] = field(default_factory=dict)
    arch: str = "llama"  # the family the keys are written for

    def key(self, template: str) -> str:
        """A per-architecture key of this draft; the RMS epsilon's template gives the norm
        epsilon of the draft's family (LayerNorm's for falcon and opt)."""
        if template == Keys.RMS_EPS:
            template = family(self.arch).norm.eps_key
        return template.format(arch=self.arch)

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)


Mutation = Callable[[Draft, np.random.Generator], str]
MUTATIONS: dict[str, tuple[str, Mutation]] = {}  # name -> (family, fn)


def mutation(family: str) -> Callable[[Mutation], Mutation]:
    """Register the decorated mutation as ``MUTATIONS[f"{family}.{name}"]``."""

    def deco(fn: Mutation) -> Mutation:
        MUTATIONS[f"{family}.{fn.__name__}"] = (family, fn)
        return fn

    return deco


def base_draft(sparse: bool = True, seed: int = 0) -> Draft:
    """The unmutated tiny model (``SPEC``), sparse (PWRI) or dense (GGUF)."""
    kv = dict(tiny_kv(SPEC, threshold=0.0 if sparse else None))
    tensors = [
        Tensor(n, a, GGMLType.F32, a.shape)
        for n, a in tiny_tensors(SPEC, sparse=sparse, seed=seed).items()
    ]
    return Draft(sparse, kv, tensors)


def arch_draft(arch: str, sparse: bool = True, seed: int = 0) -> Draft:
    """The unmutated tiny model of family ``arch`` (``ARCHS``, ``WINDOWED_ARCHS``) in ``SPEC``'s
    dimensions, built by ``powerpy.testing.synthetic`` (F32, working predictors). A falcon draft
    is multi-query for an even seed and 40B-like (``SPEC.n_head_kv`` kv heads, attn_norm_2) for
    an odd one. The dense (GGUF) draft has ``ffn_down`` (n_embd, n_ff) (and ``ffn_down.bias``)
    for ``ffn_down_t`` and no predictors. Gemma and Phi-3 drafts: ``DRAFTS`` (``windowed``)."""
    if arch in DRAFTS:
        return DRAFTS[arch](arch, sparse, seed)
    from powerpy.testing import synthetic

    n_kv = {"falcon": 1 if seed % 2 == 0 else SPEC.n_head_kv, "opt": SPEC.n_head}[arch]
    shape = synthetic.Shape(
        SPEC.n_embd,
        SPEC.n_ff,
        SPEC.n_layer,
        SPEC.n_head,
        n_kv,
        SPEC.n_ctx,
        len(BYTE_VOCAB),
        SPEC.n_pred_hidden,
    )
    f32 = GGMLType.F32
    plan = synthetic.Plan(shape, f32, f32, f32, arch)
    kv = synthetic.key_values(plan, f"powerpy-fuzz-{arch}", 0.0 if sparse else None)
    down_t, down = Names.FFN_DOWN_T, Names.FFN_DOWN
    renamed = {}
    for l in range(SPEC.n_layer):
        renamed[down_t.format(l=l)] = down.format(l=l)
        renamed[bias_name(down_t).format(l=l)] = bias_name(down).format(l=l)
    tensors = []
    for name, w in synthetic.generate(plan, seed=seed, calib_tokens=64):
        a = w.numpy().copy()
        if not sparse:
            if ".fc" in name:
                continue
            if name in renamed:
                a, name = np.ascontiguousarray(a.T), renamed[name]  # (n_embd, n_ff) for a matrix
        tensors.append(Tensor(name, a, f32, a.shape))
    return Draft(sparse, dict(kv), tensors, arch=arch)


# --- raw writer ---------------------------------------------------------------------------------
def _str(s: Any) -> bytes:
    b = s if isinstance(s, bytes) else str(s).encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(b)) + b


def _item_type(value: Any, items: list) -> V:
    """The item type write_gguf would infer for an untyped array."""
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    if kind == "f" or (kind is None and items and isinstance(items[0], float)):
        return V.FLOAT32
    if kind == "b" or (kind is None and items and isinstance(items[0], bool)):
        return V.BOOL
    if kind is None and items and isinstance(items[0], (str, bytes)):
        return V.STRING
    return V.INT32


def _value(value: Any, vtype: V, item: V | None) -> bytes:
    if vtype is V.STRING:
        return _str(value)
    if vtype is V.ARRAY:
        items = value.tolist() if hasattr(value, "tolist") else list(value)
        item = _item_type(value, items) if item is None else item
        return struct.pack("<IQ", item, len(items)) + b"".join(_value(v, item, None) for v in items)
    if vtype is V.BOOL:
        return struct.pack("<B", int(bool(value)))
    fmt = SCALAR_FORMATS[vtype]
    if vtype in (V.FLOAT32, V.FLOAT64):
        with np.errstate(over="ignore"):
            return np.asarray(
                float(value), np.float32 if vtype is V.FLOAT32 else np.float64
            ).tobytes()
    bits = struct.calcsize(fmt) * 8
    return struct.pack(fmt.upper(), int(value) % (1 << bits))


def _type_id(ggml_type: GGMLType, magic: bytes) -> int:
    """The type id of this magic, or powerpy's own id where the magic has none (BF16 in PWRI)."""
    try:
        return file_type_id(ggml_type, magic)
    except ValueError:
        return int(ggml_type)


def write_raw(path: Path, d: Draft) -> None:
    """The draft as bytes, whatever it holds (values wrap, types and sizes are not checked)."""
    magic = b"PWRI" if d.sparse else b"GGUF"
    head = bytearray(magic + struct.pack("<IQQ", 3, len(d.tensors), len(d.kv)))
    for key, spec in d.kv.items():
        head += (
            _str(key)
            + struct.pack("<I", spec[1])
            + _value(spec[0], V(spec[1]), spec[2] if len(spec) > 2 else None)
        )
    al, off, blobs = d.layout_alignment, 0, []
    for t in d.tensors:
        ne = tuple(reversed(t.shape))
        tid = t.type_id if t.type_id is not None else _type_id(t.ggml_type, magic)
        head += (
            _str(t.name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        )
        head += struct.pack("<IQ", tid, off)
        blob = np.ascontiguousarray(t.data).tobytes()
        blobs.append(blob + bytes(-len(blob) % al))
        off += len(blobs[-1])
    head += bytes(-len(head) % al)
    path.write_bytes(bytes(head) + b"".join(blobs))


def write_draft(path: Path, d: Draft) -> None:
    """Write ``d`` with ``write_gguf``, or as raw bytes when it must or the writer refuses it."""
    if not d.raw:
        try:
            write_gguf(
                path,
                d.kv,
                [(t.name, t.data, t.ggml_type, t.shape) for t in d.tensors],
                magic=b"PWRI" if d.sparse else b"GGUF",
            )
        except ValueError:  # the writer refuses the mutation: write the bytes ourselves
            write_raw(path, d)
    else:
        write_raw(path, d)
    if d.cut:
        data = path.read_bytes()
        path.write_bytes(data[: max(0, len(data) - d.cut)])


# --- shared value pools ---------------------------------------------------------------------------
HP_KEYS = (
    Keys.EMBEDDING_LENGTH,
    Keys.BLOCK_COUNT,
    Keys.FEED_FORWARD_LENGTH,
    Keys.HEAD_COUNT,
    Keys.HEAD_COUNT_KV,
    Keys.ROPE_DIMENSION_COUNT,
    Keys.CONTEXT_LENGTH,
    Keys.VOCAB_SIZE,
)
FLOAT_KEYS = (Keys.ROPE_FREQ_BASE, Keys.RMS_EPS)
SPECIAL_KEYS = (Keys.BOS_ID, Keys.EOS_ID, Keys.UNK_ID, Keys.PAD_ID, Keys.EOT_ID)
FLAG_KEYS = (Keys.ADD_BOS, Keys.ADD_EOS, Keys.ADD_SPACE_PREFIX)
INTS = (0, 1, 2, 3, 5, 7, 31, 33, 64, 259, 4096, 2**31 - 1, 2**32 - 1, 2**40, 2**63, 2**64 - 1)
SIGNED = (-1, -2, -32, -(2**31), -(2**63))
FLOATS = (0.0, -0.0, -1.0, 1e-45, 1e-30, 0.5, 1.0, 1.5, 1e30, 3.4e38, math.inf, -math.inf, math.nan)
INT_TYPES = (V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64)


def pick(rng: np.random.Generator, seq: Any) -> Any:
    """One item of ``seq``, chosen by ``rng``."""
    return seq[int(rng.integers(len(seq)))]


def any_value(rng: np.random.Generator) -> tuple:
    """A random typed value of any kind (scalar, string, array, empty array)."""
    kind = int(rng.integers(7))
    if kind == 0:
        return (pick(rng, INTS), pick(rng, (V.UINT32, V.UINT64)))
    if kind == 1:
        return (pick(rng, SIGNED), pick(rng, (V.INT32, V.INT64, V.INT8)))
    if kind == 2:
        return (pick(rng, FLOATS), pick(rng, (V.FLOAT32, V.FLOAT64)))
    if kind == 3:
        return (pick(rng, ("", "llama", "\udcff", "x" * 300)), V.STRING)
    if kind == 4:
        return (bool(rng.integers(2)), V.BOOL)
    if kind == 5:
        n = int(rng.integers(0, 4))
        return (list(rng.integers(-5, 300, n)), V.ARRAY, pick(rng, (V.INT32, V.UINT32, V.INT64)))
    return ([], V.ARRAY, pick(rng, (V.INT32, V.FLOAT32, V.STRING, V.BOOL)))


def scalar_key(d: Draft, rng: np.random.Generator) -> str:
    """A scalar key of the model (hyperparameter, special token, flag or threshold)."""
    return d.key(
        pick(rng, HP_KEYS + FLOAT_KEYS + SPECIAL_KEYS + FLAG_KEYS + (Keys.SPARSE_THRESHOLD,))
    )
