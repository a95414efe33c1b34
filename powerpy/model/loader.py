"""File -> (ModelArgs, Weights): the only place that turns GGUF tensors into runtime weights.

Float tensors stay views of the file's bytes (no copy), which are mapped or read into memory
(``read_gguf``'s ``in_memory``). Quantized matrices (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K) keep their raw blocks, as views too, when the CPU kernels are available, so resident
memory stays close to the file size. Without the kernels they are dequantized once, at
load, to f16 (their values need at most 11 significant bits plus the block scales). A dense
file's ``ffn_down`` stays as stored, seen neuron-major through ``TransposedWeight``.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch
from tqdm.auto import tqdm

from powerpy.config import ModelArgs
from powerpy.errors import FileFormatError, ModelConfigError
from powerpy.formats import quants
from powerpy.formats.constants import GGMLType, Names
from powerpy.formats.gguf_reader import GGUFFile
from powerpy.model.ffn import cut_taus
from powerpy.model.kernels import QUANT_TYPES
from powerpy.model.matrices import DenseWeight, QuantWeight, TransposedWeight, Weight
from powerpy.model.transformer import Block, Weights

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("auto", "f32", "raw")
_FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
F16_MAX = 65504.0


def _torch_view(arr: np.ndarray) -> torch.Tensor:
    # Read-only file bytes are shared, never written: silence torch's non-writable warning.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def raw_supported() -> bool:
    """Whether quantized matrices can be computed without dequantizing them at load: the
    native kernels are built, and the running call's numerics use them."""
    try:
        from powerpy.model import kernels
    except ImportError:
        return False
    return kernels.library() is not None


class _TensorSource:
    """Reads named tensors of one file with shape checks and a chosen weight format."""

    def __init__(self, gf: GGUFFile, weight_format: str) -> None:
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight format {weight_format!r} is not one of {WEIGHT_FORMATS}")
        self.gf = gf
        self.keep_raw = weight_format == "raw" or (weight_format == "auto" and raw_supported())
        self.f32 = weight_format == "f32"

    def info(self, name: str, shape: tuple[int, ...]):
        t = self.gf.tensors.get(name)
        if t is None:
            raise FileFormatError(
                f"{self.gf.path}: tensor {name!r} is missing; the file is incomplete or its "
                "block_count is wrong: re-convert the model"
            )
        if tuple(t.shape) != tuple(shape):
            raise ModelConfigError(
                f"{self.gf.path}: tensor {name!r} has shape {tuple(t.shape)}, but the "
                f"hyperparameters need {shape}; the file's keys and tensors disagree: "
                "re-convert the model"
            )
        if t.ggml_type not in quants.SUPPORTED_TYPES:
            raise FileFormatError(
                f"{self.gf.path}: tensor {name!r} has type {t.ggml_type.name}, which powerpy "
                "cannot compute with; re-convert the model with a supported type"
            )
        return t

    def vector(self, name: str, n: int) -> torch.Tensor:
        self.info(name, (n,))
        return torch.from_numpy(np.array(self.gf.dequantize(name), dtype=np.float32))

    def matrix(self, name: str, shape: tuple[int, int]) -> Weight:
        t = self.info(name, shape)
        if t.ggml_type in _FLOAT_TYPES and not self.f32:
            if t.ggml_type == GGMLType.BF16:
                raw = self.gf.raw(name).view(np.int16).reshape(shape)
                return DenseWeight(_torch_view(raw).view(torch.bfloat16))
            return DenseWeight(_torch_view(self.gf.array(name)))
        if t.ggml_type in QUANT_TYPES and self.keep_raw:
            return QuantWeight(_torch_view(self.gf.raw(name)), t.ggml_type, shape[1])
        return DenseWeight(self._dequantized(name))

    def transposed(self, name: str, shape: tuple[int, int]) -> Weight:
        """A matrix stored as ``shape``, seen transposed (dense files' ffn_down), not copied."""
        return TransposedWeight(self.matrix(name, shape))

    def _dequantized(self, name: str) -> torch.Tensor:
        """A quantized matrix as f16 (f32 with weight_format "f32" or values beyond f16)."""
        w = self.gf.dequantize(name)  # f32
        if not self.f32 and float(np.abs(w).max(initial=0.0)) < F16_MAX:
            w = w.astype(np.float16)
        return torch.from_numpy(np.ascontiguousarray(w))


