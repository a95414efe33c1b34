"""HF checkpoint (LLaMA, Falcon, OPT) or dense GGUF + predictor directory -> PowerInfer (PWRI)
model file; an HF checkpoint without predictors -> a dense GGUF.

Layout (docs/formats.md#conversion, as PowerInfer's converters):

- HF input: each family's tensors map to GGUF names by its table in ``hf_families`` (LLaMA's
  ``q_proj``/``k_proj`` rows permuted from rotate-half order to ggml's interleaved pairs,
  Falcon's fused ``query_key_value`` reordered to q, k, v heads); GGUF input is already in
  GGUF layout.
- ``ffn_down_t = down_proj.T`` (contiguous, neuron-major), its bias ``ffn_down_t.bias``; dense
  GGUF ``ffn_down`` likewise.
- ``blk.{l}.fc1.weight`` / ``fc2.weight`` come from ``PREDICTOR_DIR/model_{l}.pt`` untransposed.
- ``powerinfer.sparse_threshold`` (FLOAT32) is written iff ``PREDICTOR_DIR/config.json`` has
  ``sparse_threshold``; ``powerpy.sparse_activation`` ("silu", "gelu") when the predictors were
  trained on magnitude labels of a model that is not ReLU (``config.json``:
  ``"sparse_activation"``).
- Types: ``f16`` (default) writes 2-D tensors as F16 and 1-D as F32; ``f32`` all F32;
  ``q8_0``/``q4_0``/``q4_1`` quantize 2-D tensors whose rows are whole 32-blocks (others F16).
  ``auto`` (GGUF sources) keeps every tensor's stored type and copies its blocks untouched; the
  transposed ``ffn_down_t`` of a quantized source is written as Q8_0 (one fine rounding of the
  decoded values) and the predictors as Q8_0.
- Tensor order: model tensors, then predictors. Magic ``PWRI``.

Tensors stream one at a time (HF shards through ``safetensors.safe_open`` or a memory-mapped
``torch.load``, GGUF through its memory map), so memory stays near the largest single tensor.
The output is written to a temporary file and renamed into place; an input is never
overwritten.
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
from powerpy.pipeline.hf_families import hf_family, plan_tensors
from powerpy.pipeline.hf_families import permute_qk as permute_qk  # re-exported
from powerpy.pipeline.hf_families import unpermute_qk as unpermute_qk
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
    """The sparse activation the file is marked with: "relu" (PowerInfer's), "silu" or "gelu".

    ``model_act`` is the source model's activation ("relu", "silu", "gelu", from its HF config),
    or None for a GGUF source, which carries none."""
    act = override or preds.activation
    if model_act is not None:
        if act is None and model_act != "relu":
            raise ValueError(
                f"{src}: the model's FFN activation is {model_act!r} but the predictor config "
                f'has no "sparse_activation": "{model_act}" marker; train predictors with '
                f"`powerpy train-predictors` or pass --activation {model_act}"
            )
        if act is not None and act != model_act:
            raise ValueError(
                f"{src}: the model's FFN activation is {model_act!r} but the predictors are "
                f"marked {act!r}"
            )
    return act or "relu"


def _sparse_kv(preds: Predictors, act: str) -> dict[str, tuple]:
    kv: dict[str, tuple] = {}
    if preds.threshold is not None:
        kv[Keys.SPARSE_THRESHOLD] = (float(preds.threshold), GGUFValueType.FLOAT32)
    if act != "relu":
        kv[Keys.SPARSE_ACTIVATION] = (act, GGUFValueType.STRING)
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
    vocab_pre: str | None = None,
    activation: str | None = None,
    name: str | None = None,
    progress: bool = False,
) -> Path:
    """Build a PowerInfer (PWRI) model file.

    Args:
        src: an HF checkpoint directory of a LLaMA, Mistral, Falcon or OPT model (config.json
            + safetensors or pytorch_model*.bin, BF16/F16/F32, sharded or not) or a dense GGUF
            file (in GGUF layout; a PWRI file is accepted too, its predictors are replaced).
        predictor_dir: ``model_{l}.pt`` per layer and an optional ``config.json``; None
            (HF sources only) writes a dense GGUF (magic ``GGUF``, ``ffn_down`` untransposed)
            to profile and train predictors on. A dense GGUF carries no activation: load a
            ReLU LLaMA's or Falcon's with ``ffn_act="relu"``.
        out: the output file; written atomically, and never one of the inputs.
        outtype: "f16" (default), "f32", "q8_0", "q4_0", "q4_1", or "auto" (GGUF sources: keep
            the stored types; see the module docstring).
        vocab_gguf: copy the tokenizer from this GGUF (HF sources; default: tokenizer.model,
            tokenizer.json or vocab.json + merges.txt of the checkpoint).
        vocab_pre: ``tokenizer.ggml.pre`` for a BPE vocabulary (default: the family's,
            "default" for LLaMA, "falcon", "gpt-2" for OPT).
        activation: override the predictors' ``sparse_activation`` ("relu", "silu" or "gelu",
            as the family runs).
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
    vocab_pre: str | None,
    activation: str | None,
    name: str | None,
    progress: bool,
) -> None:
    hf = HFSource(src)
    try:
        cfg_src = str(src / "config.json")
        fam = hf_family(hf.config, cfg_src)
        a = fam.args(hf.config, cfg_src)
        preds = None
        if pred_dir is not None:
            preds = scan_predictors(pred_dir, a.n_layer, a.n_embd, a.n_ff)
            act = _resolve_activation(preds, a.ffn_variant.activation, activation, src)
            a.with_ffn_act(act, source=cfg_src)  # one the family runs
        if vocab_gguf is not None:
            vocab = vocab_kv_from_gguf(vocab_gguf)
        else:
            vocab = vocab_kv_from_hf(src, hf.config, vocab_pre or fam.vocab_pre)
        n_tokens = len(vocab[Keys.TOKENS][0])
        if n_tokens != a.n_vocab:
            raise ValueError(
                f"tokenizer has {n_tokens} tokens but {src / 'config.json'} has vocab_size "
                f"{a.n_vocab}"
            )
        kv = a.to_gguf_kv(name=name or src.name)
        for key in fam.drop_keys:
            kv.pop(key.format(arch=a.arch), None)
        kv.update(fam.kv(hf.config, a))
        kv[Keys.FILE_TYPE] = (FILE_TYPES[outtype], GGUFValueType.UINT32)
        if preds is not None:
            kv.update(_sparse_kv(preds, act))
        kv.update(vocab)

        rows, tied = plan_tensors(fam, hf.config, a, hf.shapes, str(src))
        if tied is not None and not np.array_equal(hf.get(tied[0]), hf.get(tied[1])):
            raise ValueError(
                f"{src}: {tied[0]} differs from {tied[1]}, but a {fam.arch} model's output is "
                "tied to its embeddings (config.json tie_word_embeddings): not supported"
            )
        plan: list[_Tensor] = []
        for r in rows:
            gguf_name, shape, transpose = r.gguf, r.shape, False
            if preds is not None and ".ffn_down." in gguf_name:  # PWRI: ffn_down_t = down.T
                gguf_name = gguf_name.replace(".ffn_down.", ".ffn_down_t.")
                transpose = len(shape) == 2
                shape = shape[::-1]

            def load(r=r, transpose=transpose) -> np.ndarray:
                arr = hf.get(r.hf)
                if r.transform is not None:
                    arr = r.transform(arr, a)
                return np.ascontiguousarray(arr.T) if transpose else arr

            plan.append(_Tensor(gguf_name, shape, out_type(shape, outtype), load))
        if preds is None:
            if a.ffn_variant is not a.family.ffn_variant({}, False, str(src)):
                log.info(
                    "%s: a dense GGUF carries no activation: load it with ffn_act=%r",
                    out,
                    a.ffn_variant.activation,
                )
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
        args.with_ffn_act(act, source=str(src))  # one the family runs
        if act == "relu" and not gf.sparse and args.family.ffn_acts != ("relu",):
            log.warning(
                "%s: a dense GGUF carries no activation; the PWRI file will run ReLU (%s) "
                'FFNs. Mark SiLU or GELU predictors with "sparse_activation".',
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
    drop = re.compile(r"blk\.\d+\.fc[12]\.weight")  # a PWRI source's predictors: replaced
    for tname, info in gf.tensors.items():
        if drop.fullmatch(tname):
            continue
        shape = tuple(info.shape)
        if tname.endswith(".ffn_down.bias"):  # falcon, opt: the down matrix's bias, renamed

            def load_b(tname: str = tname) -> np.ndarray:
                return gf.dequantize(tname)

            yield _Tensor(tname.replace(".ffn_down.", ".ffn_down_t."), shape, GGMLType.F32, load_b)
        elif tname.endswith(".ffn_down.weight"):
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
