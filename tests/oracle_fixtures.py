"""The llama.cpp oracle's machinery for tiny random GGUFs of any family (tests/test_*_oracle.py).

- ``bpe_vocab``: a byte-level BPE vocabulary learned from a text (GPT-2's byte stand-ins).
- ``TinyGGUF``: a ``gguf.GGUFWriter`` with random matrices in one file type (F16, Q8_0, ...)
  and the vocabulary's keys; ``quantize_with_llama_cpp`` turns a file into llama.cpp's own
  K-quant mixes (gguf-py quantizes no K type).
- ``compare``: both engines tokenize a prompt alike and decode greedily (llama.cpp through
  llama-cpp-python; powerpy through ``Model.forward`` with an f16 cache, as llama.cpp's); the
  tokens must be the same, every logit of the prompt and of each step within 1% of that row's
  logit spread (max - min) of llama.cpp's, and ``exact`` ones bit-identical.
"""

from __future__ import annotations

import collections
import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

PROMPT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep."
)
N_STEPS = 16
EOT = "<|endoftext|>"


# --- a byte-level BPE vocabulary ------------------------------------------------------------------
def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (``bytes_to_unicode``), by byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def bpe_vocab(text: str, n_merges: int = 64, specials: tuple[str, ...] = (EOT,)) -> dict:
    """A byte-level BPE vocabulary: ``specials`` (ids 0.., control), the 256 byte tokens, then
    the tokens of ``n_merges`` merges learned from ``text`` (words split before spaces, pairs
    counted within words); as ``gguf.GGUFWriter`` arguments."""
    byte = _byte_chars()
    words = collections.Counter()
    for i, w in enumerate(text.split(" ")):
        words[tuple(byte[b] for b in (w if i == 0 else " " + w).encode())] += 1
    merges: list[str] = []
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:], strict=False):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        merged = collections.Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    tokens = [*specials, *byte, *(m.replace(" ", "") for m in merges)]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))  # control, then normal
    return {"tokens": tokens, "types": types, "merges": merges}


