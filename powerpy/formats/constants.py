"""GGUF/PWRI constants: magics, metadata keys, tensor names and ggml type tables. Data only."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

# --- container ---------------------------------------------------------------------------------
GGUF_MAGIC = b"GGUF"  # dense model
PWRI_MAGIC = b"PWRI"  # PowerInfer sparse model, also the .gpuidx container
GGUF_VERSIONS = (2, 3)
GGUF_DEFAULT_ALIGNMENT = 32
GPUIDX_SUFFIX = ".generated.gpuidx"


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# --- ggml tensor types ----------------------------------------------------------------------------
class GGMLType(IntEnum):
    """powerpy's own type ids. Files map onto these through the per-magic tables below."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    I8 = 16
    I16 = 17
    I32 = 18
    BF16 = 30
    MXFP4 = 39  # OCP microscaling FP4 (GPT-OSS's experts): an E8M0 scale, 32 E2M1 values


@dataclass(frozen=True)
class TypeTraits:
    block_size: int  # elements per block
    type_size: int  # bytes per block


TYPE_TRAITS: dict[GGMLType, TypeTraits] = {
    GGMLType.F32: TypeTraits(1, 4),
    GGMLType.F16: TypeTraits(1, 2),
    GGMLType.BF16: TypeTraits(1, 2),
    GGMLType.Q4_0: TypeTraits(32, 18),
    GGMLType.Q4_1: TypeTraits(32, 20),
    GGMLType.Q5_0: TypeTraits(32, 22),
    GGMLType.Q5_1: TypeTraits(32, 24),
    GGMLType.Q8_0: TypeTraits(32, 34),
    GGMLType.Q8_1: TypeTraits(32, 40),
    GGMLType.Q2_K: TypeTraits(256, 84),
    GGMLType.Q3_K: TypeTraits(256, 110),
    GGMLType.Q4_K: TypeTraits(256, 144),
    GGMLType.Q5_K: TypeTraits(256, 176),
    GGMLType.Q6_K: TypeTraits(256, 210),
    GGMLType.Q8_K: TypeTraits(256, 292),
    GGMLType.MXFP4: TypeTraits(32, 17),
    GGMLType.I8: TypeTraits(1, 1),
    GGMLType.I16: TypeTraits(1, 2),
    GGMLType.I32: TypeTraits(1, 4),
}

_SHARED_IDS = {t.value: t for t in GGMLType if t.value <= 15 and t.value not in (4, 5)}

# File type id -> GGMLType. PWRI files use PowerInfer's ggml (I8/I16/I32 = 16/17/18);
# GGUF files use upstream ggml, where 16..23 are IQ types we do not support.
PWRI_TYPE_IDS: dict[int, GGMLType] = {
    **_SHARED_IDS,
    16: GGMLType.I8,
    17: GGMLType.I16,
    18: GGMLType.I32,
}
GGUF_TYPE_IDS: dict[int, GGMLType] = {
    **_SHARED_IDS,
    24: GGMLType.I8,
    25: GGMLType.I16,
    26: GGMLType.I32,
    30: GGMLType.BF16,
    39: GGMLType.MXFP4,
}

# Types whose values powerpy can decode (quants.dequantize).
DEQUANT_TYPES = frozenset(
    {
        GGMLType.F32,
        GGMLType.F16,
        GGMLType.BF16,
        GGMLType.Q8_0,
        GGMLType.Q4_0,
        GGMLType.Q4_1,
        GGMLType.Q6_K,
        GGMLType.MXFP4,
        GGMLType.I8,
        GGMLType.I16,
        GGMLType.I32,
    }
)


def row_bytes(n_cols: int, ggml_type: GGMLType) -> int:
    """Bytes of one row of ``n_cols`` elements; raises ValueError if not whole blocks."""
    tr = TYPE_TRAITS[ggml_type]
    if n_cols % tr.block_size:
        raise ValueError(f"{n_cols} elements is not a multiple of {ggml_type.name} blocks")
    return n_cols // tr.block_size * tr.type_size


