"""The dense offload pass's levels (docs/architecture.md#dense-offload-order): which category
each tensor of a model falls in, and its place in llama.cpp's creation order. Names only."""

from __future__ import annotations

import re

__all__ = [
    "ATTN",
    "CATEGORY_ORDER",
    "DENSE_LEVELS",
    "FFN",
    "FFN_NORM",
    "HOST",
    "HOT_FFN",
    "KV",
    "KV_K",
    "KV_V",
    "OUTPUT",
    "PREDICTOR",
    "classify_tensor",
]

# --- categories, in offload order (docs/architecture.md#dense-offload-order) ---------------------
ATTN = "attn"  # attn_norm(_2), q, k, v, qkv, attn_output, rot_embd, q/k norms (+ biases)
# fc1, fc2; a mixture of experts' router (ffn_gate_inp) and shared expert (every token's FFN
# runs them before or beside its sparse part)
PREDICTOR = "predictor"
FFN_NORM = "ffn_norm"
OUTPUT = "output"  # output_norm, output
KV_V = "kv_v"
KV_K = "kv_k"
KV = "kv"  # both caches (V and K), as a placement reports them
HOT_FFN = "hot_ffn"  # compact hot rows of gate/up/down_t
DENSE_LEVELS = (ATTN, PREDICTOR, FFN_NORM, OUTPUT)
CATEGORY_ORDER = (*DENSE_LEVELS, KV_V, KV_K)
# not part of the dense pass
FFN = "ffn"  # gate/up/down_t (+ biases), the experts: rows go to the GPU through the split
HOST = "host"  # token_embd, token_embd_norm, position_embd, rope_freqs, unknown names

# Per-layer creation order in llama.cpp's llm_load_sparse_model_tensors; within a level the
# allocator keeps it (stable sort by level), and a weight comes before its bias.
_LAYER_TENSORS: dict[str, tuple[str, int]] = {
    "attn_norm": (ATTN, 0),
    "attn_norm_2": (ATTN, 1),
    "attn_qkv": (ATTN, 2),
    "attn_q": (ATTN, 3),
    "attn_k": (ATTN, 4),
    "attn_v": (ATTN, 5),
    "attn_output": (ATTN, 6),
    "attn_q_norm": (ATTN, 7),
    "attn_k_norm": (ATTN, 8),
    "attn_rot_embd": (ATTN, 9),
    "ffn_norm": (FFN_NORM, 10),
    "ffn_gate": (FFN, 11),
    "ffn_down_t": (FFN, 12),
    "ffn_down": (FFN, 12),
    "ffn_up": (FFN, 13),
    "fc1": (PREDICTOR, 14),
    "fc2": (PREDICTOR, 15),
    "post_attention_norm": (ATTN, 16),  # gemma
    "post_ffw_norm": (FFN_NORM, 17),
    "ffn_gate_inp": (PREDICTOR, 18),  # the router decides which experts run, as a predictor
    "ffn_gate_exps": (FFN, 19),
    "ffn_down_exps": (FFN, 20),
    "ffn_up_exps": (FFN, 21),
    "ffn_gate_inp_shexp": (PREDICTOR, 22),  # qwen2moe's shared expert: dense, every token
    "ffn_gate_shexp": (PREDICTOR, 23),
    "ffn_down_shexp": (PREDICTOR, 24),
    "ffn_up_shexp": (PREDICTOR, 25),
    "exp_probs_b": (PREDICTOR, 26),  # the routing's selection bias, with its router
    "attn_sinks": (ATTN, 27),  # gpt-oss
    # DeepSeek-2's latent attention (placed tensor by tensor; model/mla.py runs each product
    # where its matrix is)
    "attn_q_a": (ATTN, 28),
    "attn_q_a_norm": (ATTN, 29),
    "attn_q_b": (ATTN, 30),
    "attn_kv_a_mqa": (ATTN, 31),
    "attn_kv_a_norm": (ATTN, 32),
    "attn_k_b": (ATTN, 33),
    "attn_v_b": (ATTN, 34),
    "attn_kv_b": (ATTN, 35),
}
_GLOBAL_TENSORS: dict[str, tuple[str, int]] = {
    "token_embd": (HOST, 0),
    "token_embd_norm": (HOST, 1),
    "position_embd": (HOST, 2),
    "rope_freqs": (HOST, 3),
    "output_norm": (OUTPUT, 4),
    "output": (OUTPUT, 5),
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def classify_tensor(name: str) -> tuple[str, int, int]:
    """Offload category of a model tensor and its place in creation order.

    Args:
        name: GGUF tensor name, e.g. ``blk.3.attn_q.weight``.

    Returns:
        ``(category, layer, rank)``: ``layer`` is -1 for global tensors; ``rank`` orders the
        tensors of one layer as llama.cpp creates them. Unknown names are ``HOST``.
    """
    m = _LAYER_RE.fullmatch(name)
    if m:
        kind, part = m.group(2), m.group(3)
        if kind in _LAYER_TENSORS:
            cat, rank = _LAYER_TENSORS[kind]
            return cat, int(m.group(1)), 2 * rank + (part == "bias")
        return HOST, int(m.group(1)), 1 << 20
    m = _GLOBAL_RE.fullmatch(name)
    if m and m.group(1) in _GLOBAL_TENSORS:
        cat, rank = _GLOBAL_TENSORS[m.group(1)]
        return cat, -1, 2 * rank + (m.group(2) == "bias")
    return HOST, -1, 1 << 20
