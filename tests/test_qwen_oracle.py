"""Qwen2, Qwen3 and the llama variants people hold, against llama.cpp (llama-cpp-python): tiny
random GGUFs written with gguf-py in F16 and Q8_0, and requantized by llama.cpp itself to
Q4_K_M (Q4_K and Q6_K blocks; gguf-py quantizes no K type), 2 or 3 layers, grouped-query
attention, a byte-level BPE vocabulary.

- ``qwen2-tied``, ``qwen2``: q/k/v biases, NeoX RoPE, the output tied to token_embd or not.
- ``qwen3``: an RMSNorm over each q and k head, and a head size of its own (``key_length``
  twice n_embd / n_head, as Qwen3-0.6B's 128 against 1024 / 16), n_embd 512.
- ``llama-swa``: a Mistral-style ``llama.attention.sliding_window`` of 8 under a longer prompt.
  llama.cpp's llama graph never reads the key (its converter never writes it for llama files),
  so every position attends to all before it; powerpy's llama family ignores it too.
- ``llama-biases``: the optional biases llama.cpp's llama loader reads (HF's ``attention_bias``
  and ``mlp_bias``) on attn_output and on the FFN's gate, up and down matrices.
- ``llama3-rope``: llama-3.1's ``rope_freqs.weight``, the per-pair divisors of the RoPE angles
  its converter computes (factor 8; an original context of 64 puts the smooth band among the
  pairs that turn within the prompt).

Each case runs a prompt and 16 greedy steps (``oracle_fixtures.compare``): the same tokens, and
every logit within 1% of its row's spread. Q8_0 and Q4_K_M files are bit-identical to
llama.cpp: powerpy rounds the activations of their matmuls as ggml does, takes each K-quant
product in the order llama.cpp's CPU backend takes it (``test_matches_llama_cpp``), and computes
the norms, biases, RoPE (its angles, the factors' divisions), f16-cache attention and SwiGLU in
ggml's order. F16 files are not (~2e-4 of the spread): ggml rounds an F16 matmul's activations
to f16, powerpy keeps them f32.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from oracle_fixtures import PROMPT, TinyGGUF, bpe_vocab, check, compare, quantize_with_llama_cpp

from powerpy.api import load

pytestmark = pytest.mark.llama_cpp

N_EMBD, N_HEAD, N_HEAD_KV = 256, 4, 2  # K-quant rows: multiples of 256; n_ff 2·n_embd
WINDOW = 8


def llama3_rope_factors(
    head_dim: int,
    base: float,
    factor: float = 8.0,
    low: float = 1.0,
    high: float = 4.0,
    orig_ctx: int = 64,
) -> np.ndarray:
    """llama-3.1's RoPE factors as llama.cpp's converter computes them (``rope_freqs``)."""
    out = []
    for j in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (j / head_dim)
        if wavelen < orig_ctx / high:
            out.append(1.0)
        elif wavelen > orig_ctx / low:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_model(
    path: Path,
    *,
    arch: str,
    n_layer: int,
    tied: bool,
    dtype: str,
    seed: int,
    key_length: int = 0,
    window: int = 0,
    rope_freqs: bool = False,
    n_embd: int = N_EMBD,
    biases: bool = False,
) -> Path:
    """A random dense llama/qwen2/qwen3 GGUF as llama.cpp's converters lay them out; ``biases``:
    a llama file's optional biases on attn_output, ffn_gate, ffn_up and ffn_down too."""
    d, ff = n_embd, 2 * n_embd
    hd = key_length or d // N_HEAD
    pre = "qwen2" if arch.startswith("qwen") else "llama-bpe"
    f = TinyGGUF(path, arch, dtype, seed, bpe_vocab(PROMPT), pre=pre)
    w, base = f.w, 10000.0
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_block_count(n_layer)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(base)
    if key_length:
        w.add_key_length(key_length)
        w.add_value_length(key_length)
    if window:
        w.add_sliding_window(window)
    emb = f.matrix("token_embd.weight", f.n_vocab, d, scale=np.sqrt(d))  # (n_vocab, d), std 1
    big = 3.0 if tied else 1.0  # tied: sublayers that outweigh the embedding, so the output
    for l in range(n_layer):  # (token_embd) does not only see the last token
        f.vector(f"blk.{l}.attn_norm.weight", d)
        for name, rows in (
            ("attn_q", N_HEAD * hd),
            ("attn_k", N_HEAD_KV * hd),
            ("attn_v", N_HEAD_KV * hd),
        ):
            f.matrix(f"blk.{l}.{name}.weight", rows, d)
            if arch == "qwen2":
                f.vector(f"blk.{l}.{name}.bias", rows, mean=0.0, std=0.5)
        if arch == "qwen3":
            f.vector(f"blk.{l}.attn_q_norm.weight", hd)
            f.vector(f"blk.{l}.attn_k_norm.weight", hd)
        f.matrix(f"blk.{l}.attn_output.weight", d, N_HEAD * hd, scale=big)
        f.vector(f"blk.{l}.ffn_norm.weight", d)
        f.matrix(f"blk.{l}.ffn_gate.weight", ff, d)
        f.matrix(f"blk.{l}.ffn_up.weight", ff, d)
        f.matrix(f"blk.{l}.ffn_down.weight", d, ff, scale=big)
        for name, rows in (("attn_output", d), ("ffn_gate", ff), ("ffn_up", ff), ("ffn_down", d)):
            if biases:
                f.vector(f"blk.{l}.{name}.bias", rows, mean=0.0, std=0.5)
    f.vector("output_norm.weight", d)
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(hd, base))
    if not tied:
        f.output(emb)
    return f.close()


