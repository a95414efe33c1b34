"""Token pieces (the bytes a token stands for) and llama.cpp's decode-time space clean-up."""

from __future__ import annotations

from powerpy.tokenizer.merges import SPM_SPACE
from powerpy.tokenizer.specials import HIDDEN_ATTRS, TokenAttr
from powerpy.tokenizer.unicode import CHAR_TO_BYTE, utf8

__all__ = ["clean_spaces", "make_piece"]


def make_piece(text: str, attr: TokenAttr, model: str) -> bytes:
    """The bytes of one token, like ``llama_token_to_piece`` with special tokens rendered.

    Args:
        text: the token's vocabulary text.
        attr: its attributes.
        model: ``tokenizer.ggml.model`` ("llama": U+2581 is a space; "gpt2": GPT-2 byte chars).

    Returns:
        The piece (possibly an incomplete UTF-8 sequence).
    """
    if attr & (HIDDEN_ATTRS | TokenAttr.USER_DEFINED):
        return utf8(text)
    if attr & TokenAttr.NORMAL:
        if model == "llama":
            return utf8(text.replace(SPM_SPACE, " "))
        out = bytearray()
        for ch in text:
            b = CHAR_TO_BYTE.get(ch)
            if b is None:
                out += b"[UNK_BYTE_0x" + utf8(ch).hex().encode() + utf8(text) + b"]"
            else:
                out.append(b)
        return bytes(out)
    if attr & TokenAttr.BYTE:
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            return b"\x00"
    return b""


def clean_spaces(text: bytes) -> bytes:
    """llama.cpp's ``clean_up_tokenization_spaces`` passes, applied to detokenized bytes.

    Args:
        text: detokenized bytes.

    Returns:
        The bytes with the spaces before punctuation and contractions removed.
    """
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
