"""``ModelArgs`` back to GGUF key/values (``ModelArgs.to_gguf_kv``): the common keys, then
each family's and each feature's share (a mixture's ``experts.expert_kv``, RoPE scaling's
``rope_scaling.scaling_kv``, a family's ``Family.args_kv``)."""

from __future__ import annotations

from typing import Any

from powerpy.families.base import FFNVariant
from powerpy.families.experts import expert_kv
from powerpy.families.rope_scaling import scaling_kv
from powerpy.families.values import windowed_layers
from powerpy.formats.constants import GGUFValueType, Keys


def model_kv(a: Any, *, name: str | None = None, vocab_size: bool = False) -> dict:
    """The GGUF key/values of ``ModelArgs`` ``a``, ``{key: (value, GGUFValueType)}``: what
    ``ModelArgs.from_gguf_kv`` reads back as ``a`` (see ``ModelArgs.to_gguf_kv``)."""
    u32, f32, arch = GGUFValueType.UINT32, GGUFValueType.FLOAT32, a.arch
    kv: dict = {Keys.ARCHITECTURE: (arch, GGUFValueType.STRING)}
    if name is not None:
        kv[Keys.NAME] = (name, GGUFValueType.STRING)
    kv.update(
        {
            Keys.CONTEXT_LENGTH.format(arch=arch): (a.n_ctx_train, u32),
            Keys.EMBEDDING_LENGTH.format(arch=arch): (a.n_embd, u32),
            Keys.BLOCK_COUNT.format(arch=arch): (a.n_layer + a.n_layer_nextn, u32),
            Keys.FEED_FORWARD_LENGTH.format(arch=arch): (a.n_ff, u32),
            Keys.ROPE_DIMENSION_COUNT.format(arch=arch): (a.n_rot, u32),
            Keys.ROPE_FREQ_BASE.format(arch=arch): (a.rope_base, f32),
            Keys.HEAD_COUNT.format(arch=arch): (a.n_head, u32),
            Keys.HEAD_COUNT_KV.format(arch=arch): (a.n_head_kv, u32),
            a.family.norm.eps_key.format(arch=arch): (a.norm_eps, f32),
        }
    )
    if vocab_size:
        kv[Keys.VOCAB_SIZE.format(arch=arch)] = (a.n_vocab, u32)
    optional = (  # written when set: (key, value, unset value, type)
        (Keys.KEY_LENGTH, a.key_length, 0, u32),
        (Keys.VALUE_LENGTH, a.key_length, 0, u32),
        (Keys.SLIDING_WINDOW, a.sliding_window, 0, u32),
        (Keys.ROPE_FREQ_BASE_SWA, a.rope_base_swa, 0.0, f32),
        (Keys.ROPE_SCALING_ATTN_FACTOR, a.rope_attn_factor, 1.0, f32),
        (Keys.ROPE_SCALING_ORIG_CTX, a.rope_orig_ctx, 0, u32),
        (Keys.ATTENTION_SCALE, a.attn_scale, 0.0, f32),
        (Keys.ATTN_SOFTCAP, a.attn_softcap, 0.0, f32),
        (Keys.FINAL_SOFTCAP, a.final_softcap, 0.0, f32),
    )
    for key, value, unset, kind in optional:
        if value != unset:
            kv[key.format(arch=arch)] = (value, kind)
    kv.update(scaling_kv(a))
    fam = a.family
    if a.sliding_window and fam.swa_pattern is not None:
        if a.swa_layers != windowed_layers({}, fam, a.n_layer, "model"):
            flags = [l in a.swa_layers for l in range(a.n_layer)]
            key = Keys.SLIDING_WINDOW_PATTERN.format(arch=arch)
            kv[key] = (flags, GGUFValueType.ARRAY, GGUFValueType.BOOL)
    if a.sparse and a.sparse_threshold != 0.0:
        kv[Keys.SPARSE_THRESHOLD] = (a.sparse_threshold, f32)
    if a.sparse and a.ffn_variant in (FFNVariant.SWIGLU, FFNVariant.GELU):
        kv[Keys.SPARSE_ACTIVATION] = (a.ffn_variant.activation, GGUFValueType.STRING)
    if a.sparse and a.dense_layers:
        kv[Keys.DENSE_LAYERS] = (list(a.dense_layers), GGUFValueType.ARRAY, u32)
    if a.n_layer_nextn:
        kv[Keys.NEXTN_PREDICT_LAYERS.format(arch=arch)] = (a.n_layer_nextn, u32)
    if a.moe:
        kv.update(expert_kv(a))
    if (a.sparse or a.moe) and any(a.down_thresholds):
        kv[Keys.FFN_DOWN_THRESHOLD] = (list(a.down_thresholds), GGUFValueType.ARRAY, f32)
    if fam.args_kv is not None:  # the family's own keys (deepseek2's latent attention)
        kv.update(fam.args_kv(a))
    return kv
