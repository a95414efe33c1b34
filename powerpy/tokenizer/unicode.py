"""Character classes and byte/text mappings shared by the pre-tokenizer, BPE and SPM.

* llama.cpp's whitespace set and the category "collapse" that lets ASCII-only Python regexes
  stand in for llama.cpp's ``\\p{L}``/``\\p{N}``/... classes;
* the GPT-2 byte <-> printable-character table of byte-level BPE vocabularies;
* UTF-8 helpers for text holding ``surrogateescape`` characters (undecodable bytes).

Unicode categories come from :mod:`unicodedata`; llama.cpp carries its own tables (Unicode 16 at
the time of writing), so characters assigned after the Python build's Unicode version are treated
as unassigned here.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = [
    "BYTE_ENCODE",
    "CHAR_TO_BYTE",
    "C_SPACES",
    "SURROGATES",
    "UCAT_CLASS",
    "UCAT_RE",
    "WHITESPACE",
    "byte_char",
    "byte_encode",
    "collapse",
    "utf8",
    "utf8_symbols",
    "widen",
]

C_SPACES = " \t\n\x0b\x0c\r"  # C isspace() in the "C" locale

# llama.cpp's whitespace set (White_Space property); note U+001C..U+001F are *not* in it.
WHITESPACE = frozenset(
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
        elif cp in WHITESPACE:
            out = "\x0b"
        else:
            out = _PH.get(unicodedata.category(chr(cp))[0], _PH_OTHER)
        self[cp] = out
        return out


_COLLAPSE = _CollapseTable()


def collapse(text: str) -> str:
    """``text`` with each non-ASCII character mapped to its class (same length; ``\\p{..}``)."""
    return text if text.isascii() else text.translate(_COLLAPSE)


def widen(text: str) -> str:
    """Text for category-free regexes: only non-ASCII whitespace is replaced (by \\x0b)."""
    if text.isascii():
        return text
    return "".join("\x0b" if ord(c) in WHITESPACE and ord(c) > 0x7F else c for c in text)


def _ascii_class(cat: str) -> str:
    chars = [chr(c) for c in range(0x20, 0x7F) if unicodedata.category(chr(c))[0] == cat]
    return "".join(re.escape(c) for c in chars)


# \p{X} name -> regex class body: the category placeholder plus the category's ASCII members
UCAT_CLASS = {
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
UCAT_RE = re.compile(r"\\p\{(N|L|P|M|S|Lu|Ll|Lt|Lm|Lo)\}")


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
BYTE_ENCODE = str.maketrans({chr(b): c for b, c in _BYTE_TO_CHAR.items()})  # latin-1 -> mapped
CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def byte_encode(word: str) -> str:
    """A word's UTF-8 bytes written with the GPT-2 byte characters (byte-level BPE input)."""
    return word.encode("utf-8").decode("latin-1").translate(BYTE_ENCODE)


def byte_char(b: int) -> str:
    """The one-character string a lone byte reads as (surrogateescape above 0x7F)."""
    return chr(b) if b < 0x80 else chr(0xDC00 + b)


# --- UTF-8 ----------------------------------------------------------------------------------------
SURROGATES = re.compile("[\ud800-\udfff]")


def utf8(text: str) -> bytes:
    """UTF-8 bytes of ``text``; lone surrogates give back the bytes they stand for.

    ``\\udc80``..``\\udcff`` (``surrogateescape``, as ``powerpy.formats.gguf_reader`` decodes
    non-UTF-8 strings) become the original byte, other surrogates are encoded as such.
    """
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def utf8_symbols(raw: bytes) -> list[str]:
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
