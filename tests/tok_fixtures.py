"""Helpers for the tokenizer tests: metadata reading, GGUF vocab writers and a llama.cpp oracle."""

from __future__ import annotations

import ctypes
import io
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from powerpy.formats.gguf_reader import read_gguf


def read_kv(path: Path) -> dict[str, Any]:
    """GGUF metadata as a dict (``powerpy.formats.gguf_reader.read_gguf(path).kv``).

    Args:
        path: GGUF file.

    Returns:
        The metadata mapping.
    """
    gf = read_gguf(path)
    try:
        return dict(gf.kv)
    finally:
        gf.close()


# --- GGUF writers ---------------------------------------------------------------------------------
_LLAMA_HPARAMS = {
    "llama.context_length": 512,
    "llama.embedding_length": 64,
    "llama.block_count": 1,
    "llama.feed_forward_length": 128,
    "llama.rope.dimension_count": 16,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 4,
}


def write_vocab_gguf(path: Path, tok_kv: Mapping[str, Any]) -> Path:
    """Write a tensor-less "llama" GGUF holding only hparams and tokenizer metadata.

    llama.cpp can open it with ``vocab_only=True``.

    Args:
        path: output file.
        tok_kv: ``tokenizer.*`` keys (values: str, bool, int, list[str], list/array of numbers).

    Returns:
        ``path``.
    """
    import gguf

    w = gguf.GGUFWriter(str(path), arch="llama")
    for k, v in _LLAMA_HPARAMS.items():
        w.add_uint32(k, v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, val in tok_kv.items():
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        elif key == "tokenizer.ggml.scores":
            w.add_array(key, [float(x) for x in val])
        elif key == "tokenizer.ggml.token_type":
            w.add_array(key, [int(x) for x in val])
        else:
            w.add_array(key, list(val))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "tra",
    "ble",
    "qu",
    "ion",
    "ing",
    "ed",
    "th",
    "er",
    "an",
    "re",
    "st",
    "ou",
    "se",
    "pre",
    "con",
    "ment",
    "ly",
    "ful",
    "ness",
    "the",
    "and",
    "of",
    "to",
]
_CORPUS_LINES = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "It's a truth universally acknowledged that we'll need more tests, isn't it?",
    "Numbers like 12, 345 and 6789 appear in text: 3.14159, 2024-05-01, $100.",
    "Hello world! Hello, World. HELLO WORLD? hello-world_hello",
    "Tokenizers split text into pieces; pieces become ids; ids become vectors.",
    "She sells sea shells by the sea shore, and the shells she sells are sea shells.",
    "def main():\n    print('hello')\n    return 0\n",
]


def spm_corpus(seed: int = 0, n_lines: int = 600) -> list[str]:
    """Deterministic training text for the SentencePiece fixture.

    Args:
        seed: RNG seed.
        n_lines: number of synthetic lines added to the fixed lines.

    Returns:
        Lines of text.
    """
    rng = random.Random(seed)
    lines = list(_CORPUS_LINES) * 20
    for _ in range(n_lines):
        words = [
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
            for _ in range(rng.randint(3, 12))
        ]
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ",", ""]))
    return lines


SPM_USER_DEFINED = ["<tool>", "[[sep]]"]
SPM_CONTROL = ["<|im_start|>", "<|im_end|>"]


