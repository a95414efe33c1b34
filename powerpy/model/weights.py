"""A model's weights as the runtime holds them, named as in GGUF: one ``Block`` per layer and the
``Weights`` around them. The loader (``loader.load_weights``) makes them, a placement
(``placement.runtime``) moves some to an accelerator, and the layer loop (``transformer``) reads
them; nothing in them changes per call."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from powerpy.model import mla
from powerpy.model.device import OnDevices
from powerpy.model.ffn import scaled_cut
from powerpy.model.matrices import Weight
from powerpy.model.moe import Experts
from powerpy.model.options import RunOptions
from powerpy.model.split import HotRows


@dataclass
class Block:
    """One layer's weights, named as in GGUF. Matrices with a bias are ``BiasedWeight``; a
    norm's bias is ``{norm}_b`` (LayerNorm families). Which fields a family fills is its
    ``Family.block`` (``powerpy.families``)."""

    attn_norm: Tensor  # (n_embd,) f32
    attn_q: Weight  # (n_embd, n_embd)
    attn_k: Weight  # (n_embd_gqa, n_embd)
    attn_v: Weight  # (n_embd_gqa, n_embd)
    attn_output: Weight  # (n_embd, n_embd)
    ffn_norm: Tensor | None  # (n_embd,) f32; None in a parallel block (attn_norm feeds the FFN)
    ffn_gate: Weight | None  # (n_ff, n_embd); None for an ungated FFN (FFNVariant.gated)
    ffn_up: Weight  # (n_ff, n_embd)
    ffn_down_t: Weight  # (n_ff, n_embd): row j is neuron j's output
    fc1: Weight | None = None  # (H, n_embd) predictor
    fc2: Weight | None = None  # (n_ff, H)
    hot: HotRows | None = None  # hybrid placements: this layer's rows on the accelerator
    sparse_layer: bool = True  # False: in powerpy.dense_layers, no predictor in sparse mode
    down_tau: Tensor | None = None  # (n_ff,) f32 host: the cut (powerpy.ffn_down_threshold)
    attn_norm_b: Tensor | None = None  # (n_embd,) LayerNorm bias
    attn_norm_2: Tensor | None = None  # (n_embd,) attention's own norm (falcon-40B)
    attn_norm_2_b: Tensor | None = None
    ffn_norm_b: Tensor | None = None
    ffn_down_b: Tensor | None = None  # (n_embd,) the down matrix's bias (OPT)
    attn_q_norm: Tensor | None = None  # (head_dim,) RMSNorm of each q head (qwen3, gemma3)
    attn_k_norm: Tensor | None = None  # (head_dim,) … and of each k head
    post_attention_norm: Tensor | None = None  # (n_embd,) of attention's output (gemma)
    post_ffw_norm: Tensor | None = None  # (n_embd,) of the FFN's output (gemma)
    # q, k and v as one placed matrix (n_embd + 2 n_embd_gqa, n_embd), one product where the
    # accelerator holds all three (attn_q/k/v are then its row views); None elsewhere
    attn_qkv: Weight | None = None
    # the native block kernels compute this layer (every layout; ``layer_record``)
    native: bool = True
    # a mixture of experts in place of the dense FFN (ffn_gate, ffn_up, ffn_down_t None)
    moe: Experts | None = None
    # its shared expert (qwen2moe; moe.shared_expert): the gate's row, a SwiGLU FFN
    ffn_gate_inp_shexp: Tensor | None = None  # (n_embd,) f32
    ffn_gate_shexp: Weight | None = None  # (n_ff_shexp, n_embd)
    ffn_up_shexp: Weight | None = None  # (n_ff_shexp, n_embd)
    ffn_down_shexp: Weight | None = None  # (n_embd, n_ff_shexp), as stored
    mla: mla.Latent | None = None  # DeepSeek-2's latent attention (attn_q/k/v None)
    attn_sinks: Tensor | None = None  # (n_head,) f32 each head's sink logit (GPT-OSS)

    def gates(self, opts: RunOptions) -> bool:
        """Whether the predictor gates this layer's FFN in a run with ``opts``."""
        return opts.sparse and self.sparse_layer and self.fc1 is not None and opts.oracle is None

    def predictor_input(self, ffn_inp: OnDevices, opts: RunOptions) -> Tensor:
        """The FFN's pre-norm input where the predictor reads it (where it was, when the
        predictor does not run)."""
        return ffn_inp(self.fc1.device) if self.gates(opts) else ffn_inp.tensor

    def cut(self, opts: RunOptions) -> Tensor | None:
        """This layer's cut in a run with ``opts`` (None: every computed neuron counts)."""
        return scaled_cut(self.down_tau, opts)


@dataclass
class Weights:
    token_embd: Weight  # (n_vocab, n_embd)
    output_norm: Tensor  # (n_embd,)
    output: Weight  # (n_vocab, n_embd); token_embd itself when tied
    blk: list[Block]
    output_norm_b: Tensor | None = None  # (n_embd,) LayerNorm bias
    position_embd: Weight | None = None  # (n_positions + offset, n_embd): learned positions
    rope_freqs: Tensor | None = None  # (n_rot/2,) f32 divisors of the RoPE angles (llama-3)
    rope_factors_long: Tensor | None = None  # (n_rot/2,) phi3: beyond the original context
    rope_factors_short: Tensor | None = None  # (n_rot/2,) phi3: within it