# --- metadata keys -------------------------------------------------------------------------------
class Keys:
    ARCHITECTURE = "general.architecture"
    NAME = "general.name"
    ALIGNMENT = "general.alignment"
    FILE_TYPE = "general.file_type"

    # per-architecture keys: format with arch, e.g. CONTEXT_LENGTH.format(arch="llama")
    CONTEXT_LENGTH = "{arch}.context_length"
    EMBEDDING_LENGTH = "{arch}.embedding_length"
    BLOCK_COUNT = "{arch}.block_count"
    FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
    ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
    ROPE_FREQ_BASE = "{arch}.rope.freq_base"
    HEAD_COUNT = "{arch}.attention.head_count"
    HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
    RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"  # RMSNorm families (llama, bamboo)
    LAYERNORM_EPS = "{arch}.attention.layer_norm_epsilon"  # LayerNorm families (falcon, opt)
    TENSOR_DATA_LAYOUT = "{arch}.tensor_data_layout"  # falcon: "jploski" (q, then k, then v)
    KEY_LENGTH = "{arch}.attention.key_length"  # head size when not n_embd / head_count
    VALUE_LENGTH = "{arch}.attention.value_length"  # must equal key_length here
    # DeepSeek-2's latent attention: q's and the cache's low ranks, a head's q·k and value widths
    # (key_length and value_length are then the cache row's: latent + RoPE dims, and latent)
    Q_LORA_RANK = "{arch}.attention.q_lora_rank"
    KV_LORA_RANK = "{arch}.attention.kv_lora_rank"
    KEY_LENGTH_MLA = "{arch}.attention.key_length_mla"
    VALUE_LENGTH_MLA = "{arch}.attention.value_length_mla"
    SLIDING_WINDOW = "{arch}.attention.sliding_window"  # keys older than this many are masked
    # which layers are windowed: a period n (layer l iff l % n < n - 1), or a flag per layer
    SLIDING_WINDOW_PATTERN = "{arch}.attention.sliding_window_pattern"
    ATTENTION_SCALE = "{arch}.attention.scale"  # the q·k scale, when not 1/sqrt(head size)
    ATTN_SOFTCAP = "{arch}.attn_logit_softcapping"  # scores -> cap·tanh(scores / cap)
    FINAL_SOFTCAP = "{arch}.final_logit_softcapping"  # logits -> cap·tanh(logits / cap)
    ROPE_FREQ_BASE_SWA = "{arch}.rope.freq_base_swa"  # windowed layers' RoPE base (gemma3)
    ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"  # "none", "linear" (when absent), …
    ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"  # linear: positions / factor
    ROPE_SCALING_ATTN_FACTOR = "{arch}.rope.scaling.attn_factor"  # scales cos and sin
    ROPE_SCALING_ORIG_CTX = "{arch}.rope.scaling.original_context_length"
    # YaRN ("yarn" scaling): the ramp's extrapolation mix (absent: 1), its corner dims' betas,
    # and DeepSeek-2's log multiplier of the attention scale (stored times 0.1)
    ROPE_SCALING_YARN_EXT_FACTOR = "{arch}.rope.scaling.yarn_ext_factor"
    ROPE_SCALING_YARN_BETA_FAST = "{arch}.rope.scaling.yarn_beta_fast"
    ROPE_SCALING_YARN_BETA_SLOW = "{arch}.rope.scaling.yarn_beta_slow"
    ROPE_SCALING_YARN_LOG_MUL = "{arch}.rope.scaling.yarn_log_multiplier"
    VOCAB_SIZE = "{arch}.vocab_size"
    # mixture of experts (llama.cpp's keys): experts per layer, experts routed per token, the
    # experts' FFN width where it differs from feed_forward_length (qwen3moe), whether the k
    # routing weights are renormalized to sum to 1, and a factor on them (0 or 1: none)
    EXPERT_COUNT = "{arch}.expert_count"
    EXPERT_USED_COUNT = "{arch}.expert_used_count"
    EXPERT_FEED_FORWARD_LENGTH = "{arch}.expert_feed_forward_length"
    EXPERT_WEIGHTS_NORM = "{arch}.expert_weights_norm"
    EXPERT_WEIGHTS_SCALE = "{arch}.expert_weights_scale"
    # the shared expert's FFN width (qwen2moe; without the key: feed_forward_length)
    EXPERT_SHARED_FEED_FORWARD_LENGTH = "{arch}.expert_shared_feed_forward_length"
    # shared experts every token runs (glm4moe, deepseek2: their width is count · the experts')
    EXPERT_SHARED_COUNT = "{arch}.expert_shared_count"
    # the routing: 1 softmax, 2 sigmoid, 3 softmax over the k chosen logits (0: the family's);
    # experts in groups, of which a token's top-k come from the best few (DeepSeek-V3)
    EXPERT_GATING_FUNC = "{arch}.expert_gating_func"
    EXPERT_GROUP_COUNT = "{arch}.expert_group_count"
    EXPERT_GROUP_USED_COUNT = "{arch}.expert_group_used_count"
    LEADING_DENSE_BLOCK_COUNT = "{arch}.leading_dense_block_count"  # the first layers: no experts
    # the last block_count layers that predict further tokens (GLM-4.5's NextN): loaded, not run
    NEXTN_PREDICT_LAYERS = "{arch}.nextn_predict_layers"

    SPARSE_THRESHOLD = "powerinfer.sparse_threshold"  # FLOAT32, PWRI only, no arch prefix
    # powerpy's marker for a SiLU (SwiGLU) model sparsified by magnitude labels (CATS/TEAL-style)
    SPARSE_ACTIVATION = "powerpy.sparse_activation"  # STRING: "relu" (default) or "silu"
    # powerpy: layers whose FFN runs ungated in sparse mode, because their predictor costs
    # more than it saves (calibration with a predictor cost); other readers gate every layer
    DENSE_LAYERS = "powerpy.dense_layers"  # ARRAY of UINT32, sorted
    # per layer l, the cut t_l >= 0 of the FFN: a computed neuron j adds its down row only when
    # |h_j| * ||ffn_down_t[j]|| >= t_l (0: no cut)
    FFN_DOWN_THRESHOLD = "powerpy.ffn_down_threshold"  # ARRAY of FLOAT32, one per layer

    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENIZER_PRE = "tokenizer.ggml.pre"
    TOKENS = "tokenizer.ggml.tokens"
    SCORES = "tokenizer.ggml.scores"
    TOKEN_TYPE = "tokenizer.ggml.token_type"
    MERGES = "tokenizer.ggml.merges"
    BOS_ID = "tokenizer.ggml.bos_token_id"
    EOS_ID = "tokenizer.ggml.eos_token_id"
    UNK_ID = "tokenizer.ggml.unknown_token_id"
    PAD_ID = "tokenizer.ggml.padding_token_id"
    ADD_BOS = "tokenizer.ggml.add_bos_token"
    ADD_EOS = "tokenizer.ggml.add_eos_token"
    ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
    CHAT_TEMPLATE = "tokenizer.chat_template"
    # further special-token ids read by the tokenizer (all optional)
    EOT_ID = "tokenizer.ggml.eot_token_id"
    EOM_ID = "tokenizer.ggml.eom_token_id"
    SEP_ID = "tokenizer.ggml.seperator_token_id"  # sic: the GGUF spelling
    MASK_ID = "tokenizer.ggml.mask_token_id"
    FIM_PRE_ID = "tokenizer.ggml.fim_pre_token_id"
    FIM_SUF_ID = "tokenizer.ggml.fim_suf_token_id"
    FIM_MID_ID = "tokenizer.ggml.fim_mid_token_id"
    FIM_PAD_ID = "tokenizer.ggml.fim_pad_token_id"
    FIM_REP_ID = "tokenizer.ggml.fim_rep_token_id"
    FIM_SEP_ID = "tokenizer.ggml.fim_sep_token_id"
    PREFIX_ID = "tokenizer.ggml.prefix_token_id"  # deprecated alias of FIM_PRE_ID
    SUFFIX_ID = "tokenizer.ggml.suffix_token_id"  # deprecated alias of FIM_SUF_ID
    MIDDLE_ID = "tokenizer.ggml.middle_token_id"  # deprecated alias of FIM_MID_ID

    # .generated.gpuidx
    GPUIDX_ARCH = "generic.gpu_index"
    GPUIDX_BLOCK_COUNT = "generic.gpu_index.block_count"
    SPLIT_VRAM_CAPACITY = "split.vram_capacity"


