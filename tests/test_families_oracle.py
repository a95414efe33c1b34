"""Falcon, StableLM and Phi-2 against llama.cpp (llama-cpp-python): tiny random dense GGUFs
written with gguf-py, in F16 and Q8_0. StableLM: LayerNorms with biases, NeoX RoPE over a
quarter of each head (``rope.dimension_count``), q/k/v biases, SwiGLU, an untied output. Phi-2:
falcon's parallel block with one LayerNorm, 6 of 16 rotary dims, q scaled before q·k, biases on
every matrix, the output's included; a parallel block adds attention and FFN first, then the
block's input, as llama.cpp does (the other order was an ulp off in 5 of 42 rows of phi2's seed
0; falcon's fixtures pass either way). Falcon: multi-query (Falcon-7B's layout: one kv head, one
norm per block, output tied to token_embd) and 40B-like (two kv heads, attention's own
attn_norm_2, an untied output). All with a byte-level BPE vocabulary and the "falcon"
pre-tokenizer.

Both engines tokenize the prompt alike, then decode 16 greedy tokens each (end of text is not
special here; ``oracle_fixtures.compare``); the tokens must be the same, and every logit of the
prompt and of each decoded step must be within 1% of that row's logit spread (max - min) of
llama.cpp's. Q8_0 files are bit-identical: powerpy runs ggml's GELU (the tanh form read from an
f16 table) under llama.cpp's numerics, and its Q8_0 matmuls. F16 files differ by ~4e-4 of the
spread: llama.cpp rounds the activations of an F16 matmul to f16, powerpy does not.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from oracle_fixtures import PROMPT, TinyGGUF, bpe_vocab, check, compare

from powerpy.api import load

pytestmark = pytest.mark.llama_cpp

N_EMBD, N_FF, N_HEAD = 64, 256, 4


def _layer_norm_file(
    path: Path, arch: str, n_layer: int, n_head_kv: int, dtype: str, seed: int
) -> tuple[TinyGGUF, Callable[[str], None]]:
    """A file of ``arch`` being written, with the hyperparameters of this module's models
    (LayerNorm eps 1e-5, RoPE base 10000), and a writer of a LayerNorm's weight and bias."""
    f = TinyGGUF(path, arch, dtype, seed, bpe_vocab(PROMPT), pre="falcon")
    w = f.w
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_block_count(n_layer)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_eps(1e-5)
    w.add_rope_freq_base(10000.0)

    def norm(name: str) -> None:
        f.vector(f"{name}.weight", N_EMBD)
        f.vector(f"{name}.bias", N_EMBD, mean=0.0)

    return f, norm


def write_falcon(
    path: Path, *, n_layer: int, n_head_kv: int, norm_2: bool, tied: bool, dtype: str, seed: int
) -> Path:
    """A random dense falcon GGUF as llama.cpp's converter lays it out: fused attn_qkv (q heads,
    then k heads, then v heads), LayerNorms with biases, ffn_up/ffn_down, no matrix biases."""
    d, ff, hd = N_EMBD, N_FF, N_EMBD // N_HEAD
    f, norm = _layer_norm_file(path, "falcon", n_layer, n_head_kv, dtype, seed)

    emb = f.matrix("token_embd.weight", f.n_vocab, d, scale=np.sqrt(d))  # (n_vocab, d), std 1
    big = 3.0 if tied else 1.0  # tied: sublayers that outweigh the embedding, so the output
    for l in range(n_layer):  # (token_embd) does not only see the last token
        norm(f"blk.{l}.attn_norm")
        if norm_2:
            norm(f"blk.{l}.attn_norm_2")
        f.matrix(f"blk.{l}.attn_qkv.weight", d + 2 * hd * n_head_kv, d)
        f.matrix(f"blk.{l}.attn_output.weight", d, d, scale=big)
        f.matrix(f"blk.{l}.ffn_up.weight", ff, d)
        f.matrix(f"blk.{l}.ffn_down.weight", d, ff, scale=big)
    norm("output_norm")
    if not tied:
        f.output(emb)
    return f.close()


CASES = {
    # name: (n_layer, n_head_kv, attn_norm_2, tied output, seed). The seeds give greedy runs
    # whose winner leads by at least 5% of the logit spread at every step (the tied model
    # repeats one token; the untied one walks 16 distinct tokens).
    "mqa": (2, 1, False, True, 19),
    "40b": (3, 2, True, False, 0),
}


