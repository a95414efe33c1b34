"""Helpers for the llama.cpp oracles of tiny random GGUFs (``test_families_oracle.py``,
``test_gemma_phi3_oracle.py``): a byte-level BPE vocabulary, a gguf-py writer of random
tensors in F16 or a quantized type, and the greedy comparison of the two engines.

The files are written with gguf-py, not with powerpy's writer, so a layout or key both engines
read must be the one llama.cpp's converter writes. Both engines run the prompt in one batch,
then decode greedily one token at a time; every logit of the prompt and of each step is
compared with llama.cpp's, relative to that row's logit spread (max - min).
"""

from __future__ import annotations

import collections
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
DTYPES = ("f16", "q8_0")  # gguf-py quantizes Q8_0 (not the K-quants)
_FILE_TYPE = {"f16": 1, "q8_0": 7}  # llama_ftype: MOSTLY_F16, MOSTLY_Q8_0


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


def bpe_vocab(text: str, n_merges: int = 64) -> dict:
    """A byte-level BPE vocabulary: <|endoftext|> (id 0, control), the 256 byte tokens, then
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
    tokens = [EOT, *byte, *(m.replace(" ", "") for m in merges)]
    types = [3] + [1] * (len(tokens) - 1)  # control, then normal
    return {"tokens": tokens, "types": types, "merges": merges}


# --- a writer of random tensors -------------------------------------------------------------------
class RandomGGUF:
    """A ``gguf.GGUFWriter`` for ``arch`` whose matrices are random and written as ``dtype``
    ("f16" or "q8_0"); vectors (norms, biases, RoPE factors) are F32, as converters write them.
    ``self.w`` takes the family's keys; :meth:`close` writes the file. ``extra``: control tokens
    appended to the vocabulary (llama.cpp's phi3 vocabulary needs ``<s>``, ``</s>``, ``<unk>``)."""

    def __init__(
        self, path: Path, arch: str, dtype: str, seed: int, *, pre: str = "falcon", extra=()
    ):
        import gguf

        self.path, self.rng = path, np.random.default_rng(seed)
        self.qtype = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[
            dtype
        ]
        self.w = gguf.GGUFWriter(str(path), arch=arch)
        self.w.add_name(f"tiny-{arch}-{dtype}")
        self.w.add_file_type(_FILE_TYPE[dtype])
        vocab = bpe_vocab(PROMPT)
        vocab["tokens"] += list(extra)
        vocab["types"] += [3] * len(extra)
        self.n_vocab = len(vocab["tokens"])
        self.w.add_tokenizer_model("gpt2")
        self.w.add_tokenizer_pre(pre)
        self.w.add_token_list(vocab["tokens"])
        self.w.add_token_types(vocab["types"])
        self.w.add_token_merges(vocab["merges"])
        self.w.add_bos_token_id(0)
        self.w.add_eos_token_id(0)
        self.w.add_add_bos_token(False)

    def matrix(
        self, name: str, rows: int, cols: int, scale: float = 1.0, add: np.ndarray | None = None
    ) -> np.ndarray:
        """A random (rows, cols) matrix, entries of std ``scale / sqrt(cols)`` (plus ``add``),
        written as the file's type; returns its f32 values."""
        import gguf

        a = (scale * self.rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        if add is not None:
            a += add
        if self.qtype == gguf.GGMLQuantizationType.F16:
            self.w.add_tensor(name, a.astype(np.float16))
        else:
            self.w.add_tensor(name, gguf.quants.quantize(a, self.qtype), raw_dtype=self.qtype)
        return a

    def vector(self, name: str, values: np.ndarray) -> None:
        """An F32 vector as given."""
        self.w.add_tensor(name, np.asarray(values, dtype=np.float32))

    def norm(self, name: str, n: int, *, bias: bool = False) -> None:
        """``{name}.weight`` near 1 (as llama.cpp's converters store even Gemma's 1 + w), and
        ``{name}.bias`` with ``bias`` (LayerNorm)."""
        self.vector(f"{name}.weight", 1 + 0.1 * self.rng.standard_normal(n))
        if bias:
            self.vector(f"{name}.bias", 0.1 * self.rng.standard_normal(n))

    def close(self) -> Path:
        """Write header, key/values and tensors; return the path."""
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return self.path


# --- the comparison -------------------------------------------------------------------------------
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


def our_greedy(llm, ids: list[int], n: int, n_ctx: int | None = None):
    """powerpy, run the same way (f16 KV cache, as llama.cpp's) in a cache of ``n_ctx``
    positions (default: just enough)."""
    cache = llm.model.new_cache(n_ctx or len(ids) + n)
    rows = [llm.model.forward(torch.tensor(ids), cache, llm.options, all_logits=True)]
    out: list[int] = []
    for _ in range(n):
        out.append(int(rows[-1][-1].argmax()))
        rows.append(llm.model.forward(torch.tensor([out[-1]]), cache, llm.options))
    return out, torch.cat(rows).double().numpy()


@dataclass
class Comparison:
    """One run of both engines: ``rel`` the largest |Δlogit| / spread over all positions,
    ``margin`` the smallest lead of llama.cpp's greedy winner over its runner-up (/ spread),
    the greedy tokens of each and the prompt's length."""

    rel: float
    margin: float
    got_tokens: list[int]
    want_tokens: list[int]
    n_prompt: int


def compare(ref, ours, *, n_steps: int = N_STEPS, n_ctx: int | None = None) -> Comparison:
    """Tokenize :data:`PROMPT` with both engines (asserting the same ids), then run both
    greedily for ``n_steps`` (powerpy's cache of ``n_ctx`` positions) and compare."""
    ids = ours.tokenize(PROMPT)
    assert ids == ref.tokenize(PROMPT.encode(), add_bos=False, special=True)
    assert len(ids) > 8
    want_tokens, want = ref_greedy(ref, ids, n_steps)
    got_tokens, got = our_greedy(ours, ids, n_steps, n_ctx)
    assert got.shape == want.shape
    spread = want.max(axis=1) - want.min(axis=1)  # per position
    rel = np.abs(got - want).max(axis=1) / spread
    top2 = np.sort(want[len(ids) - 1 : -1], axis=1)[:, -2:]  # the greedy steps' two best
    margin = ((top2[:, 1] - top2[:, 0]) / spread[len(ids) - 1 : -1]).min()
    return Comparison(float(rel.max()), float(margin), got_tokens, want_tokens, len(ids))
