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

from powerpy._fs import release_free_heap
from powerpy.config import ModelArgs
from powerpy.errors import FileFormatError, ModelConfigError
from powerpy.families import Rope
from powerpy.formats import quants
from powerpy.formats.constants import GGMLType, Keys, Names, bias_name
from powerpy.formats.gguf_reader import GGUFFile
from powerpy.model.biased import BiasedWeight, row_slices
from powerpy.model.ffn import cut_taus, row_norms
from powerpy.model.kernels import QUANT_TYPES
from powerpy.model.kernels import VARIANTS as kernel_variants
from powerpy.model.matrices import DenseWeight, QuantWeight, TransposedWeight, Weight
from powerpy.model.mla import latent
from powerpy.model.moe import Experts, Routing
from powerpy.model.tensor_checks import check_foreign, check_part
from powerpy.model.weights import Block, Weights

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

    def info(self, name: str, shape: tuple[int, ...], dims: tuple[str, ...] | None = None):
        t = self.gf.tensors.get(name)
        want = shape if dims is None else f"({', '.join(dims)}) = {shape}"
        if t is None:
            raise FileFormatError(
                f"{self.gf.path}: tensor {name!r} is missing; the file is incomplete or its "
                f"block_count is wrong (it needs shape {want}): re-convert the model"
            )
        if tuple(t.shape) != tuple(shape):
            raise ModelConfigError(
                f"{self.gf.path}: tensor {name!r} has shape {tuple(t.shape)}, but the "
                f"hyperparameters need {want}; the file's keys and tensors disagree: "
                "re-convert the model"
            )
        if t.ggml_type not in quants.SUPPORTED_TYPES:
            raise FileFormatError(
                f"{self.gf.path}: tensor {name!r} has type {t.ggml_type.name}, which powerpy "
                "cannot compute with; re-convert the model with a supported type"
            )
        return t

    def vector(self, name: str, n: int, dims: tuple[str, ...] | None = None) -> torch.Tensor:
        """A 1-D tensor (a norm, a bias, RoPE factors, a gate's row) as f32, checked finite (it
        is small). A (1, n) tensor is one too: llama.cpp's loader takes it (converters that do
        not squeeze a (1, n) checkpoint weight write one)."""
        t = self.gf.tensors.get(name)
        self.info(name, (1, n) if t is not None and tuple(t.shape) == (1, n) else (n,), dims)
        return self.finite(name, (n,))

    def finite(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A small tensor (its shape checked) as f32 of ``shape``, refused when not finite."""
        v = torch.from_numpy(np.array(self.gf.dequantize(name), dtype=np.float32).reshape(shape))
        if not bool(torch.isfinite(v).all()):
            raise FileFormatError(
                f"{self.gf.path}: tensor {name!r} holds NaN or infinite values; the file is "
                "corrupt: re-convert the model"
            )
        return v

    def matrix(
        self, name: str, shape: tuple[int, int], dims: tuple | None = None, gathered: bool = False
    ) -> Weight:
        """A 2-D tensor of ``shape`` (named ``dims`` in errors) in the chosen weight format;
        ``gathered``: a sparse FFN also reads its rows one by one (``QuantWeight``)."""
        t = self.info(name, shape, dims)
        if t.ggml_type in _FLOAT_TYPES and not self.f32:
            if t.ggml_type == GGMLType.BF16:
                raw = self.gf.raw(name).view(np.int16).reshape(shape)
                return DenseWeight(_torch_view(raw).view(torch.bfloat16))
            return DenseWeight(_torch_view(self.gf.array(name)))
        if t.ggml_type in QUANT_TYPES and self.keep_raw:
            raw = _torch_view(self.gf.raw(name))
            return QuantWeight(raw, t.ggml_type, shape[1], gathered, pages=self.gf.pages)
        return DenseWeight(self._dequantized(name))

    def stack(self, name: str, shape: tuple[int, int, int], dims: tuple[str, ...]) -> Weight:
        """A 3-D stack of matrices (experts) as one ``(shape[0] · shape[1], shape[2])`` matrix
        over the file's bytes (a view; quantized blocks raw when the kernels run)."""
        t = self.info(name, shape, dims)
        rows = (shape[0] * shape[1], shape[2])
        if t.ggml_type in _FLOAT_TYPES and not self.f32:
            if t.ggml_type == GGMLType.BF16:
                raw = self.gf.raw(name).view(np.int16).reshape(rows)
                return DenseWeight(_torch_view(raw).view(torch.bfloat16))
            return DenseWeight(_torch_view(self.gf.array(name).reshape(rows)))
        if t.ggml_type in QUANT_TYPES and self.keep_raw:
            raw = _torch_view(self.gf.raw(name))
            return QuantWeight(raw, t.ggml_type, shape[2], pages=self.gf.pages)
        return DenseWeight(self._dequantized(name).reshape(rows))

    def transposed(self, name: str, shape: tuple[int, int]) -> Weight:
        """A matrix stored as ``shape``, seen transposed (dense files' ffn_down), not copied."""
        return TransposedWeight(self.matrix(name, shape))

    def _dequantized(self, name: str) -> torch.Tensor:
        """A quantized matrix as f16 (f32 with weight_format "f32" or values beyond f16)."""
        w = self.gf.dequantize(name)  # f32
        if not self.f32 and float(np.abs(w).max(initial=0.0)) < F16_MAX:
            w = w.astype(np.float16)
        return torch.from_numpy(np.ascontiguousarray(w))


def load_weights(
    gf: GGUFFile,
    args: ModelArgs,
    *,
    weight_format: str = "auto",
    progress: bool = False,
    ends: tuple[bool, bool] = (True, True),
) -> Weights:
    """Build the runtime weights of a model from an open GGUF/PWRI file: the per-layer tensors
    its family declares (``args.family.block``) with their biases, the FFN's down matrix and
    predictors in the dense or the PWRI layout, and the embeddings, output norm and (untied)
    output. A fused ``attn_qkv`` becomes row views ``attn_q``, ``attn_k``, ``attn_v``. The
    file's data sizes are ``gguf_reader.check_tensor_sizes``' to check, before.

    Args:
        gf: the open file (its memory map must outlive the weights), or a pipeline stage's view
            of one (``powerpy.cluster``).
        args: hyperparameters from the same file.
        weight_format: "auto" (floats as stored, quantized types raw when the kernels exist,
            else f16), "f32" (dequantize everything to f32) or "raw".
        progress: show a progress bar over the layers.
        ends: (the embeddings, the output norm and head): a stage without them has None there.

    Raises:
        FileFormatError: a tensor is missing or of an unusable type; a PWRI file lacks
            predictors.
        ModelConfigError: a tensor's shape disagrees with the hyperparameters, or the file
            holds a tensor or bias its family does not have (say ``ffn_gate`` in a falcon file).
    """
    src, (embed, head) = _TensorSource(gf, weight_format), ends
    fam, d, ff = args.family, args.n_embd, args.n_ff
    check_foreign(gf, fam, args)
    tied = Names.OUTPUT not in gf.tensors and fam.tied_output
    token_embd = output = None
    if embed or (head and tied):  # a later stage's tied head: output alone (no embedding)
        table = src.matrix(Names.TOKEN_EMBD, (args.n_vocab, d))
        token_embd, output = (table if embed else None), table
    if head and not tied:
        output = src.matrix(Names.OUTPUT, (args.n_vocab, d))
        rule = "required" if fam.output_bias else "none"  # added to the logits (phi2)
        output = _with_bias(output, _bias(src, Names.OUTPUT, args.n_vocab, rule))
    output = output if head else None
    position_embd = None
    if fam.rope is Rope.LEARNED and embed:
        pe, off = gf.tensors.get(Names.POS_EMBD), fam.position_offset
        rows = pe.shape[0] if pe is not None and len(pe.shape) == 2 else args.n_ctx_train + off
        if rows - off < args.n_ctx_train:
            raise ModelConfigError(
                f"{gf.path}: tensor {Names.POS_EMBD!r} holds {rows} rows, but {fam.arch} reads "
                f"position p at row p + {off}, so {args.n_ctx_train} positions need "
                f"{args.n_ctx_train + off}: re-convert the model"
            )
        position_embd = src.matrix(Names.POS_EMBD, (rows, d))
    blocks, cuts, moe = [], args.down_thresholds, args.moe  # a MoE's cut: in its experts
    for l in tqdm(range(args.n_layer), desc="loading", unit="layer", disable=not progress):
        fields: dict = {"ffn_gate": None, "ffn_norm": None}
        moe_layer = args.layer_moe(l)  # the experts replace the dense FFN
        for t in fam.layer_block(moe_layer):
            name = t.name.format(l=l)
            if t.part_of:
                check_part(gf, fam, t, l, t.part_of in fields)
                if t.part_of in fields:
                    continue  # a row view of the fused matrix (below)
            if name not in gf.tensors and (t.optional or fam.has_parts(t.field)):
                continue  # absent: None, or the parts are read instead
            shape = tuple(getattr(args, dim) for dim in t.shape)
            if len(shape) == 1:
                fields[t.field] = src.vector(name, *shape, t.shape)
                bias = _bias(src, name, shape[0], t.bias)
                if bias is not None:
                    fields[t.field + "_b"] = bias
            elif len(shape) == 3:  # per head (deepseek2's attn_k_b, attn_v_b)
                fields[t.field] = src.stack(name, shape, t.shape)  # type: ignore[arg-type]
            else:  # a sparse file's gate and up are gathered row by row
                gathered = args.sparse and t.field in ("ffn_gate", "ffn_up")
                fields[t.field] = _with_bias(
                    src.matrix(name, shape, t.shape, gathered), _bias(src, name, shape[0], t.bias)
                )
        for t in fam.block:  # fused matrices: row views of their parts
            if t.split and t.field in fields:
                sizes = tuple(getattr(args, dim) for _, dim in t.split)
                parts = _split_rows(fields.pop(t.field), sizes)
                fields.update(zip((f for f, _ in t.split), parts, strict=True))
                fields.update(_part_biases(src, fam, t, l, fields))
        native = _native(args, fields)
        if fam.attention == "mla":  # the latent attention's weights, as one field
            fields |= dict(
                mla=latent(fields, args, l, str(gf.path)), attn_q=None, attn_k=None, attn_v=None
            )
        if moe_layer:
            blocks.append(_moe_block(src, args, l, fields, native))
            continue
        fc1 = fc2 = None
        if args.sparse:
            n1, n2 = Names.FC1.format(l=l), Names.FC2.format(l=l)
            if n1 not in gf.tensors or n2 not in gf.tensors:
                raise FileFormatError(
                    f"{gf.path}: PWRI model lacks predictor {n1!r}/{n2!r}; "
                    "rebuild it with `powerpy convert MODEL PREDICTOR_DIR`"
                )
            fc1, fc2 = src.matrix(n1, (h := gf.tensors[n1].shape[0], d)), src.matrix(n2, (ff, h))
        if Names.FFN_DOWN_T.format(l=l) in gf.tensors:
            down = Names.FFN_DOWN_T.format(l=l)
            down_t = src.matrix(down, (ff, d))
        else:
            down = Names.FFN_DOWN.format(l=l)
            down_t = src.transposed(down, (d, ff))
        down_b = _bias(src, down, d, fam.down_bias)
        native = native and _native(args, {}, down_t, fc1, fc2)  # (fields: checked above)
        cut = bool(cuts) and cuts[l] > 0 and not moe
        blocks.append(
            Block(
                **fields,
                ffn_down_t=down_t,
                ffn_down_b=down_b,
                fc1=fc1,
                fc2=fc2,
                sparse_layer=l not in args.dense_layers,
                down_tau=cut_taus(row_norms(down_t), cuts[l]) if cut else None,
                native=native,
            )
        )
    if args.moe and any(args.down_thresholds):
        release_free_heap()  # the experts' column norms were decoded chunk by chunk
    rule = "required" if fam.output_norm_bias else "none"
    out_b = _bias(src, Names.OUTPUT_NORM, d, rule) if head else None
    factors = {}
    for field, name in (
        ("rope_freqs", Names.ROPE_FREQS),
        ("rope_factors_long", Names.ROPE_FACTORS_LONG),
        ("rope_factors_short", Names.ROPE_FACTORS_SHORT),
    ):
        if name in gf.tensors:
            factors[field] = v = src.vector(name, args.n_rot // 2)
            if not bool((v > 0).all()):
                raise ModelConfigError(
                    f"{gf.path}: tensor {name!r} holds {v[v <= 0][:4].tolist()}; RoPE factors "
                    "divide the angles and must be > 0: re-convert the model"
                )
    return Weights(
        **factors,
        token_embd=token_embd,
        output_norm=src.vector(Names.OUTPUT_NORM, d) if head else None,
        output=output,
        blk=blocks,
        output_norm_b=out_b,
        position_embd=position_embd,
    )


def _native(args: ModelArgs, fields: dict, *mats) -> bool:
    """Whether the native block kernels compute a layer of these fields and matrices: every
    layout runs in them (``layer_record``) where they read each matrix (``_kernel_readable``),
    the FFN variant is theirs and the gate has no bias."""
    return (
        args.ffn_variant in kernel_variants
        and not isinstance(fields.get("ffn_gate"), BiasedWeight)
        and all(_kernel_readable(w) for w in (*fields.values(), *mats))
    )


def _moe_block(src: _TensorSource, args: ModelArgs, l: int, fields: dict, native: bool) -> Block:
    """Layer l of a mixture of experts: the family's other tensors (``fields``) and its
    ``experts`` stacks as ``moe.Experts`` over the file's bytes; ``native``: its attention
    runs in the native block kernel."""
    mats, biases = {}, {}
    for t in args.family.experts:
        shape = tuple(getattr(args, dim) for dim in t.shape)
        name = t.name.format(l=l)
        if len(shape) == 1:  # the routing's selection bias (optional: DeepSeek-V2 has none)
            if not (t.optional and name not in src.gf.tensors):
                mats[t.field] = src.vector(name, *shape, t.shape)
            continue
        if len(shape) == 2:
            src.info(name, shape, t.shape)
            mats[t.field] = src.matrix(name, shape)  # type: ignore[arg-type]
            biases[t.field] = _bias(src, name, shape[0], t.bias)  # GPT-OSS's router bias
        else:
            mats[t.field] = src.stack(name, shape, t.shape)  # type: ignore[arg-type]
            biases[t.field] = _stack_bias(src, name, shape[:2], t.bias)
    ex = Experts(
        mats["ffn_gate_inp"],
        mats["ffn_gate_exps"],
        mats["ffn_up_exps"],
        mats["ffn_down_exps"],
        args.n_expert_used,
        args.expert_norm,
        args.expert_scale,
        routing=Routing.of(args, mats.get("exp_probs_b"), biases["ffn_gate_inp"]),
        act=args.family.expert_act,
        gate_b=biases["ffn_gate_exps"],
        up_b=biases["ffn_up_exps"],
        down_b=biases["ffn_down_exps"],
    )
    cuts = args.down_thresholds
    if cuts and cuts[l] > 0:
        ex.tau = cut_taus(ex.down_norms(), cuts[l])
    return Block(**fields, ffn_up=None, ffn_down_t=None, moe=ex, native=native)


def _stack_bias(src: _TensorSource, weight: str, shape: tuple, rule: str) -> torch.Tensor | None:
    """A stack of experts' biases (GPT-OSS): (n_expert, rows) f32 of ``{weight}.bias`` under
    ``rule`` (as :func:`_bias`), checked finite; None when there is none."""
    if rule == "none" or bias_name(weight) not in src.gf.tensors:
        return _bias(src, weight, shape[0], rule)  # (the refusals: none allowed, or missing)
    name = bias_name(weight)
    src.info(name, shape, ("n_expert", "rows"))
    return src.finite(name, shape)


def _bias(src: _TensorSource, weight: str, n: int, rule: str) -> torch.Tensor | None:
    """The (n,) f32 bias of tensor ``weight`` under the family's rule for it ("none",
    "optional", "required"); None when there is none.

    Raises:
        FileFormatError: a required bias is missing.
        ModelConfigError: the file has a bias the family does not.
    """
    name = bias_name(weight)
    if name not in src.gf.tensors:
        if rule == "required":
            raise FileFormatError(
                f"{src.gf.path}: tensor {name!r} is missing; this architecture has a bias "
                "there: re-convert the model"
            )
        return None
    if rule == "none":
        arch = src.gf.kv.get(Keys.ARCHITECTURE)
        raise ModelConfigError(
            f"{src.gf.path}: tensor {name!r} is a bias that {arch} models do not have; the "
            "file is of another architecture or corrupt: re-convert the model"
        )
    return src.vector(name, n)


def _part_biases(src: _TensorSource, fam, fused, l: int, fields: dict) -> dict:
    """The biases of the parts' own tensors (``attn_q.bias``...) for the row views of ``fused``
    that has none of its own: all of them or none, as llama.cpp adds them.

    Raises:
        ModelConfigError: a fused matrix with a bias of its own and its parts', or with only
            some of the parts' biases.
    """
    parts = [t for t in fam.block if t.part_of == fused.field]
    names = [bias_name(t.name.format(l=l)) for t in parts]
    have = [n for n in names if n in src.gf.tensors]
    if not have:
        return {}
    whole = bias_name(fused.name.format(l=l))
    if whole in src.gf.tensors or len(have) < len(names):
        why = f"and its own {whole!r}" if whole in src.gf.tensors else f"but not {names}"
        raise ModelConfigError(
            f"{src.gf.path}: layer {l}'s fused {fused.name.format(l=l)!r} has the biases {have} "
            f"{why}; llama.cpp adds the fused bias or all three: re-convert the model"
        )
    out = {}
    for t in parts:
        w = fields[t.field]
        out[t.field] = _with_bias(w, _bias(src, t.name.format(l=l), w.shape[0], t.bias))
    return out


def _with_bias(w: Weight, bias: torch.Tensor | None) -> Weight:
    return w if bias is None else BiasedWeight(w, bias)


def _split_rows(w: Weight, sizes: tuple[int, ...]) -> list[Weight]:
    """A fused matrix (and its bias) as consecutive row views of ``sizes`` rows."""
    if isinstance(w, BiasedWeight):
        parts = row_slices(w.inner, sizes)
        biases = torch.split(w.bias, list(sizes))
        return [BiasedWeight(p, b) for p, b in zip(parts, biases, strict=True)]
    return row_slices(w, sizes)


def _kernel_readable(w) -> bool:
    """A layer's field as the native block kernels read it: a vector, or a matrix (its rows
    biased or not, a dense file's down matrix) of f32/f16/bf16 or a quantized type of
    ``kernels.QUANT_TYPES``; every family's layout runs in them (``layer_record``)."""
    if isinstance(w, TransposedWeight | BiasedWeight):
        w = w.inner
    if isinstance(w, QuantWeight):
        return w.ggml_type in QUANT_TYPES
    if isinstance(w, DenseWeight):
        return w.w.dtype in (torch.float32, torch.float16, torch.bfloat16)
    return w is None or isinstance(w, torch.Tensor)
