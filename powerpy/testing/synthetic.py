"""Write a synthetic PowerInfer (PWRI) model with random weights and working predictors:
LLaMA (the default), Falcon or OPT (``--arch``), in the layout ``powerpy.families`` declares.

The file has the keys and tensors of ``docs/formats.md#powerinfer-model-file`` (llama: ReGLU FFN;
falcon and opt: ReLU FFN without a gate; ffn_down_t, fc1/fc2) plus a byte-level SPM vocabulary
(<unk>, <s>, </s>, 256 byte tokens, then unused filler tokens up to the shape's vocabulary size),
and ``activation/activation_{i}.pt`` beside it holding each neuron's expected activation
frequency.

How the sparsity is made (so that the predictor is meaningful, not just random):
- Residual dimension 0 is a constant ``C``: every token embedding has ``C`` there, and no layer
  writes to it (row 0 of attn_output and column 0 of ffn_down_t are zero, and so are the
  matching entries of their biases).
- fc1 row 0 is ``e_0 / C``, so hidden unit 0 is always 1 and fc2 column 0 acts as a bias. The
  other hidden units come in pairs ``relu(u_k·x)``, ``relu(-u_k·x)`` whose difference is the
  linear ``u_k·x``; so ``logit_j = b_j + a_j·(U x)`` exactly.
- The row that decides whether neuron j fires (ffn_gate for llama, ffn_up for the ungated
  families, where j is active iff ``up_j·norm(x) > 0``) is ``(b_j / C) e_0 + a_j U`` (the same
  linear function, so ``logit_j >= 0`` iff ``row_j·x_pred >= 0``: after the norm's positive
  scaling, iff the neuron is active) plus an independent part the predictor cannot see
  (``--predictor-noise``, relative std), so the predictor's recall is realistic rather than
  perfect.
- LayerNorm (falcon, opt) also subtracts the mean of x, which would shift that row's value by
  ``mean(x)·sum(row_j)``. So residual dimension 1 is a sink that stays 0, the row holds
  ``-b_j / C`` there, and its other entries sum to zero: every such row sums to 0 and LayerNorm
  scales its value by ``1/std(x) > 0`` like RMSNorm. The FFN's own norm (falcon's attn_norm,
  opt's ffn_norm) is the identity (weight 1, bias 0), and ffn_up's bias (opt) is 0, for the
  same reason; the other norms, biases and the position table are random.
- The offsets ``b_j`` are calibrated layer by layer on real hidden states (a batch of
  single-token sequences run through the layers generated so far; opt's at random positions)
  so that neuron j is active with probability ``p_j``: with ``--powerlaw``, ``p_j ∝ rank^-alpha``
  (capped, hot neurons at random positions), otherwise ``p_j`` is spread mildly around
  ``--active``; the mean is ``--active`` either way.
- Sublayer outputs are rescaled so each adds about ``0.5 / sqrt(n_layer)`` of the embedding
  RMS: the residual stream stays bounded.

Family layouts: falcon is a parallel block with one fused attn_qkv (q heads, k heads, v heads)
and NeoX RoPE; a shape with one kv head is Falcon-7B-like (one attn_norm for attention and MLP),
one with several kv heads Falcon-40B-like (attention reads its own attn_norm_2). The predictor
reads the block input. opt is pre-LN with biases everywhere, learned positions
(``position_embd``, position p at row p + 2) and the output tied to token_embd; the predictor
reads the residual before ffn_norm.

The model is written layer by layer straight into the file (tensor infos first, then each
tensor as it is generated), so memory stays at about one layer plus the embeddings; the file is
renamed into place at the end. Dtypes follow upstream's converters: 1-D tensors F32; for q4_0,
gate/up/down_t/attention/embeddings/fc1/fc2 Q4_0 and output Q8_0 (upstream writes Q6_K there,
which powerpy cannot quantize).

The command line is ``tools/make_synthetic_model.py``.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from powerpy.families import Rope, family
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys
from powerpy.formats.gguf_types import tensor_nbytes
from powerpy.formats.gguf_writer import GGUFStreamWriter
from powerpy.testing.synthetic_layers import (
    LN_EPS,
    RMS_EPS,
    SIGMA_E,
    SIGMA_P,
    TIED_OUTPUT,
    C,
    Neurons,
    Plan,
    Shape,
    generate,
    layer_norm,
    layer_table,
    neurons,
    rms_norm,
    scaled_to,
    target_probs,
    tensor_infos,
)
from powerpy.testing.tiny import TinySpec, encode_array, spec_args, vocab_kv

log = logging.getLogger(__name__)

__all__ = [
    "ARCH_SHAPES",
    "ARCHS",
    "C",
    "DTYPES",
    "FALCON_SHAPES",
    "FILE_TYPE",
    "LN_EPS",
    "Neurons",
    "OPT_SHAPES",
    "Plan",
    "RMS_EPS",
    "SHAPES",
    "SIGMA_E",
    "SIGMA_P",
    "Shape",
    "TIED_OUTPUT",
    "encode",
    "generate",
    "key_values",
    "layer_norm",
    "layer_table",
    "neurons",
    "plan_for",
    "rms_norm",
    "scaled_to",
    "target_probs",
    "tensor_infos",
    "write_synthetic_model",
]


SHAPES = {
    "tiny": Shape(256, 1024, 2, 4, 2, 512, 512, 64),
    "1b": Shape(2048, 5632, 22, 32, 4, 2048, 32000, 256),  # TinyLlama-1.1B dimensions
    "7b": Shape(4096, 11008, 32, 32, 32, 4096, 32000, 1024),  # LLaMA-2-7B dimensions
}
# Falcon: "tiny" is multi-query (one kv head, one norm per block: Falcon-7B's layout); "1b" has
# 4 kv heads and so attn_norm_2, the layout of ReluFalcon-40B, the Falcon PowerInfer ships (8
# kv heads for 128 q heads there; 4 for 32 keeps that grouping's KV share of the attention).
FALCON_SHAPES = {
    "tiny": Shape(256, 1024, 2, 4, 1, 512, 512, 64),
    "1b": Shape(2048, 8192, 24, 32, 4, 2048, 65024, 256),  # n_ff = 4·n_embd, Falcon's vocab
}
OPT_SHAPES = {
    "tiny": Shape(256, 1024, 2, 4, 4, 512, 512, 64),
    "1b": Shape(2048, 8192, 24, 32, 32, 2048, 50272, 256),  # OPT-1.3B dimensions
}
ARCH_SHAPES = {"llama": SHAPES, "falcon": FALCON_SHAPES, "opt": OPT_SHAPES}
ARCHS = tuple(ARCH_SHAPES)
DTYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}
FILE_TYPE = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q4_0: 2, GGMLType.Q8_0: 7}


# ---- encoding ------------------------------------------------------------------------------------


def encode(w: torch.Tensor, ggml_type: GGMLType) -> np.ndarray:
    """f32 tensor -> the array written to the file (typed for floats, raw blocks for quants)."""
    return encode_array(w.detach().float().contiguous().numpy(), ggml_type)


def key_values(plan: Plan, name: str, threshold: float | None) -> dict:
    """The file's key/values (``ModelArgs.to_gguf_kv``, the byte vocabulary, file type)."""
    s, fam = plan.shape, family(plan.arch)
    spec = TinySpec(
        s.n_embd, s.n_layer, s.n_ff, s.n_head, s.n_head_kv, s.hidden, n_ctx=s.n_ctx, arch=plan.arch
    )
    kv = spec_args(spec, s.n_vocab).to_gguf_kv(name=name)  # the family's sparse FFN
    if fam.rope is Rope.LEARNED:  # no rotation: no RoPE keys
        for key in (Keys.ROPE_DIMENSION_COUNT, Keys.ROPE_FREQ_BASE):
            kv.pop(key.format(arch=plan.arch))
    if plan.arch == "falcon":
        kv[Keys.TENSOR_DATA_LAYOUT.format(arch="falcon")] = ("jploski", GGUFValueType.STRING)
    kv[Keys.FILE_TYPE] = (FILE_TYPE[plan.wtype], GGUFValueType.UINT32)
    if threshold is not None:
        kv[Keys.SPARSE_THRESHOLD] = (float(threshold), GGUFValueType.FLOAT32)
    kv.update(vocab_kv(s.n_vocab))
    kv[Keys.ADD_BOS] = (True, GGUFValueType.BOOL)
    return kv


