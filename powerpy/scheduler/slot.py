"""A scheduler slot: one session's KV cache, the tokens in it, and the request it runs."""

from __future__ import annotations

import time
from collections.abc import Sequence

from powerpy.scheduler.logprobs import TokenLogprob
from powerpy.scheduler.request import Request, StopMatcher, build_sampler
from powerpy.tokenizer import Tokenizer


class Slot:
    """One session: a KV cache, the tokens in it, and the request it runs (if any)."""

    def __init__(self, index: int, cache) -> None:
        self.index = index
        self.cache = cache
        self.cached: list[int] = []  # tokens at cache positions 0..pos-1
        self.req: Request | None = None
        self.last_used = 0.0
        self.pending: list[int] = []  # prompt tokens still to run
        self.next_token: int | None = None  # sampled, to be fed at the next decode step
        self.keep = 0  # prompt tokens of the current request reused from the cache

    def start(self, req: Request, tokenizer: Tokenizer) -> None:
        """Take ``req``: keep the longest cached prefix of its prompt (at least one token runs,
        for the logits; all of them when the prompt is scored) and set up its sampler, decoder
        and stop strings."""
        keep = 0 if req.prompt_logprobs else common_prefix(self.cached, req.prompt[:-1])
        self.cached = self.cached[:keep]
        self.cache.pos = keep
        self.req, self.keep = req, keep
        self.pending = req.prompt[keep:]
        self.next_token = None
        self.eog_ids = tuple(sorted(tokenizer.eog_ids))
        self.sampler = build_sampler(req.sampling, self.eog_ids)
        self.history = list(req.prompt)
        self.decoder = tokenizer.stream_decoder(strip_leading_space=False)
        self.stopper = StopMatcher(req.stop)
        room = self.cache.n_ctx - len(req.prompt)
        self.budget = room if req.max_tokens < 0 else min(req.max_tokens, room)
        self.n_gen = 0
        self.scored: list[TokenLogprob] = []  # the prompt's entries so far (prompt_logprobs)
        self.t0 = time.perf_counter()
        self.t_first: float | None = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