def check_tensor_sizes(gf: GGUFFile) -> None:
    """Each tensor's bytes (from its type and shape) must fill its slot up to the next tensor.

    Writers pack tensors at aligned offsets, so a type or shape that disagrees with the data
    (F32 bytes labelled Q4_0, a wrong dimension) leaves a gap the reader cannot see as overlap.

    Raises:
        FileFormatError: the first tensor whose slot is larger than its padded size.
    """
    size = gf.path.stat().st_size
    spans = sorted((t.offset, t.nbytes, t.name) for t in gf.tensors.values())
    nexts = [off for off, _, _ in spans[1:]] + [size]
    for (off, nbytes, name), nxt in zip(spans, nexts, strict=True):
        padded = -(-nbytes // gf.alignment) * gf.alignment
        if nxt - off > padded:
            t = gf.tensors[name]
            raise FileFormatError(
                f"{gf.path}: tensor {name!r} ({t.ggml_type.name}, shape {t.shape}) takes "
                f"{nbytes} bytes, but {nxt - off} bytes lie before the next tensor or the end "
                "of the file: its type or shape does not match its data (e.g. F32 data "
                "labelled Q4_0); re-convert the model"
            )


def load_weights(
    gf: GGUFFile, args: ModelArgs, *, weight_format: str = "auto", progress: bool = False
) -> Weights:
    """Build the runtime weights of a model from an open GGUF/PWRI file: the per-layer tensors
    its family declares (``args.family.block``), the FFN's down matrix and predictors in the
    dense or the PWRI layout, and the embedding, output norm and (untied) output.

    Args:
        gf: the open file (its memory map must outlive the weights).
        args: hyperparameters from the same file.
        weight_format: "auto" (floats as stored, quantized types raw when the kernels exist,
            else f16), "f32" (dequantize everything to f32) or "raw".
        progress: show a progress bar over the layers.

    Raises:
        FileFormatError: a tensor is missing, of an unusable type, or its data does not match
            its type and shape; a PWRI file lacks predictors.
        ModelConfigError: a tensor's shape disagrees with the hyperparameters.
    """
    src = _TensorSource(gf, weight_format)
    check_tensor_sizes(gf)
    fam, d, ff = args.family, args.n_embd, args.n_ff
    token_embd = src.matrix(Names.TOKEN_EMBD, (args.n_vocab, d))
    output = token_embd
    if Names.OUTPUT in gf.tensors or not fam.tied_output:
        output = src.matrix(Names.OUTPUT, (args.n_vocab, d))
    blocks, cuts = [], args.down_thresholds
    for l in tqdm(range(args.n_layer), desc="loading", unit="layer", disable=not progress):
        fields: dict = {}
        for t in fam.block:
            shape = tuple(getattr(args, dim) for dim in t.shape)
            name = t.name.format(l=l)
            fields[t.field] = (
                src.vector(name, *shape) if len(shape) == 1 else src.matrix(name, shape)
            )
        fc1 = fc2 = None
        if args.sparse:
            n1, n2 = Names.FC1.format(l=l), Names.FC2.format(l=l)
            if n1 not in gf.tensors or n2 not in gf.tensors:
                raise FileFormatError(
                    f"{gf.path}: PWRI model lacks predictor {n1!r}/{n2!r}; "
                    "rebuild it with `powerpy convert MODEL PREDICTOR_DIR`"
                )
            h = gf.tensors[n1].shape[0]
            fc1, fc2 = src.matrix(n1, (h, d)), src.matrix(n2, (ff, h))
        if Names.FFN_DOWN_T.format(l=l) in gf.tensors:
            down_t = src.matrix(Names.FFN_DOWN_T.format(l=l), (ff, d))
        else:
            down_t = src.transposed(Names.FFN_DOWN.format(l=l), (d, ff))
        blocks.append(
            Block(
                **fields,
                ffn_down_t=down_t,
                fc1=fc1,
                fc2=fc2,
                gated=l not in args.dense_layers,
                down_tau=cut_taus(down_t, cuts[l]) if cuts and cuts[l] > 0 else None,
            )
        )
    return Weights(
        token_embd=token_embd,
        output_norm=src.vector(Names.OUTPUT_NORM, d),
        output=output,
        blk=blocks,
    )
