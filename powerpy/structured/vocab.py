"""A model's vocabulary as the grammar engine (llguidance) sees it: each token's bytes, the
special tokens (never matched by grammar text) and the end-of-generation tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from powerpy.tokenizer import Tokenizer
from powerpy.tokenizer.specials import SPECIAL_ATTRS


def token_pieces(tok: Tokenizer) -> tuple[list[bytes], list[int]]:
    """Every token's bytes (``token_to_piece``) and the ids of the special tokens."""
    pieces = [tok.token_to_piece(i, special=True) for i in range(tok.vocab_size)]
    special = [i for i in range(tok.vocab_size) if tok.token_attr(i) & SPECIAL_ATTRS]
    return pieces, special


class _Source:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer."""

    def __init__(self, pieces, special, eos_ids, encode: Callable[[str], list[int]]) -> None:
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = None
        self.tokens = list(pieces)
        self.special_token_ids = list(special)
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            raise TypeError("text, not bytes")  # llguidance then passes str
        return self._encode(text)


def ll_tokenizer(
    pieces: Sequence[bytes],
    special: Sequence[int],
    eos: int | Sequence[int],
    encode: Callable[[str], list[int]],
) -> Any:
    """An ``llguidance.LLTokenizer`` over ``pieces`` (token id -> bytes); ``special`` tokens
    match no grammar text; ``eos``: the end-of-generation id(s), allowed where the grammar
    ends; ``encode`` tokenizes text without BOS."""
    import llguidance

    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    wrapper = llguidance.TokenizerWrapper(_Source(pieces, special, eos_ids, encode))
    return llguidance.LLTokenizer(wrapper, eos_token=eos_ids)


def tokenizer_for(tok: Tokenizer) -> Any:
    """The ``LLTokenizer`` of a model's tokenizer (built once per tokenizer: a 49k vocabulary
    takes about a second)."""
    cached = getattr(tok, "_llguidance", None)
    if cached is None:
        pieces, special = token_pieces(tok)
        eos = sorted(tok.eog_ids) or [tok.eos_id if tok.eos_id is not None else 0]
        if tok.add_space_prefix:  # encode would prefix a space: a continuation must not get one
            greedy = ll_tokenizer(pieces, special, eos, lambda t: [])
            cached = ll_tokenizer(pieces, special, eos, greedy.greedy_tokenize)
        else:
            cached = ll_tokenizer(pieces, special, eos, lambda t: tok.encode(t, add_bos=False))
        tok._llguidance = cached  # type: ignore[attr-defined]
    return cached