CASES = {
    # name: (arch, n_layer, tied output, seed, extra writer arguments). The seeds give greedy
    # runs whose winner leads by at least 2% of the logit spread at every step.
    "qwen2-tied": ("qwen2", 2, True, 1, {}),
    "qwen2": ("qwen2", 3, False, 0, {}),
    "qwen3": ("qwen3", 2, False, 0, {"key_length": 256, "n_embd": 512}),
    "llama-swa": ("llama", 2, False, 0, {"window": WINDOW}),
    "llama3-rope": ("llama", 2, False, 0, {"rope_freqs": True}),
    "llama-biases": ("llama", 2, False, 0, {"biases": True}),
}
DTYPES = ("f16", "q8_0", "q4_k_m", "q4_0")
REQUANTIZED = {"q4_k_m": "Q4_K_M", "q4_0": "Q4_0"}  # by llama.cpp's quantizer, from f16


@pytest.fixture(scope="module", params=[f"{c}/{t}" for c in CASES for t in DTYPES])
def pair(request, llama_cpp, tmp_path_factory):
    case, dtype = request.param.split("/")
    arch, n_layer, tied, seed, extra = CASES[case]
    tmp = tmp_path_factory.mktemp(case)
    written = "f16" if dtype in REQUANTIZED else dtype
    path = write_model(
        tmp / f"{case}-{written}.gguf",
        arch=arch,
        n_layer=n_layer,
        tied=tied,
        dtype=written,
        seed=seed,
        **extra,
    )
    if dtype in REQUANTIZED:
        path = quantize_with_llama_cpp(
            llama_cpp, path, tmp / f"{case}-{dtype}.gguf", REQUANTIZED[dtype]
        )
    ref = llama_cpp.Llama(
        model_path=str(path), n_ctx=256, logits_all=True, n_threads=2, verbose=False
    )
    yield request.param, ref, load(path)
    ref.close()


def test_matches_llama_cpp(pair):
    name, ref, ours = pair
    if name.startswith("llama-swa"):  # llama.cpp's llama graph reads no window
        assert len(ours.tokenize(PROMPT)) > 3 * WINDOW
        assert ours.model.args.sliding_window == WINDOW and ours.model.args.swa_layers == ()
    # Q8_0, Q4_K_M and Q4_0: llama.cpp's numerics, all of them. Q4_K and Q4_0 matrices of 8k
    # rows run interleaved in the order of ggml's repacked kernels (Q4_K: 4 prompt tokens at a
    # time, the rest and decode one by one), Q6_K ones in vec_dot's order under 8 tokens and the
    # tiled GEMM's from 8 (docs/kernels.md); before that, Q4_K_M files were ~0.4-0.8% of the
    # spread off
    check(name, compare(name, ref, ours), exact=name.endswith(("q8_0", "q4_k_m", "q4_0")))