def plan_for(
    arch: str, shape: str | Shape, dtype: str, predictor_dtype: str | None = None
) -> tuple[Plan, str]:
    """The plan of an architecture, a shape (a name of ``ARCH_SHAPES[arch]`` or a ``Shape``)
    and dtypes, and the shape's name.

    Raises:
        ValueError: an unknown architecture, shape or dtype.
    """
    if arch not in ARCH_SHAPES:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHS)}")
    if isinstance(shape, Shape):
        shape_, shape_name = shape, "custom"
    elif shape in ARCH_SHAPES[arch]:
        shape_, shape_name = ARCH_SHAPES[arch][shape], shape
    else:
        raise ValueError(f"{arch} has no shape {shape!r} (it has {', '.join(ARCH_SHAPES[arch])})")
    for dt in (dtype, predictor_dtype):
        if dt is not None and dt not in DTYPES:
            raise ValueError(f"dtype {dt!r} is not one of {', '.join(DTYPES)}")
    wtype = DTYPES[dtype]
    ptype = DTYPES[predictor_dtype] if predictor_dtype else wtype
    otype = GGMLType.Q8_0 if wtype == GGMLType.Q4_0 else wtype
    return Plan(shape_, wtype, ptype, otype, arch), shape_name


def write_synthetic_model(
    out: str | Path,
    shape: str | Shape = "tiny",
    dtype: str = "f16",
    *,
    arch: str = "llama",
    active: float = 0.10,
    powerlaw: bool = False,
    alpha: float = 1.4,
    layers: int | None = None,
    hidden: int | None = None,
    predictor_dtype: str | None = None,
    predictor_noise: float = 0.2,
    threshold: float | None = None,
    calib_tokens: int = 256,
    seed: int = 0,
    stats: bool = True,
) -> Path:
    """Write a synthetic PWRI model (see the module docstring) and its activation statistics.

    Args:
        out: the model file (written atomically; statistics go to ``out.parent/activation``).
        shape: a name of ``ARCH_SHAPES[arch]`` ("tiny", "1b"; llama also "7b") or a ``Shape``;
            ``layers``/``hidden`` override its depth and predictor size.
        dtype: "f32", "f16", "q8_0" or "q4_0" for 2-D weights (``predictor_dtype`` for fc1/fc2).
        arch: "llama", "falcon" or "opt".
        active: mean active fraction per token; ``powerlaw``/``alpha``: power-law hot neurons.
        predictor_noise: relative std of the deciding rows' part the predictor cannot see.
        threshold: write ``powerinfer.sparse_threshold``.
        calib_tokens, seed: calibration states and RNG seed.
        stats: write ``activation/activation_{i}.pt``.

    Raises:
        ValueError: bad arguments, or not enough disk space.
    """
    if not 0.0 < active < 1.0:
        raise ValueError(f"active must be in (0, 1), got {active}")
    plan, shape_name = plan_for(arch, shape, dtype, predictor_dtype)
    if layers is not None:
        plan.shape = replace(plan.shape, n_layer=layers)
    if hidden is not None:
        plan.shape = replace(plan.shape, hidden=hidden)
    s = plan.shape
    if s.hidden < 3 or (plan.ptype not in (GGMLType.F32, GGMLType.F16) and s.hidden % 32):
        raise ValueError(
            f"predictor hidden size {s.hidden} must be >= 3 (a multiple of 32 "
            "for quantized predictors)"
        )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    infos = tensor_infos(plan)
    total = sum(tensor_nbytes(tuple(reversed(shp)), t) for _, shp, t in infos)
    free = shutil.disk_usage(out.parent).free
    if total * 1.05 + (1 << 26) > free:
        raise ValueError(f"{out}: needs {total / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free")
    log.info(
        "%s %s %s: %d layers, n_embd %d, n_ff %d, H %d, %.2f GiB -> %s",
        arch,
        shape_name,
        dtype,
        s.n_layer,
        s.n_embd,
        s.n_ff,
        s.hidden,
        total / 2**30,
        out,
    )

    prefix = "powerpy-synthetic" if arch == "llama" else f"powerpy-synthetic-{arch}"
    name = f"{prefix}-{shape_name}-{dtype}"
    writer = GGUFStreamWriter(out, key_values(plan, name, threshold), infos, magic=b"PWRI")
    types = {n: t for n, _, t in infos}
    t0 = time.time()
    act_stats: list[torch.Tensor] = []
    try:
        for tensor_name, w in generate(
            plan,
            active=active,
            powerlaw=powerlaw,
            alpha=alpha,
            predictor_noise=predictor_noise,
            calib_tokens=calib_tokens,
            seed=seed,
            stats=act_stats,
        ):
            writer.write(tensor_name, encode(w, types[tensor_name]))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    if stats:
        from powerpy.formats.stats import save_activation_stats

        act_dir = out.parent / "activation"
        save_activation_stats(act_dir, act_stats)
        log.info("wrote %d activation files to %s", len(act_stats), act_dir)
    log.info("done in %.1f s: %s (%.2f GiB)", time.time() - t0, out, out.stat().st_size / 2**30)
    return out
