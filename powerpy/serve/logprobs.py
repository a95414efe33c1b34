"""Log-probabilities in the three wire formats: OpenAI's legacy completions (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``), OpenAI's chat (``content`` entries with
``bytes``) and llama-server's ``completion_probabilities``.

The values come from the scheduler (:mod:`powerpy.scheduler.logprobs`): the log-softmax of the
model's logits under the server's run options, before any sampling setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from powerpy.scheduler import TokenLogprob
from powerpy.tokenizer import StreamDecoder, Tokenizer


def token_bytes(tok: Tokenizer, token: int) -> bytes:
    return tok.token_to_piece(token, special=True)


def token_text(tok: Tokenizer, token: int) -> str:
    """A token's text; a piece that is not whole UTF-8 is written ``bytes:\\xNN...`` as OpenAI
    does."""
    raw = token_bytes(tok, token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def with_sampled(entry: TokenLogprob) -> list[tuple[int, float]]:
    """The alternatives of ``entry`` plus the chosen token when it is not among them (OpenAI
    always lists the sampled token)."""
    top = list(entry.top)
    if entry.logprob is not None and top and all(t != entry.token for t, _ in top):
        top.append((entry.token, entry.logprob))
    return top


def offsets(tok: Tokenizer, *, prompt: bool) -> StreamDecoder:
    """The decoder that places tokens in the text for ``text_offset``: a prompt's as its text
    is decoded (special tokens hidden), a completion's as it is streamed."""
    return tok.stream_decoder(skip_special=True, strip_leading_space=None if prompt else False)


def legacy(
    tok: Tokenizer,
    entries: Sequence[TokenLogprob],
    decoder: StreamDecoder | None = None,
    offset: int = 0,
) -> dict[str, list[Any]]:
    """``/v1/completions``' ``logprobs`` object. ``text_offset``: where each token starts in the
    text, counted from ``offset`` (the length of the text before these tokens) by ``decoder``
    (which keeps its state across the calls of one stream; a token that ends inside a character
    starts where that character does)."""
    decoder = decoder or offsets(tok, prompt=False)
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for e in entries:
        text = token_text(tok, e.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        top = None
        if e.logprob is not None:
            top = {}
            for t, lp in with_sampled(e):
                top.setdefault(token_text(tok, t), lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(decoder.push(e.token))
    return out


def merge_legacy(parts: Sequence[dict[str, list[Any]]]) -> dict[str, list[Any]] | None:
    """One legacy object from consecutive ones (None when there are none)."""
    if not parts:
        return None
    return {key: [v for p in parts for v in p[key]] for key in parts[0]}


def chat(tok: Tokenizer, entries: Sequence[TokenLogprob], top: int) -> list[dict[str, Any]]:
    """``/v1/chat/completions``' ``logprobs.content`` entries with ``top`` alternatives."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        return {
            "token": token_text(tok, token),
            "logprob": logprob,
            "bytes": list(token_bytes(tok, token)),
        }

    return [
        {**one(e.token, e.logprob or 0.0), "top_logprobs": [one(t, lp) for t, lp in e.top[:top]]}
        for e in entries
    ]


def llama(tok: Tokenizer, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities`` entries (``n_probs`` alternatives)."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        return {
            "id": token,
            "token": token_text(tok, token),
            "logprob": logprob,
            "bytes": list(token_bytes(tok, token)),
        }

    return [
        {**one(e.token, e.logprob or 0.0), "top_logprobs": [one(t, lp) for t, lp in e.top]}
        for e in entries
    ]