def build_spm_vocab(vocab_size: int = 600) -> dict[str, Any]:
    """Train a small SentencePiece BPE model with byte fallback; return its GGUF tokenizer keys.

    Args:
        vocab_size: number of pieces.

    Returns:
        ``tokenizer.*`` metadata for a "llama" vocabulary.
    """
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(spm_corpus()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        num_threads=1,
        user_defined_symbols=SPM_USER_DEFINED,
        control_symbols=SPM_CONTROL,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        pieces.append(piece)
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif piece in SPM_USER_DEFINED:
            types.append(4)
        elif sp.is_unused(i):
            types.append(5)
        elif sp.is_byte(i):
            types.append(6)
        else:
            types.append(1)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": np.asarray(scores, dtype=np.float32),
        "tokenizer.ggml.token_type": np.asarray(types, dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def bpe_subvocab(kv: Mapping[str, Any], n_tokens: int) -> dict[str, Any]:
    """The first ``n_tokens`` tokens of a byte-level BPE vocabulary and the merges they allow.

    Args:
        kv: metadata of a "gpt2" vocabulary.
        n_tokens: tokens to keep.

    Returns:
        ``tokenizer.*`` keys of the reduced vocabulary (pre-tokenizer unchanged).
    """
    tokens = list(kv["tokenizer.ggml.tokens"])[:n_tokens]
    keep = set(tokens)
    merges = []
    for m in kv["tokenizer.ggml.merges"]:
        a, _, b = m.partition(" ")
        if a in keep and b in keep and a + b in keep:
            merges.append(m)
    out = {k: v for k, v in kv.items() if k.startswith("tokenizer.ggml.")}
    out["tokenizer.ggml.tokens"] = tokens
    out["tokenizer.ggml.token_type"] = np.asarray(kv["tokenizer.ggml.token_type"])[:n_tokens]
    out["tokenizer.ggml.merges"] = merges
    for k in list(out):
        if k.endswith("_token_id") and int(out[k]) >= n_tokens:
            del out[k]
    return out


# merges (byte-level form: "Ġ" = space, "Ċ" = newline, "ĉ" = tab) that cross the boundaries where
# pre-tokenizers differ: digit groups, space+digit, punctuation+newline, whitespace runs, ...
EXTRA_MERGES = [
    "1 2",
    "12 3",
    "123 4",
    "4 5",
    "45 6",
    "456 7",
    "5 6",
    "56 7",
    "6 7",
    "9 9",
    "99 9",
    "999 9",
    "0 0",
    "00 0",
    "Ġ 1",
    "Ġ1 2",
    "Ġ 9",
    ". Ċ",
    "! Ċ",
    "? Ċ",
    ".Ċ Ċ",
    "Ġ Ċ",
    "Ċ Ġ",
    "ĠĊ Ġ",
    "( h",
    "@ e",
    "_ c",
    "' S",
    "' T",
    "'S Ġ",
    "ĉ ĉ",
    "Ġ ĉ",
    "ĉ Ġ",
    ". .",
    ".. .",
    "! !",
    "Ġ .",
    "Ġ !",
    "Ġ (",
    "a 1",
    "1 a",
    "Ġ '",
]


def with_extra_merges(
    kv: Mapping[str, Any], merges: Sequence[str] = EXTRA_MERGES
) -> dict[str, Any]:
    """Append merge rules (and the tokens they produce) to a byte-level BPE vocabulary.

    Args:
        kv: ``tokenizer.*`` keys of a "gpt2" vocabulary.
        merges: "left right" rules to append, lowest priority.

    Returns:
        The extended keys.
    """
    tokens = list(kv["tokenizer.ggml.tokens"])
    types = [int(t) for t in kv["tokenizer.ggml.token_type"]]
    have = set(tokens)
    for m in merges:
        a, _, b = m.partition(" ")
        if a + b not in have:
            tokens.append(a + b)
            types.append(1)
            have.add(a + b)
    out = dict(kv)
    out["tokenizer.ggml.tokens"] = tokens
    out["tokenizer.ggml.token_type"] = np.asarray(types, dtype=np.int32)
    out["tokenizer.ggml.merges"] = list(kv["tokenizer.ggml.merges"]) + list(merges)
    return out


# --- llama.cpp oracle -----------------------------------------------------------------------------
class LlamaOracle:
    """llama.cpp's tokenizer through llama-cpp-python (vocab-only load)."""

    def __init__(self, path: Path) -> None:
        """Load the vocabulary of ``path``.

        Args:
            path: GGUF file.
        """
        import llama_cpp

        self._lc = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab

    def tokenize(
        self, text: str | bytes, *, add_special: bool = False, special: bool = True
    ) -> list[int]:
        """``llama_tokenize``.

        Args:
            text: text (str, or raw bytes that need not be valid UTF-8).
            add_special: add BOS/EOS as the vocabulary asks.
            special: parse special tokens.

        Returns:
            Token ids.
        """
        raw = text if isinstance(text, bytes) else text.encode("utf-8")
        return self.llm.tokenize(raw, add_bos=add_special, special=special)

    def detokenize(
        self, ids: Sequence[int], *, remove_special: bool = False, unparse_special: bool = True
    ) -> bytes:
        """``llama_detokenize``.

        Args:
            ids: token ids.
            remove_special: drop leading BOS / trailing EOS.
            unparse_special: render special tokens.

        Returns:
            The bytes.
        """
        arr = (self._lc.llama_token * max(1, len(ids)))(*ids)
        size = 64 + 16 * len(ids)
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = self._lc.llama_detokenize(
                self.vocab, arr, len(ids), buf, size, remove_special, unparse_special
            )
            if n >= 0:
                return buf.raw[:n]
            size = -n + 1
        raise RuntimeError("llama_detokenize failed")

    def piece(self, token_id: int, special: bool = True) -> bytes:
        """``llama_token_to_piece``.

        Args:
            token_id: token.
            special: render special tokens.

        Returns:
            The piece bytes.
        """
        buf = ctypes.create_string_buffer(256)
        n = self._lc.llama_token_to_piece(self.vocab, token_id, buf, 256, 0, special)
        return buf.raw[:n]

    def n_vocab(self) -> int:
        """Vocabulary size.

        Returns:
            Number of tokens.
        """
        return self._lc.llama_vocab_n_tokens(self.vocab)

    def is_eog(self, token_id: int) -> bool:
        """``llama_vocab_is_eog``.

        Args:
            token_id: token.

        Returns:
            Whether llama.cpp treats it as end of generation.
        """
        return bool(self._lc.llama_vocab_is_eog(self.vocab, token_id))

    def bos_eos(self) -> tuple[int, int]:
        """BOS and EOS ids.

        Returns:
            (bos, eos), -1 when absent.
        """
        return self._lc.llama_vocab_bos(self.vocab), self._lc.llama_vocab_eos(self.vocab)

    def close(self) -> None:
        """Free the model."""
        self.llm.close()


# --- test strings ---------------------------------------------------------------------------------
GENESIS = (
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon the "
    "face of the waters. And God said, Let there be light: and there was light. And God saw the "
    "light, that it was good: and God divided the light from the darkness. And God called the "
    "light Day, and the darkness he called Night. And the evening and the morning were the first "
    "day.\n\n1:6 And God said, Let there be a firmament in the midst of the waters, and let it "
    "divide the waters from the waters."
)

COMMON_STRINGS = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n\n",
    " \t ",
    "\t\t\n \n",
    "Hello world",
    " Hello world",
    "Hello world ",
    "  Hello   world  ",
    "Hello\tworld\nnew line\r\nwindows",
    "The quick brown fox jumps over the lazy dog.",
    "THE QUICK BROWN FOX",
    "a",
    "A.",
    "hello, world! how are you? fine; thanks: ok...",
    "It's, I'm, you're, we've, they'll, he'd, don't",
    "IT'S I'M YOU'RE WE'VE THEY'LL HE'D DON'T",
    "'s 't 're 've 'll 'd 'm",
    "rock 'n' roll ' quote ' here",
    "1",
    "12",
    "123",
    "1234",
    "1234567890",
    "3.14159 and 2,718 and -42 and 1e10",
    "Call 555-0123 or +1 (800) 123-4567 at 10:30pm on 2024/05/01",
    "x=1;y=22;z=333;w=4444",
    "$100 costs 50% more & <tag> {brace} [bracket] |pipe| ~tilde~ ^caret^ `tick`",
    "!!!???...,,,;;;:::",
    "emails: someone@example.com, urls: https://example.com/path?q=1&r=2#frag",
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
    "def f(x):\n    return x * 2  # comment\n\n\tpass",
    "café naïve résumé façade jalapeño",
    "Ünïcödé ÀÉÎÕÜ àéîõü ßẞ",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ、ひらがな",
    "한국어 텍스트입니다",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "שלום עולם",
    "ελληνικά γράμματα",
    "हिन्दी पाठ",
    "ไทย ภาษา",
    "e\u0301 combining acute, a\u0308 umlaut, n\u0303",
    "emoji 🙂😀🎉 and flags 🇫🇷🇯🇵",
    "family 👨‍👩‍👧‍👦 zwj, skin 👍🏽",
    "zero\u200bwidth\u200cjoin\u200dhere",
    "nbsp\u00a0here\u2003em\u3000ideographic",
    "math: ∑ ∫ √ ∞ ≠ ≤ ≥ ± × ÷ ½ ¾ ² ³",
    "roman Ⅻ and circled ① ② and arabic-indic ٣٤٥",
    "tab\tseparated\tvalues\t1\t2\t3",
    "mixed 123abc abc123 a1b2c3",
    "   leading spaces and trailing spaces   ",
    "multiple     internal      spaces",
    "line1\n\nline2\n\n\nline3\n",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "text<|im_end|>text<|im_start|><|im_end|>",
    "not special: <|im_start without end, <im_end>, |im_end|",
    "control chars \x01\x02\x1f and del \x7f",
    "ÿþ \u0100\u017f Ā ſ",
    "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ　１２３",
    GENESIS,
]

# raw inputs that are not valid UTF-8; the tokenizer gets them decoded with surrogateescape
INVALID_UTF8 = [
    b"abc\xff\xfedef",
    b"\xe4\xbd",
    b"x \x80 y",
    b"\xc3( and \xc3",
    b"ok \xf0\x9f\x99 end",
    b"\xff \xfe  \xfd\n",
]
