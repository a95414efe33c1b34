"""Tokenizer built only from GGUF metadata, following llama.cpp's behaviour.

Two vocabulary types are supported, selected by ``tokenizer.ggml.model``:

* ``"gpt2"``: byte-level BPE. Text is split into words by the pre-tokenizer regexes that
  llama.cpp uses for ``tokenizer.ggml.pre``, each word's UTF-8 bytes are mapped to printable
  characters (GPT-2 byte-to-unicode table) and merged by merge rank.
* ``"llama"``: SentencePiece-style BPE. Spaces become U+2581, a space is prefixed to each text
  fragment at the start or after a special token (``add_space_prefix``), adjacent symbols are
  merged by token score, and characters missing from the vocabulary fall back to ``<0xXX>`` byte
  tokens.

Special tokens (CONTROL, USER_DEFINED and UNKNOWN types) are cut out of the text before the
pre-tokenizer runs, longest token first, like llama.cpp's ``tokenizer_st_partition``.

Unicode categories come from :mod:`unicodedata`; llama.cpp carries its own tables (Unicode 16 at
the time of writing), so characters assigned after the Python build's Unicode version are treated
as unassigned here.
"""

from __future__ import annotations

import codecs
import heapq
import logging
import os
import re
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntFlag
from typing import Any

from powerpy.constants import Keys, TokenType

log = logging.getLogger(__name__)

__all__ = ["StreamDecoder", "TokenAttr", "Tokenizer"]