@pytest.fixture(scope="module", params=[f"{c}-{t}" for c in CASES for t in ("f16", "q8_0")])
def pair(request, llama_cpp, tmp_path_factory):
    case, dtype = request.param.split("-")
    n_layer, n_head_kv, norm_2, tied, seed = CASES[case]
    path = tmp_path_factory.mktemp("falcon") / f"{request.param}.gguf"
    write_falcon(
        path, n_layer=n_layer, n_head_kv=n_head_kv, norm_2=norm_2, tied=tied, dtype=dtype, seed=seed
    )
    ref = llama_cpp.Llama(
        model_path=str(path), n_ctx=256, logits_all=True, n_threads=2, verbose=False
    )
    yield request.param, ref, load(path)
    ref.close()


def test_falcon_matches_llama_cpp(pair):
    name, ref, ours = pair
    assert ours.model.args.arch == "falcon"
    # Q8_0 matmuls, ggml's GELU: llama.cpp's numerics, all of them
    check(name, compare(name, ref, ours), exact=name.endswith("q8_0"))


def write_stablelm(path: Path, *, n_layer: int, dtype: str, seed: int) -> Path:
    """A random dense stablelm GGUF as llama.cpp's converter lays it out (StableLM 2 1.6B's
    layout): LayerNorms with biases, q/k/v with biases, rotary dims a quarter of the head."""
    d, ff, hd, n_kv = N_EMBD, N_FF, N_EMBD // N_HEAD, 2
    f, norm = _layer_norm_file(path, "stablelm", n_layer, n_kv, dtype, seed)
    f.w.add_rope_dimension_count(hd // 4)

    emb = f.matrix("token_embd.weight", f.n_vocab, d, scale=np.sqrt(d))
    for l in range(n_layer):
        norm(f"blk.{l}.attn_norm")
        for name, rows in (("attn_q", d), ("attn_k", n_kv * hd), ("attn_v", n_kv * hd)):
            f.matrix(f"blk.{l}.{name}.weight", rows, d)
            f.vector(f"blk.{l}.{name}.bias", rows, mean=0.0, std=0.5)
        f.matrix(f"blk.{l}.attn_output.weight", d, d)
        norm(f"blk.{l}.ffn_norm")
        f.matrix(f"blk.{l}.ffn_gate.weight", ff, d)
        f.matrix(f"blk.{l}.ffn_up.weight", ff, d)
        f.matrix(f"blk.{l}.ffn_down.weight", d, ff)
    norm("output_norm")
    f.output(emb)
    return f.close()


def write_phi2(path: Path, *, n_layer: int, dtype: str, seed: int) -> Path:
    """A random dense phi2 GGUF as llama.cpp's converter lays it out: one LayerNorm per block
    (weight, bias), q/k/v, attn_output, ffn_up, ffn_down and output each with a bias."""
    d, ff, hd = N_EMBD, N_FF, N_EMBD // N_HEAD
    f, norm = _layer_norm_file(path, "phi2", n_layer, N_HEAD, dtype, seed)
    f.w.add_rope_dimension_count(6)

    def mat(name: str, rows: int, cols: int) -> None:
        f.matrix(f"{name}.weight", rows, cols)
        f.vector(f"{name}.bias", rows, mean=0.0, std=0.5)

    emb = f.matrix("token_embd.weight", f.n_vocab, d, scale=np.sqrt(d))
    for l in range(n_layer):
        norm(f"blk.{l}.attn_norm")
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            mat(f"blk.{l}.{name}", N_HEAD * hd, d)
        mat(f"blk.{l}.ffn_up", ff, d)
        mat(f"blk.{l}.ffn_down", d, ff)
    norm("output_norm")
    f.output(emb)
    f.vector("output.bias", f.n_vocab, mean=0.0, std=0.5)
    return f.close()


# the LayerNorm families: writer, seed, (arch, n_rot, head_dim)
LAYER_NORM_CASES = {
    "stablelm": (write_stablelm, 1, ("stablelm", 4, 16)),
    "phi2": (write_phi2, 9, ("phi2", 6, 16)),  # every matrix's bias, the output's included
}


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", list(LAYER_NORM_CASES))
def test_layer_norm_families_match_llama_cpp(llama_cpp, tmp_path, arch, dtype):
    writer, seed, want = LAYER_NORM_CASES[arch]
    path = writer(tmp_path / f"{arch}-{dtype}.gguf", n_layer=3, dtype=dtype, seed=seed)
    ref = llama_cpp.Llama(
        model_path=str(path), n_ctx=256, logits_all=True, n_threads=2, verbose=False
    )
    try:
        ours = load(path)
        a = ours.model.args
        assert (a.arch, a.n_rot, a.head_dim) == want
        assert (getattr(ours.model.weights.output, "bias", None) is not None) == (arch == "phi2")
        name = f"{arch}/{dtype}"
        check(name, compare(name, ref, ours), exact=dtype == "q8_0")
    finally:
        ref.close()
