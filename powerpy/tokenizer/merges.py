"""Pair merging: byte-level BPE (by merge rank) and SentencePiece-style BPE (by token score).

Both merge adjacent symbols greedily, best pair first, with one routine (:func:`merge_pairs`);
they differ in the priority of a pair and in what a symbol without a token becomes: byte tokens
looked up by their GPT-2 character (BPE) or ``<0xXX>`` byte tokens (SPM, with ``<unk>`` last).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

from powerpy.tokenizer.unicode import byte_char, utf8, utf8_symbols

__all__ = ["SPM_SPACE", "bpe_merge", "byte_token", "merge_pairs", "spm_merge"]

SPM_SPACE = "\u2581"  # SentencePiece's escaped space


def merge_pairs(syms: list[str], priority: Callable[[str, str], float | None]) -> list[str]:
    """Merge adjacent symbols greedily, lowest ``priority`` first (ties: leftmost).

    This is what llama.cpp's BPE (merge rank) and SPM (negated token score) tokenizers do. A
    doubly linked list over ``syms`` plus a heap of candidate pairs; a popped pair is stale when
    either side was merged since it was pushed (symbols only grow, so the length tells).

    Args:
        syms: the symbols (modified in place).
        priority: a pair's priority, or None for "not mergeable".

    Returns:
        The merged symbols in order.
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


def bpe_merge(
    word: str,
    ranks: Mapping[tuple[str, str], int],
    token_to_id: Mapping[str, int],
    ignore_merges: bool,
) -> tuple[int, ...]:
    """Merge the (byte-encoded) characters of one word by merge rank.

    Args:
        word: one pre-tokenized word, written with the GPT-2 byte characters.
        ranks: merge rank per ``(left, right)`` pair.
        token_to_id: vocabulary.
        ignore_merges: a word that is a token as a whole gives that token.

    Returns:
        Token ids; a merged symbol missing from the vocabulary gives the ids of its bytes.
    """
    tti = token_to_id
    if ignore_merges and word in tti:
        return (tti[word],)
    syms = merge_pairs(list(word), lambda a, b: ranks.get((a, b)))
    out: list[int] = []
    for s in syms:
        tid = tti.get(s)
        if tid is not None:
            out.append(tid)
            continue
        # llama.cpp looks up each UTF-8 byte of the symbol as a one-byte token
        for b in s.encode("utf-8"):
            tid = tti.get(byte_char(b))
            if tid is not None:
                out.append(tid)
    return tuple(out)


def spm_merge(
    text: str, token_to_id: Mapping[str, int], scores: Sequence[float], unk_id: int | None
) -> list[int]:
    """SentencePiece-style merging of one escaped text fragment by token score.

    Args:
        text: the fragment, spaces already written as U+2581.
        token_to_id: vocabulary.
        scores: score per token id (higher merges first).
        unk_id: the unknown token, for bytes without a byte token.

    Returns:
        Token ids.

    Raises:
        ValueError: a byte has no byte token and there is no unknown token.
    """
    try:
        text.encode("utf-8")
        syms = list(text)
    except UnicodeEncodeError:
        syms = utf8_symbols(utf8(text))
    tti = token_to_id

    def priority(a: str, b: str) -> float | None:  # higher score first
        tid = tti.get(a + b)
        return None if tid is None else -scores[tid]

    out: list[int] = []
    for sym in merge_pairs(syms, priority):
        tid = tti.get(sym)
        if tid is not None:
            out.append(tid)
        else:
            out.extend(byte_token(b, tti, unk_id) for b in utf8(sym))
    return out


def byte_token(b: int, token_to_id: Mapping[str, int], unk_id: int | None) -> int:
    """The token of one byte: ``<0xXX>``, else the byte's own character, else ``unk_id``.

    Args:
        b: byte value.
        token_to_id: vocabulary.
        unk_id: the unknown token.

    Returns:
        The token id.

    Raises:
        ValueError: no byte token and no unknown token.
    """
    tid = token_to_id.get(f"<0x{b:02X}>")
    if tid is None:
        tid = token_to_id.get(byte_char(b))
    if tid is None:
        if unk_id is None:
            raise ValueError(f"no byte token for 0x{b:02X} and no unknown token")
        tid = unk_id
    return tid
