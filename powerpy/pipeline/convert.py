"""HF LLaMA-family checkpoint or dense GGUF + predictor directory -> PowerInfer (PWRI) model file.

Layout (docs/formats.md#conversion, as PowerInfer's ``convert.py``):

- HF input: ``q_proj``/``k_proj`` rows are permuted from HF rotate-half order to ggml's
  interleaved pairs (``n_head`` for q, ``n_head_kv`` for k); GGUF input is already permuted.
- ``ffn_down_t = down_proj.T`` (contiguous, neuron-major); dense GGUF ``ffn_down`` likewise.
- ``blk.{l}.fc1.weight`` / ``fc2.weight`` come from ``PREDICTOR_DIR/model_{l}.pt`` untransposed.
- ``powerinfer.sparse_threshold`` (FLOAT32) is written iff ``PREDICTOR_DIR/config.json`` has
  ``sparse_threshold``; ``powerpy.sparse_activation = "silu"`` when the predictors were trained
  on magnitude labels of a SiLU model (``config.json``: ``"sparse_activation": "silu"``).
- Types: ``f16`` (default) writes 2-D tensors as F16 and 1-D as F32; ``f32`` all F32;
  ``q8_0``/``q4_0``/``q4_1`` quantize 2-D tensors whose rows are whole 32-blocks (others F16).
  ``auto`` (GGUF sources) keeps every tensor's stored type and copies its blocks untouched; the
  transposed ``ffn_down_t`` of a quantized source is written as Q8_0 (one fine rounding of the
  decoded values) and the predictors as Q8_0.
- Tensor order: model tensors, then predictors. Magic ``PWRI``.

Tensors stream one at a time (HF shards through ``safetensors.safe_open``, GGUF through its
memory map), so memory stays near the largest single tensor. The output is written to a
temporary file and renamed into place; an input is never overwritten.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from powerpy.config import ACTIVATIONS, FFNVariant, ModelArgs
from powerpy.formats import quants
from powerpy.formats.constants import (
    GGUF_MAGIC,
    PWRI_MAGIC,
    GGMLType,
    GGUFValueType,
    Keys,
    Names,
)
from powerpy.formats.gguf_reader import GGUFFile, read_gguf
from powerpy.formats.gguf_writer import GGUFStreamWriter
from powerpy.pipeline.hf import HFSource, vocab_kv_from_gguf, vocab_kv_from_hf
from powerpy.pipeline.predictors import (
    PREDICTOR_KEYS,
    Predictors,
    load_predictor_file,
    scan_predictors,
)

log = logging.getLogger(__name__)

OUTTYPES = {
    "f32": GGMLType.F32,
    "f16": GGMLType.F16,
    "q8_0": GGMLType.Q8_0,
    "q4_0": GGMLType.Q4_0,
    "q4_1": GGMLType.Q4_1,
}
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_*
AUTO = "auto"  # GGUF sources: every tensor keeps its type (see the module docstring)

_HF_SKIP = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


# ----------------------------------------------------------------------------------- maths
def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> ggml interleaved pairs, per head (llama.cpp's permute).

    Within each head of ``d`` rows, new row ``2m`` = old row ``m`` and new row ``2m+1`` = old row
    ``m + d/2``: w (n_head * d, n_embd) -> same shape.
    """
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ValueError(f"cannot permute {rows} rows into {n_head} heads of even size")
    d = rows // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk` (ggml interleaved -> HF rotate-half)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------------- output
@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy shape
    ggml_type: GGMLType
    load: Callable[[], np.ndarray]  # float32 values of `shape`
    raw: Callable[[], np.ndarray] | None = None  # the stored bytes, copied as they are


def out_type(shape: tuple[int, ...], outtype: str) -> GGMLType:
    """The stored type of a tensor: 1-D -> F32; 2-D -> the outtype (F16 if rows are not blocks)."""
    if len(shape) == 1 or outtype == "f32":
        return GGMLType.F32
    t = OUTTYPES[outtype]
    if t in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1) and shape[-1] % 32:
        return GGMLType.F16
    return t