# --- tensor names (GGUF) --------------------------------------------------------------------------
class Names:
    TOKEN_EMBD = "token_embd.weight"
    POS_EMBD = "position_embd.weight"  # learned positions (opt): (n_positions, n_embd)
    OUTPUT_NORM = "output_norm.weight"
    OUTPUT = "output.weight"
    ROPE_FREQS = "rope_freqs.weight"  # (n_rot/2,) divisors of the RoPE angles (llama-3)
    ROPE_FACTORS_LONG = "rope_factors_long.weight"  # phi3: the same, beyond the original context
    ROPE_FACTORS_SHORT = "rope_factors_short.weight"  # phi3: within it

    ATTN_NORM = "blk.{l}.attn_norm.weight"
    ATTN_NORM_2 = "blk.{l}.attn_norm_2.weight"  # falcon-40B: attention's own norm
    ATTN_QKV = "blk.{l}.attn_qkv.weight"  # fused q, k, v rows (falcon, phi3)
    ATTN_Q_NORM = "blk.{l}.attn_q_norm.weight"  # (head size,) RMSNorm of each q head
    ATTN_K_NORM = "blk.{l}.attn_k_norm.weight"
    POST_ATTN_NORM = "blk.{l}.post_attention_norm.weight"  # gemma: of attention's output
    POST_FFW_NORM = "blk.{l}.post_ffw_norm.weight"  # gemma: of the FFN's output
    ATTN_Q = "blk.{l}.attn_q.weight"
    ATTN_K = "blk.{l}.attn_k.weight"
    ATTN_V = "blk.{l}.attn_v.weight"
    ATTN_OUTPUT = "blk.{l}.attn_output.weight"
    ATTN_SINKS = "blk.{l}.attn_sinks.weight"  # (n_head,) f32: each head's sink logit (GPT-OSS)
    # DeepSeek-2's latent attention (numpy shapes): q's low rank (q_lora_rank, n_embd), its norm,
    # its heads (n_head · key_length_mla, q_lora_rank); the latent and the shared RoPE dims
    # (kv_lora_rank + n_rot, n_embd) and the latent's norm; per head the latent -> q·k map
    # (n_head, kv_lora_rank, qk_nope) and the value map (n_head, value_length_mla,
    # kv_lora_rank), or both fused per head (n_head · (qk_nope + value_length_mla), kv_lora_rank)
    ATTN_Q_A = "blk.{l}.attn_q_a.weight"
    ATTN_Q_A_NORM = "blk.{l}.attn_q_a_norm.weight"
    ATTN_Q_B = "blk.{l}.attn_q_b.weight"
    ATTN_KV_A_MQA = "blk.{l}.attn_kv_a_mqa.weight"
    ATTN_KV_A_NORM = "blk.{l}.attn_kv_a_norm.weight"
    ATTN_K_B = "blk.{l}.attn_k_b.weight"
    ATTN_V_B = "blk.{l}.attn_v_b.weight"
    ATTN_KV_B = "blk.{l}.attn_kv_b.weight"
    FFN_NORM = "blk.{l}.ffn_norm.weight"
    FFN_GATE = "blk.{l}.ffn_gate.weight"
    FFN_UP = "blk.{l}.ffn_up.weight"
    FFN_DOWN = "blk.{l}.ffn_down.weight"  # dense files: (n_embd, n_ff) numpy shape
    FFN_DOWN_T = "blk.{l}.ffn_down_t.weight"  # PWRI files: (n_ff, n_embd) numpy shape
    FC1 = "blk.{l}.fc1.weight"  # predictor (H, n_embd)
    FC2 = "blk.{l}.fc2.weight"  # predictor (n_ff, H)
    # mixture of experts, numpy shapes: the router (n_expert, n_embd); gate and up (n_expert,
    # n_ff_exp, n_embd); down (n_expert, n_embd, n_ff_exp) as llama.cpp stores it
    FFN_GATE_INP = "blk.{l}.ffn_gate_inp.weight"
    FFN_GATE_EXPS = "blk.{l}.ffn_gate_exps.weight"
    FFN_UP_EXPS = "blk.{l}.ffn_up_exps.weight"
    FFN_DOWN_EXPS = "blk.{l}.ffn_down_exps.weight"
    # a shared expert every token runs beside the routed ones (qwen2moe): its gate logit's row
    # (n_embd,), gate and up (n_ff_shexp, n_embd), down (n_embd, n_ff_shexp)
    FFN_GATE_INP_SHEXP = "blk.{l}.ffn_gate_inp_shexp.weight"
    FFN_GATE_SHEXP = "blk.{l}.ffn_gate_shexp.weight"
    FFN_UP_SHEXP = "blk.{l}.ffn_up_shexp.weight"
    FFN_DOWN_SHEXP = "blk.{l}.ffn_down_shexp.weight"
    # the routing's per-expert bias (n_expert,) f32, added to the probabilities that choose the
    # experts but not to the weights (DeepSeek-V3, GLM-4.5); a bias without a weight
    EXP_PROBS_B = "blk.{l}.exp_probs_b.bias"

    # A tensor's bias is its name with ".bias" for ".weight" (:func:`bias_name`).

    GPU_IDX = "blk.{l}.gpu_idx"
    GPU_BUCKET = "blk.{l}.gpu_bucket"


def bias_name(weight: str) -> str:
    """The GGUF name of a weight's bias: ``blk.{l}.attn_q.weight`` -> ``blk.{l}.attn_q.bias``."""
    assert weight.endswith(".weight"), weight
    return weight[: -len("weight")] + "bias"


# Token types of tokenizer.ggml.token_type
class TokenType(IntEnum):
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6