class TokenAttr(IntFlag):
    """Per-token attributes, with llama.cpp's ``llama_token_attr`` bit values."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


_TYPE_TO_ATTR = {
    TokenType.NORMAL: TokenAttr.NORMAL,
    TokenType.UNKNOWN: TokenAttr.UNKNOWN,
    TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
    TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.BYTE: TokenAttr.BYTE,
}
_SPECIAL_ATTRS = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN
_HIDDEN_ATTRS = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # not rendered unless asked for

_SPM_SPACE = "\u2581"
_C_SPACES = " \t\n\x0b\x0c\r"  # C isspace() in the "C" locale

# --- character classes ----------------------------------------------------------------------
# llama.cpp's whitespace set (White_Space property); note U+001C..U+001F are *not* in it.
_WHITESPACE = frozenset(
    [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680]
    + list(range(0x2000, 0x200B))
    + [0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)

# Like llama.cpp, regexes run on a "collapsed" copy of the text: ASCII stays as is, non-ASCII
# whitespace becomes \x0b and any other non-ASCII character becomes one placeholder per Unicode
# category. Private-use code points serve as placeholders (real private-use characters, category
# Co, collapse to _PH_OTHER like every other non-ASCII character outside N/L/P/M/S).
_PH_OTHER = "\ue0d0"
_PH = {"N": "\ue0d1", "L": "\ue0d2", "P": "\ue0d3", "M": "\ue0d4", "S": "\ue0d5"}


class _CollapseTable(dict):
    """``str.translate`` table that fills itself on first sight of a non-ASCII code point."""

    def __missing__(self, cp: int) -> str:
        if cp < 0x80:
            out = chr(cp)
        elif cp in _WHITESPACE:
            out = "\x0b"
        else:
            out = _PH.get(unicodedata.category(chr(cp))[0], _PH_OTHER)
        self[cp] = out
        return out


_COLLAPSE = _CollapseTable()


def _collapse(text: str) -> str:
    """Map every character to its category class, keeping ASCII (same length as ``text``)."""
    return text if text.isascii() else text.translate(_COLLAPSE)


def _widen(text: str) -> str:
    """Text for category-free regexes: only non-ASCII whitespace is replaced (by \\x0b)."""
    if text.isascii():
        return text
    return "".join("\x0b" if ord(c) in _WHITESPACE and ord(c) > 0x7F else c for c in text)


def _ascii_class(cat: str) -> str:
    chars = [chr(c) for c in range(0x20, 0x7F) if unicodedata.category(chr(c))[0] == cat]
    return "".join(re.escape(c) for c in chars)


_UCAT_CLASS = {
    name: _PH[cat] + _ascii_class(cat)
    for name, cat in [
        ("N", "N"),
        ("L", "L"),
        ("P", "P"),
        ("M", "M"),
        ("S", "S"),
        ("Lu", "L"),
        ("Ll", "L"),
        ("Lt", "L"),
        ("Lm", "L"),
        ("Lo", "L"),
    ]
}
_UCAT_RE = re.compile(r"\\p\{(N|L|P|M|S|Lu|Ll|Lt|Lm|Lo)\}")


@dataclass(frozen=True)
class _Split:
    pattern: re.Pattern[str]
    collapsed: bool  # run on the collapsed text (pattern uses \p{..}) or on the widened text


def _compile_split(expr: str) -> _Split:
    """Translate one of llama.cpp's pre-tokenizer regexes into a Python pattern.

    ``\\p{X}`` becomes a character class over the category placeholder plus the ASCII members of
    the category, inside or outside brackets, as llama.cpp does for its std::regex fallback.

    Args:
        expr: the regex as llama.cpp writes it.

    Returns:
        The compiled pattern and which text representation it must run on.
    """
    if not _UCAT_RE.search(expr):
        return _Split(re.compile(expr, re.ASCII), collapsed=False)
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside = True
            out.append(c)
            i += 1
            continue
        if inside and c == "]" and expr[i - 1] != "\\":
            inside = False
            out.append(c)
            i += 1
            continue
        m = _UCAT_RE.match(expr, i)
        if m:
            cls = _UCAT_CLASS[m.group(1)]
            out.append(cls if inside else f"[{cls}]")
            i = m.end()
            continue
        out.append(c)
        i += 1
    return _Split(re.compile("".join(out), re.ASCII), collapsed=True)


# --- pre-tokenizers (regexes are llama.cpp's, per tokenizer.ggml.pre) -----------------------------
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# llama.cpp's custom GPT-2 splitter implements this regex including the final "|\s+".
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_RE_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + r"|\s+(?!\S)|\s+"
)
_RE_JAIS2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)"
    + r"|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
_RE_GPT4O_WORDS = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    + _CONTRACTIONS
    + r"?"
)
_RE_GPT4O = _RE_GPT4O_WORDS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_RE_GRANITE_EMB = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*"
    + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
_RE_SEED_CODER = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_RE_EXAONE_MOE = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
    + r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
_RE_MINICPM5 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_RE_GPT2,),
    "starcoder": (r"\p{N}", _RE_GPT2),
    "llama3": (_RE_LLAMA3,),
    "qwen2": (_RE_QWEN2,),
    "qwen35": (_RE_QWEN35,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _RE_GPT2, r"[0-9][0-9][0-9]"),
    "jais2": (_RE_JAIS2,),
    "gpt4o": (_RE_GPT4O,),
    "granite-emb": (_RE_GRANITE_EMB,),
    "tekken": (_RE_TEKKEN,),
    "bailingmoe": (_RE_BAILINGMOE,),
    "seed-coder": (_RE_SEED_CODER,),
    "ufakzeka": (_RE_UFAKZEKA,),
    "exaone-moe": (_RE_EXAONE_MOE,),
    "minicpm5": (r"\p{N}{1,3}", _RE_MINICPM5),
    "laguna": (r"[^\n]+|[\n]+", _RE_QWEN2),
    "chameleon": (
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _RE_GPT2,
    ),
}


@dataclass(frozen=True)
class _PreSpec:
    split: str  # key of _SPLITS
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False
    no_bos: bool = False


def _pre_table() -> dict[str, _PreSpec]:
    table: dict[str, _PreSpec] = {}

    def put(names: str, spec: _PreSpec) -> None:
        for n in names.split():
            table[n] = spec

    put("default", _PreSpec("default"))
    put(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        _PreSpec("llama3", ignore_merges=True, add_bos=True),
    )
    put("falcon", _PreSpec("falcon"))
    put(
        "mpt gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert"
        " jina-v1-en jina-v2-code roberta-bpe olmo jais exaone4",
        _PreSpec("gpt2"),
    )
    put("trillion granite-docling", _PreSpec("gpt2", clean_spaces=False))
    put("starcoder refact codeshell exaone minerva-7b mellum2", _PreSpec("starcoder"))
    put("command-r smollm", _PreSpec("starcoder", clean_spaces=False))
    put(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open grok-2",
        _PreSpec("qwen2", clean_spaces=False),
    )
    put("stablelm2 megrez", _PreSpec("qwen2"))
    put("qwen35", _PreSpec("qwen35", clean_spaces=False))
    put("dbrx smaug-bpe", _PreSpec("llama3"))
    put("chatglm-bpe", _PreSpec("llama3", no_bos=True))
    put("glm4 glm5", _PreSpec("llama3", no_bos=True, ignore_merges=True))
    put("jais-2", _PreSpec("jais2"))
    put("gpt-4o llama4 kanana2 talkie minimax-m2", _PreSpec("gpt4o", clean_spaces=False))
    put(
        "granite-embed-multi-97m",
        _PreSpec("granite-emb", clean_spaces=False, ignore_merges=True),
    )
    put("tekken", _PreSpec("tekken", clean_spaces=False, ignore_merges=True, add_bos=True))
    put("bailingmoe bailingmoe2 llada-moe", _PreSpec("bailingmoe", clean_spaces=False))
    put("seed-coder", _PreSpec("seed-coder", clean_spaces=False))
    put("ufakzeka", _PreSpec("ufakzeka", clean_spaces=False))
    put("exaone-moe", _PreSpec("exaone-moe"))
    put("minicpm5", _PreSpec("minicpm5", ignore_merges=True))
    put("laguna", _PreSpec("laguna", clean_spaces=False))
    put("chameleon", _PreSpec("chameleon", clean_spaces=False, add_bos=True))
    return table


_PRE_TYPES = _pre_table()
_COMPILED_SPLITS: dict[str, tuple[_Split, ...]] = {}


def _splits_for(name: str) -> tuple[_Split, ...]:
    if name not in _COMPILED_SPLITS:
        _COMPILED_SPLITS[name] = tuple(_compile_split(e) for e in _SPLITS[name])
    return _COMPILED_SPLITS[name]


def supported_pre_tokenizers() -> list[str]:
    """Names of ``tokenizer.ggml.pre`` values this module implements.

    Returns:
        Sorted pre-tokenizer names.
    """
    return sorted(_PRE_TYPES)


# --- GPT-2 byte <-> unicode mapping ---------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_BYTE_ENCODE = str.maketrans({chr(b): c for b, c in _BYTE_TO_CHAR.items()})  # latin-1 -> mapped
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _byte_encode(word: str) -> str:
    return word.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE)


def _utf8_symbols(raw: bytes) -> list[str]:
    """Split bytes into characters by lead-byte length (llama.cpp's rule for SPM symbols).

    Invalid bytes stay as ``surrogateescape`` characters so that they round-trip.
    """
    out = []
    i, n = 0, len(raw)
    while i < n:
        step = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[raw[i] >> 4]
        out.append(raw[i : i + step].decode("utf-8", "surrogateescape"))
        i += step
    return out


def _merge_pairs(syms: list[str], priority: Callable[[str, str], float | None]) -> list[str]:
    """Merge adjacent symbols greedily, lowest ``priority`` first (ties: leftmost), as llama.cpp's
    BPE (merge rank) and SPM (negated token score) tokenizers do; None means "not mergeable".

    A doubly linked list over ``syms`` plus a heap of candidate pairs; a popped pair is stale when
    either side was merged since it was pushed (symbols only grow, so the length tells).
    Returns the merged symbols in order.
    """
    n = len(syms)
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    if n:
        nxt[-1] = -1
    heap = []
    for i in range(n - 1):
        p = priority(syms[i], syms[i + 1])
        if p is not None:
            heap.append((p, i, i + 1, len(syms[i]) + len(syms[i + 1])))
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        _, left, right, size = pop(heap)
        ls, rs = syms[left], syms[right]
        if not ls or not rs or len(ls) + len(rs) != size:
            continue
        merged = ls + rs
        syms[left] = merged
        syms[right] = ""
        after = nxt[right]
        nxt[left] = after
        if after >= 0:
            prv[after] = left
        before = prv[left]
        if before >= 0:
            p = priority(syms[before], merged)
            if p is not None:
                push(heap, (p, before, left, len(syms[before]) + len(merged)))
        if after >= 0:
            p = priority(merged, syms[after])
            if p is not None:
                push(heap, (p, left, after, len(merged) + len(syms[after])))
    return [s for s in syms if s]


def _byte_char(b: int) -> str:
    """The one-character string a lone byte reads as (surrogateescape above 0x7F)."""
    return chr(b) if b < 0x80 else chr(0xDC00 + b)


_SURROGATES = re.compile("[\ud800-\udfff]")


def _utf8(text: str) -> bytes:
    """UTF-8 bytes of ``text``; lone surrogates give back the bytes they stand for.

    ``\udc80``..``\udcff`` (``surrogateescape``, as ``powerpy.gguf_io`` decodes non-UTF-8
    strings) become the original byte, other surrogates are encoded as such.
    """
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


# --- token texts llama.cpp recognises by name -----------------------------------------------------
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)  # fmt: skip
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
        "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
        "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
        "\u2581<MID>", "<|code_middle|>", "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})  # fmt: skip
_ROLE_KEYS = {
    "bos": Keys.BOS_ID, "eos": Keys.EOS_ID, "eot": Keys.EOT_ID, "eom": Keys.EOM_ID,
    "unk": Keys.UNK_ID, "sep": Keys.SEP_ID, "pad": Keys.PAD_ID, "mask": Keys.MASK_ID,
    "fim_pre": Keys.FIM_PRE_ID, "fim_suf": Keys.FIM_SUF_ID, "fim_mid": Keys.FIM_MID_ID,
    "fim_pad": Keys.FIM_PAD_ID, "fim_rep": Keys.FIM_REP_ID, "fim_sep": Keys.FIM_SEP_ID,
}  # fmt: skip
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


# --- helpers for metadata -------------------------------------------------------------------------
def _as_str(v: Any) -> str:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).decode("utf-8", errors="replace")
    return str(v)


def _as_list(v: Any) -> list[Any]:
    tolist = getattr(v, "tolist", None)
    return list(tolist()) if tolist is not None else list(v)


def _as_bool(v: Any) -> bool:
    if isinstance(v, (list, tuple)) or getattr(v, "ndim", 0):
        v = _as_list(v)[0]
    return bool(v)


def _as_int(v: Any) -> int:
    if isinstance(v, (list, tuple)) or getattr(v, "ndim", 0):
        v = _as_list(v)[0]
    return int(v)


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's ``clean_up_tokenization_spaces`` passes, applied to detokenized bytes."""
    buf = bytearray(text)
    sp, ap = 0x20, 0x27

    # pass 1: " ?", " !", " .", " ," lose the space
    n = len(buf)
    total = 1 if n else 0
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == sp and x in b"?!.,":
            total -= 1
        buf[total] = x
        total += 1
    del buf[total:]

    # pass 2: a lone apostrophe between spaces loses both spaces
    n = len(buf)
    total = 1 if n else 0
    i = 1
    while i < n:
        x = buf[i]
        if x == ap and i + 1 < n and buf[i - 1] == sp and buf[i + 1] == sp:
            total -= 1
            i += 1
            buf[i] = 0  # the following space is dropped (and no longer reads as a space)
        buf[total] = x
        total += 1
        i += 1
    del buf[total:]

    # pass 3: " 's", " 'm", " 're", " 've" lose the space (" 't", " 'd", " 'll" keep it)
    n = len(buf)
    total = 1 if n else 0
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == sp and x == ap and i + 1 < n:
            x1 = buf[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < n:
                x2 = buf[i + 2]
                if (x1, x2) in ((0x72, 0x65), (0x76, 0x65)):  # "re", "ve"
                    total -= 1
        buf[total] = x
        total += 1
    del buf[total:]
    return bytes(buf)


_CHATML_DEFAULT_SYSTEM = re.compile(
    r"messages\[0\]\['role'\]\s*!=\s*'system'\s*%\}\s*\{\{\s*'<\|im_start\|>system\n(.*?)<\|im_end\|>",
    re.DOTALL,
)


class Tokenizer:
    """Text <-> token ids for a GGUF vocabulary, matching llama.cpp.

    Build one with :meth:`from_gguf_kv`. Attributes: ``model`` ("gpt2" or "llama"), ``pre``,
    ``vocab_size``, ``bos_id``, ``eos_id``, ``unk_id``, ``pad_id``, ``eot_id``, ``eom_id`` (``None``
    when absent), ``eog_ids`` (frozenset), ``add_bos``, ``add_eos``, ``add_space_prefix``,
    ``clean_spaces`` and ``chat_template``.
    """

    _CACHE_LIMIT = 200_000

    def __init__(
        self,
        *,
        model: str,
        tokens: Sequence[str],
        token_types: Sequence[int] | None = None,
        scores: Sequence[float] | None = None,
        merges: Sequence[str] | None = None,
        pre: str | None = None,
        special_ids: Mapping[str, int] | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        add_space_prefix: bool | None = None,
        model_name: str = "",
        chat_template: str | None = None,
    ) -> None:
        """Build a tokenizer from already-decoded vocabulary data.

        Most callers want :meth:`from_gguf_kv`.

        Args:
            model: ``tokenizer.ggml.model``: "gpt2" or "llama".
            tokens: token texts, index = id.
            token_types: ``TokenType`` per token (all NORMAL when missing).
            scores: per-token scores (SPM merge priorities); zeros when missing.
            merges: "left right" merge rules in rank order (required for "gpt2").
            pre: ``tokenizer.ggml.pre`` (gpt2 only); missing means llama.cpp's "default".
            special_ids: ids from metadata keyed by role ("bos", "eos", "unk", "pad", "eot",
                "eom", "sep", "mask", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep",
                "fim_sep").
            add_bos: ``tokenizer.ggml.add_bos_token`` (``None``: llama.cpp's default).
            add_eos: ``tokenizer.ggml.add_eos_token`` (``None``: false).
            add_space_prefix: ``tokenizer.ggml.add_space_prefix`` (``None``: true for llama).
            model_name: ``general.name``; llama.cpp adjusts a few token attributes by it.
            chat_template: ``tokenizer.chat_template``.

        Raises:
            ValueError: unsupported tokenizer model or pre-tokenizer, or missing merges.
        """
        if model not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer.ggml.model {model!r} (need 'gpt2' or 'llama')")
        self.model = model
        self.chat_template = chat_template
        n = len(tokens)
        self.vocab_size = n

        texts: list[str] = []
        for i, t in enumerate(tokens):
            t = _as_str(t)
            if not t:
                log.warning("empty token at index %d", i)
                t = f"[EMPTY_{i}]"
            texts.append(t)
        self._texts = texts
        self._token_to_id: dict[str, int] = {t: i for i, t in enumerate(texts)}

        if scores is None:
            self._scores = [0.0] * n
        else:
            self._scores = [float(s) for s in _as_list(scores)[:n]]
            if len(self._scores) < n:
                raise ValueError(f"{len(self._scores)} scores for {n} tokens")
        if token_types is None:
            attrs = [TokenAttr.NORMAL] * n
        else:
            tt = [int(x) for x in _as_list(token_types)[:n]]
            if len(tt) < n:
                raise ValueError(f"{len(tt)} token types for {n} tokens")
            attrs = [_TYPE_TO_ATTR.get(t, TokenAttr.UNDEFINED) for t in tt]
        self._attrs: list[TokenAttr] = attrs

        ids = dict(special_ids or {})
        if model == "llama":
            self.pre = None
            defaults = {"bos": 1, "eos": 2, "unk": 0}
            self.add_bos = True
            self.add_space_prefix = True
            self.clean_spaces = False
            self._ignore_merges = False
            self._splits: tuple[_Split, ...] = ()
            self._ranks: dict[tuple[str, str], int] = {}
        else:
            if pre is None or pre == "":
                log.warning("missing tokenizer.ggml.pre: using llama.cpp's 'default' pre-tokenizer")
                pre = "default"
            spec = _PRE_TYPES.get(pre)
            if spec is None:
                raise ValueError(
                    f"unsupported pre-tokenizer {pre!r}; supported: {', '.join(sorted(_PRE_TYPES))}"
                )
            self.pre = pre
            defaults = {"bos": 11, "eos": 11}
            if spec.no_bos:
                defaults.pop("bos")
            self.add_bos = spec.add_bos
            self.add_space_prefix = False
            self.clean_spaces = spec.clean_spaces
            self._ignore_merges = spec.ignore_merges
            self._splits = _splits_for(spec.split)
            if merges is None:
                raise ValueError("gpt2 tokenizer needs tokenizer.ggml.merges")
            self._ranks = {}
            for rank, line in enumerate(merges):
                line = _as_str(line)
                pos = line.find(" ", 1)
                pair = (line[:pos], line[pos + 1 :]) if pos >= 0 else ("", "")
                self._ranks.setdefault(pair, rank)
        self.add_eos = False
        if add_bos is not None:
            self.add_bos = bool(add_bos)
        if add_eos is not None:
            self.add_eos = bool(add_eos)
        if add_space_prefix is not None:
            self.add_space_prefix = bool(add_space_prefix)

        role_ids: dict[str, int | None] = {}
        for role in _ROLE_KEYS:
            rid = defaults.get(role)
            if rid is not None and rid >= n:
                rid = None
            new = ids.get(role)
            if new is not None:
                if 0 <= int(new) < n:
                    rid = int(new)
                else:
                    log.warning("special token %s = %s is out of range; ignored", role, new)
            role_ids[role] = rid
        self._detect_special(role_ids, model_name)

        self.bos_id: int | None = role_ids["bos"]
        self.eos_id: int | None = role_ids["eos"]
        self.unk_id: int | None = role_ids["unk"]
        self.pad_id: int | None = role_ids["pad"]
        self.eot_id: int | None = role_ids["eot"]
        self.eom_id: int | None = role_ids["eom"]
        self.special_ids: dict[str, int | None] = role_ids

        special = [i for i in range(n) if self._attrs[i] & _SPECIAL_ATTRS]
        special.sort(key=lambda i: -len(_utf8(self._texts[i])))
        self._special_order = special

        self._pieces: list[bytes | None] = [None] * n
        self._bpe_cache: dict[str, tuple[int, ...]] = {}

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def from_gguf_kv(cls, kv: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from GGUF metadata.

        Args:
            kv: metadata mapping as produced by ``powerpy.gguf_io.read_gguf(path).kv``: strings as
                ``str`` (``bytes`` accepted), arrays as lists or numpy arrays.

        Returns:
            The tokenizer.

        Raises:
            ValueError: metadata missing or of an unsupported tokenizer kind.
        """
        if Keys.TOKENIZER_MODEL not in kv or Keys.TOKENS not in kv:
            raise ValueError("GGUF metadata has no tokenizer (tokenizer.ggml.model / tokens)")

        def opt(key: str, conv: Any) -> Any:
            return conv(kv[key]) if key in kv and kv[key] is not None else None

        special: dict[str, int] = {}
        for role, key in _ROLE_KEYS.items():
            v = opt(key, _as_int)
            if v is not None:
                special[role] = v
        # deprecated aliases are read after the new keys, so they win when both exist (as in
        # llama.cpp, which reads them last)
        for role, key in (
            ("fim_pre", Keys.PREFIX_ID),
            ("fim_suf", Keys.SUFFIX_ID),
            ("fim_mid", Keys.MIDDLE_ID),
        ):
            v = opt(key, _as_int)
            if v is not None:
                special[role] = v

        merges = opt(Keys.MERGES, _as_list)
        return cls(
            model=_as_str(kv[Keys.TOKENIZER_MODEL]),
            tokens=[_as_str(t) for t in _as_list(kv[Keys.TOKENS])],
            token_types=opt(Keys.TOKEN_TYPE, _as_list),
            scores=opt(Keys.SCORES, _as_list),
            merges=merges,
            pre=opt(Keys.TOKENIZER_PRE, _as_str),
            special_ids=special,
            add_bos=opt(Keys.ADD_BOS, _as_bool),
            add_eos=opt(Keys.ADD_EOS, _as_bool),
            add_space_prefix=opt(Keys.ADD_SPACE_PREFIX, _as_bool),
            model_name=opt(Keys.NAME, _as_str) or "",
            chat_template=opt(Keys.CHAT_TEMPLATE, _as_str),
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer from a GGUF/PWRI file's metadata.

        Args:
            path: model file.

        Returns:
            The tokenizer.
        """
        from powerpy.gguf_io import read_gguf

        gf = read_gguf(path)
        try:
            return cls.from_gguf_kv(gf.kv)
        finally:
            gf.close()

    def _detect_special(self, role_ids: dict[str, int | None], model_name: str) -> None:
        """Recognise EOT/EOM/FIM/EOG tokens by text and fix attributes, as llama.cpp does."""
        attrs = self._attrs
        texts = self._texts
        tti = self._token_to_id

        def mark_control(tid: int) -> None:
            if not attrs[tid] & TokenAttr.CONTROL:
                log.debug(
                    "token %d %r looks like a control token: marking it CONTROL", tid, texts[tid]
                )
                attrs[tid] |= TokenAttr.CONTROL

        detect = {"eot": _EOT_TEXTS, "eom": _EOM_TEXTS, **_FIM_TEXTS}
        for role, candidates in detect.items():
            if role_ids.get(role) is not None:
                continue
            for text in candidates:
                tid = tti.get(text)
                if tid is not None:
                    role_ids[role] = tid
                    mark_control(tid)
                    break

        for tid in tti.values():
            if attrs[tid] & TokenAttr.CONTROL and "unused" in texts[tid]:
                attrs[tid] |= TokenAttr.UNUSED

        eog: set[int] = set()
        for role in ("fim_pad", "fim_rep", "fim_sep"):
            if role_ids.get(role) is not None:
                eog.add(role_ids[role])  # type: ignore[arg-type]
        for text in _EOG_TEXTS:
            tid = tti.get(text)
            if tid is not None:
                eog.add(tid)
                mark_control(tid)
        for text in _ALWAYS_RENDERED:
            tid = tti.get(text)
            if tid is not None:
                attrs[tid] = TokenAttr.USER_DEFINED
        for role in ("eos", "eot", "eom"):
            if role_ids.get(role) is not None:
                eog.add(role_ids[role])  # type: ignore[arg-type]

        texts_of = {texts[t]: t for t in eog}
        if "<|end|>" in texts_of and (
            ("<|return|>" in texts_of and ("<|call|>" in texts_of or "<|calls|>" in texts_of))
            or (("<|call|>" in texts_of or "<|calls|>" in texts_of) and "<|flush|>" in texts_of)
        ):
            end_id = texts_of["<|end|>"]
            eog.discard(end_id)
            attrs[end_id] = TokenAttr.USER_DEFINED
        if "</s>" in texts_of and ("<|tool_response>" in texts_of or "<|plamo:eos|>" in texts_of):
            s_id = texts_of["</s>"]
            eog.discard(s_id)
            attrs[s_id] = TokenAttr.NORMAL
        self.eog_ids: frozenset[int] = frozenset(eog)

        name = model_name.lower()
        if "phi-3" in name or "phi3" in name:
            for tid in range(len(attrs)):
                if attrs[tid] & _SPECIAL_ATTRS:
                    attrs[tid] |= TokenAttr.RSTRIP
            if "</s>" in tti:
                attrs[tti["</s>"]] |= TokenAttr.RSTRIP
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                if text in tti:
                    attrs[tti[text]] &= ~TokenAttr.RSTRIP

    # --- queries -------------------------------------------------------------------------------
    def is_eog(self, token_id: int) -> bool:
        """Whether ``token_id`` ends generation (EOS, EOT, <|im_end|>, ...).

        Args:
            token_id: token id.

        Returns:
            True for end-of-generation tokens.
        """
        return token_id in self.eog_ids

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary text of a token (byte-level or U+2581-escaped as stored).

        Args:
            token_id: token id.

        Returns:
            The stored token text.
        """
        return self._texts[token_id]

    def token_attr(self, token_id: int) -> TokenAttr:
        """The token's attributes after llama.cpp's adjustments.

        Args:
            token_id: token id.

        Returns:
            The attribute flags.
        """
        return self._attrs[token_id]

    def is_special(self, token_id: int) -> bool:
        """Whether a token is CONTROL or UNKNOWN (hidden by ``decode(skip_special=True)``).

        Args:
            token_id: token id.

        Returns:
            True for control/unknown tokens.
        """
        return bool(self._attrs[token_id] & _HIDDEN_ATTRS)

    def token_id(self, text: str) -> int | None:
        """Id of the token whose vocabulary text is exactly ``text``.

        Args:
            text: raw token text.

        Returns:
            The id, or None.
        """
        return self._token_to_id.get(text)

    # --- encoding ------------------------------------------------------------------------------
    def encode(
        self,
        text: str,
        *,
        add_bos: bool | None = None,
        parse_special: bool = True,
        add_eos: bool = False,
    ) -> list[int]:
        """Tokenize ``text`` like ``llama_tokenize``.

        Args:
            text: the text. Lone surrogates stand for undecodable bytes (``surrogateescape``):
                byte-level vocabularies see U+FFFD for them, as llama.cpp does for invalid
                UTF-8, SPM ones fall back to the original bytes.
            add_bos: prepend BOS; ``None`` uses ``tokenizer.ggml.add_bos_token`` (llama.cpp
                default when absent: true for "llama" vocabularies and the llama3-style
                pre-tokenizers, false for other "gpt2" vocabularies).
            parse_special: recognise control tokens written in the text (``<|im_start|>``);
                user-defined tokens are recognised either way.
            add_eos: append EOS when the vocabulary asks for it (``add_eos_token``), like
                llama.cpp's ``add_special``; off by default.

        Returns:
            Token ids.

        Raises:
            ValueError: BOS/EOS requested but the vocabulary has none.
        """
        want_bos = self.add_bos if add_bos is None else add_bos
        out: list[int] = []
        if want_bos:
            if self.bos_id is None:
                raise ValueError("BOS requested but the vocabulary has no BOS token")
            out.append(self.bos_id)
        if self.model == "gpt2" and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # llama.cpp reads undecodable bytes as U+FFFD
                text = _SURROGATES.sub("\ufffd", text)
        fragments = self._partition(text, parse_special)
        if self.model == "llama":
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._spm(frag.replace(" ", _SPM_SPACE)))
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    for word in self._pretokenize(frag):
                        out.extend(self._bpe_word(word))
        if add_eos and self.add_eos:
            if self.eos_id is None:
                raise ValueError("EOS requested but the vocabulary has no EOS token")
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of ``text``: a list of raw-text pieces and token ids."""
        frags: list[str | int] = [text] if text else []
        for sid in self._special_order:
            attr = self._attrs[sid]
            if not parse_special and attr & _HIDDEN_ATTRS:
                continue
            stext = self._texts[sid]
            if not any(isinstance(f, str) and stext in f for f in frags):
                continue
            new: list[str | int] = []
            slen = len(stext)
            for f in frags:
                if isinstance(f, int) or stext not in f:
                    new.append(f)
                    continue
                base, end = 0, len(f)
                while True:
                    m = f.find(stext, base, end)
                    if m < 0:
                        if base < end:
                            new.append(f[base:end])
                        break
                    left = m
                    if attr & TokenAttr.LSTRIP:
                        while left > base and f[left - 1] in _C_SPACES:
                            left -= 1
                    if left > base:
                        new.append(f[base:left])
                    new.append(sid)
                    base = m + slen
                    if attr & TokenAttr.RSTRIP:
                        while base < end and f[base] in _C_SPACES:
                            base += 1
            frags = new
        return frags

    def _pretokenize(self, text: str) -> list[str]:
        """Split a text fragment into BPE words with the pre-tokenizer regexes."""
        spans = [(0, len(text))]
        collapsed: str | None = None
        widened: str | None = None
        for split in self._splits:
            if split.collapsed:
                if collapsed is None:
                    collapsed = _collapse(text)
                subject = collapsed
            else:
                if widened is None:
                    widened = _widen(text)
                subject = widened
            finditer = split.pattern.finditer
            new: list[tuple[int, int]] = []
            for a, b in spans:
                pos = a
                for m in finditer(subject, a, b):
                    s, e = m.span()
                    if s > pos:
                        new.append((pos, s))
                    if e > s:
                        new.append((s, e))
                    pos = e
                if pos < b:
                    new.append((pos, b))
            spans = new
        return [text[a:b] for a, b in spans]

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        cached = self._bpe_cache.get(word)
        if cached is not None:
            return cached
        ids = self._bpe(_byte_encode(word))
        if len(self._bpe_cache) >= self._CACHE_LIMIT:
            self._bpe_cache.clear()
        self._bpe_cache[word] = ids
        return ids

    def _bpe(self, word: str) -> tuple[int, ...]:
        """Merge the (byte-encoded) characters of one word by merge rank."""
        tti = self._token_to_id
        if self._ignore_merges and word in tti:
            return (tti[word],)
        ranks = self._ranks
        syms = _merge_pairs(list(word), lambda a, b: ranks.get((a, b)))
        out: list[int] = []
        for s in syms:
            tid = tti.get(s)
            if tid is not None:
                out.append(tid)
                continue
            # llama.cpp looks up each UTF-8 byte of the symbol as a one-byte token
            for b in s.encode("utf-8"):
                tid = tti.get(_byte_char(b))
                if tid is not None:
                    out.append(tid)
        return tuple(out)

    def _spm(self, text: str) -> list[int]:
        """SentencePiece-style merging of one escaped text fragment by token score."""
        try:
            text.encode("utf-8")
            syms = list(text)
        except UnicodeEncodeError:
            syms = _utf8_symbols(_utf8(text))
        tti, scores = self._token_to_id, self._scores

        def priority(a: str, b: str) -> float | None:  # higher score first
            tid = tti.get(a + b)
            return None if tid is None else -scores[tid]

        out: list[int] = []
        for sym in _merge_pairs(syms, priority):
            tid = tti.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_token(b) for b in _utf8(sym))
        return out

    def _byte_token(self, b: int) -> int:
        tid = self._token_to_id.get(f"<0x{b:02X}>")
        if tid is None:
            tid = self._token_to_id.get(_byte_char(b))
        if tid is None:
            if self.unk_id is None:
                raise ValueError(f"no byte token for 0x{b:02X} and no unknown token")
            tid = self.unk_id
        return tid

    # --- decoding ------------------------------------------------------------------------------
    def token_to_piece(self, token_id: int, *, special: bool = True) -> bytes:
        """The bytes one token stands for, like ``llama_token_to_piece`` (no space stripping).

        Args:
            token_id: token id.
            special: render control/unknown tokens as their text (else they give ``b""``).

        Returns:
            The piece's bytes (possibly an incomplete UTF-8 sequence).

        Raises:
            IndexError: id out of range.
        """
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} out of range [0, {self.vocab_size})")
        if not special and self._attrs[token_id] & _HIDDEN_ATTRS:
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._make_piece(token_id)
            self._pieces[token_id] = piece
        return piece

    def _make_piece(self, token_id: int) -> bytes:
        attr = self._attrs[token_id]
        text = self._texts[token_id]
        if attr & (_HIDDEN_ATTRS | TokenAttr.USER_DEFINED):
            return _utf8(text)
        if attr & TokenAttr.NORMAL:
            if self.model == "llama":
                return _utf8(text.replace(_SPM_SPACE, " "))
            out = bytearray()
            for ch in text:
                b = _CHAR_TO_BYTE.get(ch)
                if b is None:
                    out += b"[UNK_BYTE_0x" + _utf8(ch).hex().encode() + _utf8(text) + b"]"
                else:
                    out.append(b)
            return bytes(out)
        if attr & TokenAttr.BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b"\x00"
        return b""

    def decode_bytes(
        self, ids: Sequence[int], *, remove_special: bool = False, unparse_special: bool = True
    ) -> bytes:
        """Detokenize to bytes exactly like ``llama_detokenize``.

        Args:
            ids: token ids.
            remove_special: drop a leading BOS / trailing EOS the vocabulary would add.
            unparse_special: render control/unknown tokens as their text.

        Returns:
            The bytes (may end in an incomplete UTF-8 sequence).
        """
        ids = list(ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = []
        for tid in ids:
            piece = self.token_to_piece(tid, special=unparse_special)
            if remove_space and piece[:1] == b" ":
                piece = piece[1:]
            remove_space = False
            parts.append(piece)
        out = b"".join(parts)
        if self.clean_spaces:
            out = _clean_spaces(out)
        return out

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Detokenize to text.

        Same as ``llama_detokenize(remove_special=skip_special, unparse_special=not
        skip_special)``, decoded as UTF-8 with invalid bytes replaced by U+FFFD.

        Args:
            ids: token ids.
            skip_special: hide control/unknown tokens (BOS, EOS, <|im_end|>, ...).

        Returns:
            The text.
        """
        raw = self.decode_bytes(ids, remove_special=skip_special, unparse_special=not skip_special)
        return raw.decode("utf-8", errors="replace")

    def stream_decoder(
        self, *, skip_special: bool = False, strip_leading_space: bool | None = None
    ) -> StreamDecoder:
        """A decoder that turns tokens into text one at a time.

        Args:
            skip_special: hide control/unknown tokens.
            strip_leading_space: drop one leading space of the first token's piece, as
                :meth:`decode` does for SPM vocabularies; ``None`` uses ``add_space_prefix``.
                Pass False when streaming a continuation of an already-decoded prompt.

        Returns:
            A fresh :class:`StreamDecoder`.
        """
        strip = self.add_space_prefix if strip_leading_space is None else strip_leading_space
        return StreamDecoder(self, skip_special=skip_special, strip_leading_space=strip)

    # --- chat ----------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ChatML conversations (``<|im_start|>role\\ncontent<|im_end|>\\n``).

        Only ChatML templates are supported. When the template inserts a default system message
        if the first message is not a system one (SmolLM2 does), that message is inserted too.

        Args:
            messages: ``{"role": ..., "content": ...}`` dicts.
            add_generation_prompt: end with ``<|im_start|>assistant\\n``.

        Returns:
            The prompt text (encode it with ``parse_special=True``).

        Raises:
            NotImplementedError: the template is not ChatML.
        """
        tpl = self.chat_template or ""
        if "<|im_start|>" not in tpl or "<|im_end|>" not in tpl:
            raise NotImplementedError("only ChatML chat templates are supported")
        parts = []
        default_system = _CHATML_DEFAULT_SYSTEM.search(tpl)
        if default_system and messages and messages[0]["role"] != "system":
            parts.append(f"<|im_start|>system\n{default_system.group(1)}<|im_end|>\n")
        for msg in messages:
            parts.append(f"<|im_start|>{msg['role']}\n{msg['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


class StreamDecoder:
    """Incremental detokenizer that only ever returns whole UTF-8 characters.

    Pieces are concatenated like ``llama_token_to_piece`` output (llama.cpp's streaming
    behaviour); bytes of a character split across tokens are held back until it is complete.
    The concatenation of all returned chunks plus :meth:`flush` equals :meth:`Tokenizer.decode`
    whenever the vocabulary does not clean up spaces (``clean_spaces`` false: SPM, smollm,
    llama3, qwen2, ...); with clean-up, the raw pieces are returned.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special: bool = False, strip_leading_space: bool = False
    ) -> None:
        """Create a decoder.

        Args:
            tokenizer: the tokenizer whose pieces are decoded.
            skip_special: hide control/unknown tokens.
            strip_leading_space: drop one leading space of the first token's piece.
        """
        self._tok = tokenizer
        self._special = not skip_special
        self._strip = strip_leading_space
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token.

        Args:
            token_id: the next token id.

        Returns:
            The newly completed text (possibly empty).
        """
        piece = self._tok.token_to_piece(token_id, special=self._special)
        if self._strip:
            self._strip = False
            if piece[:1] == b" ":
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Finish: return whatever is buffered (an incomplete sequence becomes U+FFFD).

        Returns:
            Remaining text.
        """
        return self._utf8.decode(b"", final=True)