def _requant_type(source: GGMLType, shape: tuple[int, ...]) -> GGMLType:
    """``auto``: the type of a transposed copy of a ``source``-typed tensor.

    Floats keep their type. Quantized values become Q8_0: rounding them again to a 4-bit type
    stacks a second rounding error (SmolLM2's ffn_down to Q4_1 and back: +6% perplexity);
    Q8_0's step is ~1/16 of a 4-bit block's, and F16 (rows whose length is not whole blocks)
    keeps every value.
    """
    if source in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        return source
    return GGMLType.Q8_0 if shape[-1] % 32 == 0 else GGMLType.F16


def _encode(t: _Tensor) -> np.ndarray:
    if t.raw is not None:
        return np.asarray(t.raw(), dtype=np.uint8).reshape(-1)
    arr = np.asarray(t.load(), dtype=np.float32)
    if arr.shape != t.shape:
        raise ValueError(f"tensor {t.name!r}: produced shape {arr.shape}, expected {t.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"tensor {t.name!r} holds values that are not finite")
    return quants.quantize(arr, t.ggml_type).reshape(-1)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _write_stream(
    path: Path,
    kv: Mapping[str, tuple],
    plan: list[_Tensor],
    *,
    progress: bool,
    magic: bytes = PWRI_MAGIC,
) -> None:
    """Write a PWRI (or GGUF) file tensor by tensor (only one tensor in memory), atomically."""
    table = [(t.name, t.shape, t.ggml_type) for t in plan]
    with GGUFStreamWriter(path, kv, table, magic=magic) as w:
        for t in tqdm(plan, desc="convert", unit="tensor", disable=not progress):
            w.write(t.name, _encode(t).view(np.uint8), t.shape)


def _predictor_tensors(preds: Predictors, outtype: str) -> list[_Tensor]:
    out = []
    for l, path in enumerate(preds.files):
        for key, template in zip(PREDICTOR_KEYS, (Names.FC1, Names.FC2), strict=True):

            def load(path: Path = path, key: str = key) -> np.ndarray:
                return load_predictor_file(path, mmap=True)[key].float().numpy()

            shape = tuple(load_predictor_file(path, mmap=True)[key].shape)
            if outtype == AUTO:  # Q8_0: the shipped int8 rows cost 1/2 of F16 per token
                t = out_type(shape, "q8_0")
            else:
                t = out_type(shape, outtype)
            out.append(_Tensor(template.format(l=l), shape, t, load))
    return out


def _resolve_activation(
    preds: Predictors, model_act: str | None, override: str | None, src: Path
) -> str:
    """The sparse activation the file is marked with: "relu" (PowerInfer's) or "silu".

    ``model_act`` is the source model's activation ("relu"/"silu", from its HF config), or None
    for a GGUF source, which carries none."""
    act = override or preds.activation
    if model_act is not None:
        if act is None and model_act == "silu":
            raise ValueError(
                f"{src}: the model uses SiLU (hidden_act {model_act!r}) but the predictor config "
                'has no "sparse_activation": "silu" marker; train predictors with '
                "`powerpy train-predictors` or pass --activation silu"
            )
        if act is not None and act != model_act:
            raise ValueError(
                f"{src}: hidden_act {model_act!r} but the predictors are marked {act!r}"
            )
    return act or "relu"


def _sparse_kv(preds: Predictors, act: str) -> dict[str, tuple]:
    kv: dict[str, tuple] = {}
    if preds.threshold is not None:
        kv[Keys.SPARSE_THRESHOLD] = (float(preds.threshold), GGUFValueType.FLOAT32)
    if act == "silu":
        kv[Keys.SPARSE_ACTIVATION] = ("silu", GGUFValueType.STRING)
    if preds.dense_layers:
        layers = list(preds.dense_layers)
        kv[Keys.DENSE_LAYERS] = (layers, GGUFValueType.ARRAY, GGUFValueType.UINT32)
    if any(preds.down_thresholds):
        cuts = list(preds.down_thresholds)
        kv[Keys.FFN_DOWN_THRESHOLD] = (cuts, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    return kv


def convert(
    src: str | os.PathLike[str],
    predictor_dir: str | os.PathLike[str] | None,
    out: str | os.PathLike[str],
    *,
    outtype: str = "f16",
    vocab_gguf: str | os.PathLike[str] | None = None,
    vocab_pre: str = "default",
    activation: str | None = None,
    name: str | None = None,
    progress: bool = False,
) -> Path:
    """Build a PowerInfer (PWRI) model file.

    Args:
        src: an HF LLaMA-family checkpoint directory (config.json + safetensors, BF16/F16/F32,
            sharded or not) or a dense GGUF file (already q/k-permuted; a PWRI file is accepted
            too, its predictors are replaced).
        predictor_dir: ``model_{l}.pt`` per layer and an optional ``config.json``; None
            (HF sources only) writes a dense GGUF (magic ``GGUF``, ``ffn_down`` untransposed)
            to profile and train predictors on. A dense GGUF carries no activation: load a
            ReLU model's with ``ffn_act="relu"``.
        out: the output file; written atomically, and never one of the inputs.
        outtype: "f16" (default), "f32", "q8_0", "q4_0", "q4_1", or "auto" (GGUF sources: keep
            the stored types; see the module docstring).
        vocab_gguf: copy the tokenizer from this GGUF (HF sources; default: tokenizer.model or
            tokenizer.json of the checkpoint).
        vocab_pre: ``tokenizer.ggml.pre`` for a tokenizer.json BPE vocabulary.
        activation: override the predictors' ``sparse_activation`` ("relu" or "silu").
        name: ``general.name`` (default: the source's name).
        progress: show a progress bar.

    Returns:
        The output path.

    Raises:
        FileNotFoundError: a missing input.
        ValueError: unsupported source, mismatched predictors (file and numbers named), an
            output that is an input, a bad outtype or activation.
    """
    src_p, out_p = Path(src), Path(out)
    pred_p = None if predictor_dir is None else Path(predictor_dir)
    if outtype not in (*OUTTYPES, AUTO):
        raise ValueError(f"outtype {outtype!r} is not one of {(*OUTTYPES, AUTO)}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    if not src_p.exists():
        raise FileNotFoundError(f"source {src_p} does not exist")
    if out_p.is_dir():
        raise IsADirectoryError(f"output {out_p} is a directory")
    inputs = [src_p, Path(vocab_gguf)] if vocab_gguf else [src_p]
    for d in (src_p, pred_p):
        if d is not None and d.is_dir():
            inputs += [f for f in d.iterdir() if f.is_file()]
    for p in inputs:
        if _same_file(out_p, p):
            raise ValueError(f"output {out_p} would overwrite the input {p}")
    if not out_p.parent.is_dir():
        raise FileNotFoundError(f"cannot write {out_p}: directory {out_p.parent} does not exist")

    if src_p.is_dir():
        outtype = "f16" if outtype == AUTO else outtype  # HF weights are floats
        _convert_hf(
            src_p, pred_p, out_p, outtype, vocab_gguf, vocab_pre, activation, name, progress
        )
    elif pred_p is None:
        raise ValueError(f"{src_p} is already a GGUF file: give a predictor directory")
    else:
        _convert_gguf(src_p, pred_p, out_p, outtype, activation, name, progress)
    log.debug("wrote %s", out_p)
    return out_p


def _convert_hf(
    src: Path,
    pred_dir: Path | None,
    out: Path,
    outtype: str,
    vocab_gguf: str | os.PathLike[str] | None,
    vocab_pre: str,
    activation: str | None,
    name: str | None,
    progress: bool,
) -> None:
    hf = HFSource(src)
    try:
        a = ModelArgs.from_hf_config(hf.config, source=str(src / "config.json"))
        preds = None
        if pred_dir is not None:
            preds = scan_predictors(pred_dir, a.n_layer, a.n_embd, a.n_ff)
            act = _resolve_activation(preds, a.ffn_variant.activation, activation, src)
        if vocab_gguf is not None:
            vocab = vocab_kv_from_gguf(vocab_gguf)
        else:
            vocab = vocab_kv_from_hf(src, hf.config, vocab_pre)
        n_tokens = len(vocab[Keys.TOKENS][0])
        if n_tokens != a.n_vocab:
            raise ValueError(
                f"tokenizer has {n_tokens} tokens but {src / 'config.json'} has vocab_size "
                f"{a.n_vocab}"
            )
        kv = a.to_gguf_kv(name=name or src.name)
        kv[Keys.FILE_TYPE] = (FILE_TYPES[outtype], GGUFValueType.UINT32)
        if preds is not None:
            kv.update(_sparse_kv(preds, act))
        kv.update(vocab)

        plan: list[_Tensor] = []
        known = set()

        def add(
            hf_name: str,
            gguf_name: str,
            expect: tuple[int, ...],
            n_head: int = 0,
            transpose: bool = False,
        ) -> None:
            """Plan one tensor: permute q/k rows for ``n_head`` heads, or transpose."""
            if hf_name not in hf.shapes:
                raise ValueError(f"{src}: tensor {hf_name!r} is missing")
            if hf.shapes[hf_name] != expect:
                raise ValueError(
                    f"{src}: tensor {hf_name!r} has shape {hf.shapes[hf_name]}, expected {expect}"
                )
            known.add(hf_name)

            def load() -> np.ndarray:
                arr = hf.get(hf_name)
                if n_head:
                    arr = permute_qk(arr, n_head)
                return np.ascontiguousarray(arr.T) if transpose else arr

            shape = expect[::-1] if transpose else expect
            plan.append(_Tensor(gguf_name, shape, out_type(shape, outtype), load))

        d, ff, gqa, nv = a.n_embd, a.n_ff, a.n_embd_gqa, a.n_vocab
        nh, nkv = a.n_head, a.n_head_kv
        add("model.embed_tokens.weight", Names.TOKEN_EMBD, (nv, d))
        for l in range(a.n_layer):
            p = f"model.layers.{l}."
            add(p + "input_layernorm.weight", Names.ATTN_NORM.format(l=l), (d,))
            add(p + "self_attn.q_proj.weight", Names.ATTN_Q.format(l=l), (d, d), n_head=nh)
            add(p + "self_attn.k_proj.weight", Names.ATTN_K.format(l=l), (gqa, d), n_head=nkv)
            add(p + "self_attn.v_proj.weight", Names.ATTN_V.format(l=l), (gqa, d))
            add(p + "self_attn.o_proj.weight", Names.ATTN_OUTPUT.format(l=l), (d, d))
            add(p + "post_attention_layernorm.weight", Names.FFN_NORM.format(l=l), (d,))
            add(p + "mlp.gate_proj.weight", Names.FFN_GATE.format(l=l), (ff, d))
            add(p + "mlp.up_proj.weight", Names.FFN_UP.format(l=l), (ff, d))
            if preds is None:  # dense GGUF: ggml's ffn_down (n_embd, n_ff)
                add(p + "mlp.down_proj.weight", Names.FFN_DOWN.format(l=l), (d, ff))
            else:
                down_t = Names.FFN_DOWN_T.format(l=l)
                add(p + "mlp.down_proj.weight", down_t, (d, ff), transpose=True)
        add("model.norm.weight", Names.OUTPUT_NORM, (d,))
        if "lm_head.weight" in hf.shapes:
            add("lm_head.weight", Names.OUTPUT, (nv, d))
        left = sorted(k for k in hf.shapes if k not in known and not _HF_SKIP.fullmatch(k))
        if left:
            raise ValueError(
                f"{src}: {len(left)} tensors are not part of a LLaMA model, e.g. {left[:3]}"
            )
        if preds is None:
            if a.ffn_variant.activation == "relu":
                log.info("%s: a dense GGUF carries no activation: load it with ffn_act='relu'", out)
            _write_stream(out, kv, plan, progress=progress, magic=GGUF_MAGIC)
        else:
            plan += _predictor_tensors(preds, outtype)
            _write_stream(out, kv, plan, progress=progress)
    finally:
        hf.close()


def _convert_gguf(
    src: Path,
    pred_dir: Path,
    out: Path,
    outtype: str,
    activation: str | None,
    name: str | None,
    progress: bool,
) -> None:

    with read_gguf(src) as gf:
        args = ModelArgs.from_gguf(gf)
        preds = scan_predictors(pred_dir, args.n_layer, args.n_embd, args.n_ff)
        act = _resolve_activation(preds, None, activation, src)
        if act == "relu" and not gf.sparse and args.family.ffn_acts != ("relu",):
            log.warning(
                "%s: a dense GGUF carries no activation; the PWRI file will run ReLU (%s) "
                'FFNs. Mark SiLU predictors with "sparse_activation": "silu".',
                src,
                FFNVariant.of("relu", args.family.gated).value,
            )
        kv: dict[str, tuple] = {}
        for key, spec in gf.typed_kv().items():
            if key in (Keys.SPARSE_THRESHOLD, Keys.SPARSE_ACTIVATION):
                continue
            if key == Keys.FILE_TYPE and outtype != AUTO:
                spec = (FILE_TYPES[outtype], GGUFValueType.UINT32)
            if key == Keys.NAME and name is not None:
                spec = (name, GGUFValueType.STRING)
            kv[key] = spec
        if outtype != AUTO:
            kv.setdefault(Keys.FILE_TYPE, (FILE_TYPES[outtype], GGUFValueType.UINT32))
        kv.update(_sparse_kv(preds, act))
        plan = list(_gguf_tensors(gf, outtype))
        plan += _predictor_tensors(preds, outtype)
        _write_stream(out, kv, plan, progress=progress)


def _gguf_tensors(gf: GGUFFile, outtype: str) -> Iterator[_Tensor]:
    drop = re.compile(r"blk\.\d+\.fc[12]\.weight|" + re.escape(Names.ROPE_FREQS))
    for tname, info in gf.tensors.items():
        if drop.fullmatch(tname):
            continue
        shape = tuple(info.shape)
        if tname.endswith(".ffn_down.bias"):  # PowerInfer names the down bias after ffn_down_t
            tname_out = tname.replace(".ffn_down.bias", ".ffn_down_t.bias")

            def load_b(tname: str = tname) -> np.ndarray:
                return gf.dequantize(tname)

            yield _Tensor(tname_out, shape, GGMLType.F32, load_b)
            continue
        if tname.endswith(".ffn_down.weight"):
            new = tname.replace(".ffn_down.weight", ".ffn_down_t.weight")
            shape_t = shape[::-1]

            def load_t(tname: str = tname) -> np.ndarray:
                return np.ascontiguousarray(gf.dequantize(tname).T)

            if outtype == AUTO:
                t = _requant_type(info.ggml_type, shape_t)
            else:
                t = out_type(shape_t, outtype)
            yield _Tensor(new, shape_t, t, load_t)
        else:

            def load(tname: str = tname) -> np.ndarray:
                return gf.dequantize(tname)

            if outtype == AUTO:  # the stored blocks, untouched

                def raw(tname: str = tname) -> np.ndarray:
                    return gf.raw(tname)

                yield _Tensor(tname, shape, info.ggml_type, load, raw)
            else:
                yield _Tensor(tname, shape, out_type(shape, outtype), load)