# --- tiny random files ----------------------------------------------------------------------------
class TinyGGUF:
    """A GGUF being written (``gguf.GGUFWriter``): random tensors of one file type and the
    vocabulary's keys. ``dtype``: "f16", "q8_0" (or any type gguf-py quantizes, by name)."""

    def __init__(self, path: Path, arch: str, dtype: str, seed: int, vocab: dict, pre: str):
        import gguf

        self.gguf, self.path = gguf, path
        self.rng = np.random.default_rng(seed)
        self.qtype = gguf.GGMLQuantizationType[dtype.upper()]
        self.vocab, self.n_vocab = vocab, len(vocab["tokens"])
        self.w = w = gguf.GGUFWriter(str(path), arch=arch)
        w.add_name(f"tiny-{arch}-{dtype}")
        w.add_file_type({"F16": 1, "Q8_0": 7}.get(self.qtype.name, 0))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(vocab["tokens"])
        w.add_token_types(vocab["types"])
        w.add_token_merges(vocab["merges"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(0)
        w.add_add_bos_token(False)

    def matrix(
        self, name: str, rows: int, cols: int, scale: float = 1.0, add: np.ndarray | None = None
    ) -> np.ndarray:
        """A random (rows, cols) matrix (plus ``add``) written as the file type; its f32
        values."""
        a = (scale * self.rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        if add is not None:
            a += add
        if self.qtype == self.gguf.GGMLQuantizationType.F16:
            self.w.add_tensor(name, a.astype(np.float16))
        else:
            q = self.gguf.quants.quantize(a, self.qtype)
            self.w.add_tensor(name, q, raw_dtype=self.qtype)
        return a

    def vector(self, name: str, n: int, mean: float = 1.0, std: float = 0.1) -> None:
        """A random f32 vector (norm weights around 1, biases around 0)."""
        self.w.add_tensor(name, (mean + std * self.rng.standard_normal(n)).astype(np.float32))

    def output(self, emb: np.ndarray, successor: float = 3.0) -> None:
        """An untied ``output.weight`` where token v is also favoured after its predecessor (in
        a random cycle): greedy runs walk the cycle, and the winner leads by more than the
        engines' numerics differ."""
        succ = self.rng.permutation(self.n_vocab)
        pred = np.empty_like(succ)
        pred[succ] = np.arange(self.n_vocab)
        d = emb.shape[1]
        self.matrix("output.weight", self.n_vocab, d, scale=2.0, add=successor * emb[pred] / d**0.5)

    def close(self) -> Path:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return self.path


def quantize_with_llama_cpp(lc, src: Path, dst: Path, ftype: str = "Q4_K_M") -> Path:
    """``src`` requantized by llama.cpp's own quantizer (``llama_model_quantize``) to
    ``LLAMA_FTYPE_MOSTLY_{ftype}``, the mix of types llama.cpp's files of that name hold."""
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    status = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert status == 0, f"llama_model_quantize failed ({status})"
    return dst


# --- both engines, greedy -------------------------------------------------------------------------
def ref_greedy(ref, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp: the prompt in one batch, then n greedy tokens one at a time; the tokens and
    the logits (len(ids) + n, n_vocab) of every position run."""
    ref.reset()
    ref.eval(ids)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(ref.scores[ref.n_tokens - 1])))
        ref.eval([out[-1]])
    return out, np.array(ref.scores[: ref.n_tokens], dtype=np.float64)


def our_greedy(
    llm, ids: list[int], n: int, n_ctx: int | None = None
) -> tuple[list[int], np.ndarray]:
    """powerpy, run the same way (f16 KV cache, as llama.cpp's) in a session of ``n_ctx``
    positions (default: just enough; phi3's RoPE factors depend on it)."""
    cache = llm.model.new_cache(n_ctx or len(ids) + n)
    rows = [llm.model.forward(torch.tensor(ids), cache, llm.options, all_logits=True)]
    out: list[int] = []
    for _ in range(n):
        out.append(int(rows[-1][-1].argmax()))
        rows.append(llm.model.forward(torch.tensor([out[-1]]), cache, llm.options))
    return out, torch.cat(rows).double().numpy()


@dataclass
class Agreement:
    """How powerpy's run agrees with llama.cpp's: the largest |Δlogit| / spread over every
    position, the greedy steps' smallest lead of the winner (over the spread), the tokens."""

    rel: float
    margin: float
    ours: list[int]
    theirs: list[int]


def compare(
    name: str, ref, ours, prompt: str = PROMPT, n: int = N_STEPS, n_ctx: int | None = None
) -> Agreement:
    """Run both engines on ``prompt`` (tokenized alike) and ``n`` greedy steps (powerpy's
    session of ``n_ctx`` positions, as llama.cpp's context); print and return how they
    agree."""
    ids = ours.tokenize(prompt)
    assert ids == ref.tokenize(prompt.encode(), add_bos=False, special=True)
    assert len(ids) > 8
    want_tokens, want = ref_greedy(ref, ids, n)
    got_tokens, got = our_greedy(ours, ids, n, n_ctx)
    assert got.shape == want.shape
    spread = want.max(axis=1) - want.min(axis=1)  # per position
    rel = np.abs(got - want).max(axis=1) / spread
    top2 = np.sort(want[len(ids) - 1 : -1], axis=1)[:, -2:]  # the greedy steps' two best
    margin = ((top2[:, 1] - top2[:, 0]) / spread[len(ids) - 1 : -1]).min()
    print(f"{name}: max |dlogit|/spread {rel.max():.2e}, greedy margin {margin:.3f}")
    return Agreement(float(rel.max()), float(margin), got_tokens, want_tokens)


def check(
    name: str, agreement: Agreement, *, exact: bool, min_margin: float = 0.02, tol: float = 0.01
) -> None:
    """The oracle's assertions: logits within ``tol`` (1%) of the spread (bit-identical when
    ``exact``), a fixture without near ties (the winners lead by ``min_margin`` of the spread
    and by 5 times the engines' difference), the same greedy tokens."""
    a = agreement
    assert a.rel <= tol, (name, a.rel)
    if exact:
        assert a.rel == 0, (name, a.rel)
    assert a.margin > max(min_margin, 5 * a.rel), f"{name}: a near tie ({a.margin:.4f})"
    assert a.ours == a.theirs, (name, a.ours, a.theirs)
