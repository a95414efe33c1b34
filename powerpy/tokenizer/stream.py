"""Incremental detokenization: token ids in, whole UTF-8 characters out."""

from __future__ import annotations

import codecs
from typing import Protocol

__all__ = ["PieceSource", "StreamDecoder"]


class PieceSource(Protocol):
    """What a :class:`StreamDecoder` needs of a tokenizer."""

    def token_to_piece(self, token_id: int, *, special: bool = True) -> bytes:
        """The bytes one token stands for."""
        ...


class StreamDecoder:
    """Incremental detokenizer that only ever returns whole UTF-8 characters.

    Pieces are concatenated like ``llama_token_to_piece`` output (llama.cpp's streaming
    behaviour); bytes of a character split across tokens are held back until it is complete.
    The concatenation of all returned chunks plus :meth:`flush` equals :meth:`Tokenizer.decode`
    whenever the vocabulary does not clean up spaces (``clean_spaces`` false: SPM, smollm,
    llama3, qwen2, ...); with clean-up, the raw pieces are returned.
    """

    def __init__(
        self,
        tokenizer: PieceSource,
        *,
        skip_special: bool = False,
        strip_leading_space: bool = False,
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
