"""Generation in three layers: ``generate_step`` yields token ids, ``stream_generate`` yields
``Response`` records with text and speeds, ``generate`` returns the text."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from powerpy.errors import TokenizerError
from powerpy.model.cache import KVCache
from powerpy.model.options import SPARSE, RunOptions
from powerpy.model.transformer import Model
from powerpy.sampling import Sampler, SamplingParams, make_sampler
from powerpy.tokenizer import Tokenizer


def generate_step(
    model: Model,
    prompt: Sequence[int],
    sampler: Sampler,
    cache: KVCache,
    opts: RunOptions = SPARSE,
    *,
    prefill_chunk: int = 512,
) -> Iterator[int]:
    """Prefill ``prompt`` into ``cache`` and yield sampled token ids forever.

    The caller decides when to stop (EOS, token budget). Each yielded token is fed back on the
    next iteration. Everything that changes lives in ``cache``, ``sampler`` and ``opts``, so
    generators over one model, each with its own cache, can be interleaved freely.
    """
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    history = list(prompt)
    logits = None
    for s in range(0, len(prompt), prefill_chunk):
        chunk = torch.tensor(prompt[s : s + prefill_chunk], dtype=torch.long)
        logits = model.forward(chunk, cache, opts)
    while True:
        tok = sampler(logits[-1], history)
        history.append(tok)
        yield tok
        logits = model.forward(torch.tensor([tok], dtype=torch.long), cache, opts)


@dataclass
class Response:
    """One streamed piece of generated text."""

    text: str  # new text since the previous response (may be empty mid-character)
    token: int
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float  # prompt tokens per second
    generation_tps: float  # generated tokens per second, after the first token
    finish_reason: str | None = None  # "stop" (end of generation) or "length"


def stream_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    max_tokens: int = 128,
    params: SamplingParams | None = None,
    *,
    n_ctx: int | None = None,
    cache: KVCache | None = None,
    opts: RunOptions = SPARSE,
) -> Iterator[Response]:
    """Stream the continuation of ``prompt`` as ``Response`` records.

    Args:
        model: the model.
        tokenizer: its tokenizer.
        prompt: text (tokenized with the model's tokenizer) or token ids.
        max_tokens: most tokens to generate; < 0 means until the context is full.
        params: sampling options (default: llama.cpp's defaults).
        n_ctx: KV cache size (default: prompt + max_tokens, at most the training context).
        cache: continue this cache instead (``prompt`` follows its ``pos`` tokens; the caller
            keeps track of them, as ``powerpy.chat.ChatSession`` does).
        opts: run options (sparse or dense, threshold, statistics).
    """
    params = params or SamplingParams()
    tok = tokenizer
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if isinstance(prompt, str) and prompt and not ids:
        raise TokenizerError(
            f"the prompt {prompt[:40]!r} has no token in this vocabulary (no piece and no byte "
            "fallback matches it): the file's tokenizer is incomplete; re-convert the model"
        )
    if cache is None:
        if max_tokens < 0:
            max_tokens = model.args.n_ctx_train - len(ids)
        cache = model.new_cache(n_ctx or len(ids) + max(max_tokens, 1))
    elif max_tokens < 0:
        max_tokens = cache.n_ctx - cache.pos - len(ids)
    decoder = tok.stream_decoder(strip_leading_space=False)
    t0 = time.perf_counter()
    t_first = t0
    n = 0
    steps = generate_step(model, ids, make_sampler(params), cache, opts)
    for n, token in enumerate(steps, start=1):
        now = time.perf_counter()
        if n == 1:
            t_first = now
        prompt_tps = len(ids) / max(t_first - t0, 1e-9)
        gen_tps = (n - 1) / (now - t_first) if n > 1 else 0.0
        if tok.is_eog(token):
            yield Response(decoder.flush(), token, len(ids), n, prompt_tps, gen_tps, "stop")
            return
        text = decoder.push(token)
        if n >= max_tokens or cache.pos >= cache.n_ctx:
            yield Response(
                text + decoder.flush(), token, len(ids), n, prompt_tps, gen_tps, "length"
            )
            return
        yield Response(text, token, len(ids), n, prompt_tps, gen_tps)


def generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    max_tokens: int = 128,
    params: SamplingParams | None = None,
    *,
    opts: RunOptions = SPARSE,
) -> str:
    """Return the generated continuation of ``prompt`` as text."""
    steps = stream_generate(model, tokenizer, prompt, max_tokens, params, opts=opts)
    return "".join(r.text for r in steps)
