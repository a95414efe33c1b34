"""The glue between the HTTP routes and the scheduler: settings, checks, and :class:`Generation`,
which submits scheduler requests and hands their events to asyncio.

The scheduler's worker thread posts events with ``loop.call_soon_threadsafe``; nothing here runs
the model. Tokenizing and chat templates run in a thread pool, off the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest

from powerpy.sampling import SamplingParams
from powerpy.scheduler import (
    EngineUnavailable,
    Event,
    Failed,
    Finished,
    PromptTooLong,
    QueueFull,
    Request,
    Sampling,
    Scheduler,
    ShuttingDown,
)
from powerpy.serve.errors import APIError, bad_request
from powerpy.serve.schemas import ChatMessage, SamplingFields
from powerpy.serve.tools import for_template

if TYPE_CHECKING:
    from powerpy.structured import Grammar

CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role
MAX_N = 16  # choices per prompt (n)
MAX_CHOICES = 64  # choices per request, all prompts together
SEED_MOD = 2**64


@dataclass
class ServeConfig:
    """Server settings.

    Attributes:
        model_id: the name ``/v1/models`` lists and responses carry.
        aliases: further model names requests may use (the file's name and stem).
        api_key: the Bearer key every endpoint but ``/health`` requires (None: open).
        max_body_bytes: largest request body.
        n_predict: token budget of a request that names none (-1: until the context is full).
        max_tokens: the largest budget a request may ask for (default: a session's context).
        retry_after: seconds a 503 tells the client to wait.
        info: model facts for ``/v1/models`` and ``/health``.
    """

    model_id: str = "powerpy"
    aliases: frozenset[str] = frozenset()
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    n_predict: int = -1
    max_tokens: int | None = None
    retry_after: int = 1
    info: dict[str, Any] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))


class Service:
    """What the routes share: the scheduler, the settings and the count of open generations."""

    def __init__(self, scheduler: Scheduler, config: ServeConfig) -> None:
        self.scheduler = scheduler
        self.config = config
        self.open_generations = 0  # HTTP responses still streaming or collecting

    @property
    def max_tokens(self) -> int:
        return self.config.max_tokens or self.scheduler.n_ctx

    def check_model(self, name: str | None) -> None:
        """Raises APIError 404 for a model name this server does not serve."""
        if name is None or name == self.config.model_id or name in self.config.aliases:
            return
        raise APIError(
            404,
            f"The model `{name}` does not exist: this server serves `{self.config.model_id}`",
            param="model",
            code="model_not_found",
        )

    def budget(
        self,
        value: int | None,
        *,
        param: str,
        allow_unlimited: bool = False,
        allow_zero: bool = False,
    ) -> int:
        """The token budget of a request: ``value`` or the server default, within limits.

        Raises:
            APIError: 400 for a budget below 1 (below 0 with ``allow_zero``, a scored prompt;
                below -1 with ``allow_unlimited``, llama.cpp's ``n_predict``) or above
                ``max_tokens``.
        """
        if value is None:
            value = self.config.n_predict
            return value if value < 0 else min(value, self.max_tokens)
        low = -1 if allow_unlimited else 0 if allow_zero else 1
        if value < low:
            raise bad_request(f"{param} must be at least {low}, got {value}", param=param)
        if value > self.max_tokens:
            raise bad_request(
                f"{param} is {value}; this server allows at most {self.max_tokens} "
                "(a session's context)",
                param=param,
            )
        return value

    def sampling(self, body: SamplingFields) -> Sampling:
        """The sampler settings of a request (llama.cpp's defaults for what it leaves out).

        Raises:
            APIError: 400 for ``n`` outside 1..``MAX_N`` or a malformed ``logit_bias``.
        """
        if body.n is not None and not 1 <= body.n <= MAX_N:
            raise bad_request(f"n must be 1..{MAX_N}, got {body.n}", param="n")
        d = SamplingParams()

        def pick(value, default):
            return default if value is None else value

        params = SamplingParams(
            temperature=pick(body.temperature, d.temperature),
            top_k=pick(body.top_k, d.top_k),
            top_p=pick(body.top_p, d.top_p),
            min_p=pick(body.min_p, d.min_p),
            repeat_penalty=pick(body.repeat_penalty, d.repeat_penalty),
            repeat_last_n=pick(body.repeat_last_n, d.repeat_last_n),
            seed=None if body.seed is None or body.seed < 0 else body.seed,
        )
        n_vocab = self.scheduler.args.n_vocab
        bias: dict[int, float] = {}
        for key, value in (body.logit_bias or {}).items():
            try:
                tok = int(key)
            except ValueError:
                msg = f"logit_bias key {key!r} is not a token id"
                raise bad_request(msg, param="logit_bias") from None
            if not 0 <= tok < n_vocab or not -100 <= value <= 100:
                raise bad_request(
                    f"logit_bias {key}: {value}: ids are 0..{n_vocab - 1}, values -100..100",
                    param="logit_bias",
                )
            bias[tok] = float(value)
        return Sampling(
            params,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=bias,
            ignore_eos=body.ignore_eos,
        )

    async def encode(self, prompt: str | Sequence[int], *, param: str = "prompt") -> list[int]:
        """Prompt ids of a text or of token ids (in a worker thread).

        Raises:
            APIError: 400 for an empty prompt or an id outside the vocabulary.
        """
        try:
            ids = await run_in_threadpool(self.scheduler.encode, prompt)
        except ValueError as e:
            raise bad_request(str(e), param=param) from None
        if not ids:
            raise bad_request("the prompt is empty", param=param)
        return ids

    async def encode_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: list[Any] | None = None,
        system: str | None = None,
    ) -> list[int]:
        """Prompt ids of a conversation through the model's chat template (in a worker thread),
        with the template's ``tools`` or a ``system`` message put first. Earlier tool calls and
        tool results (``tool_calls``, ``tool_call_id``, ``name``) reach the template.

        Raises:
            APIError: 400 for non-text content or a conversation the template rejects.
        """
        plain = []
        for i, m in enumerate(messages):
            if isinstance(m.content, list):
                parts = []
                for p in m.content:
                    if p.type != "text" or p.text is None:
                        raise bad_request(
                            f"message {i}: only text content is supported, not {p.type!r}",
                            param=f"messages.{i}.content",
                        )
                    parts.append(p.text)
                content = "".join(parts)
            elif m.content is None and m.role != "assistant":
                raise bad_request(f"message {i} has no content", param=f"messages.{i}.content")
            else:
                content = m.content or ""
            msg = {"role": CHAT_ROLES.get(m.role, m.role), "content": content}
            for key in ("tool_calls", "tool_call_id", "name"):
                value = getattr(m, key, None) or (m.model_extra or {}).get(key)
                if value is not None:
                    msg[key] = value
            plain.append(msg)
        if system:
            plain.insert(0, {"role": "system", "content": system})
        plain = for_template(plain)
        try:
            ids = await run_in_threadpool(self.scheduler.encode_chat, plain, tools)
        except ValueError as e:
            raise bad_request(str(e), param="messages") from None
        if not ids:
            raise bad_request("the conversation renders to an empty prompt", param="messages")
        return ids

    async def grammar(self, kind: str, spec: Any, *, param: str) -> Grammar:
        """A compiled grammar (``powerpy.structured``; compiled in a worker thread).

        Raises:
            APIError: 400 naming the problem when the grammar or schema does not compile (or
                the ``structured`` extra is not installed).
        """
        from powerpy.structured import GrammarError, compile_grammar

        n_vocab = self.scheduler.args.n_vocab
        try:
            return await run_in_threadpool(
                compile_grammar, self.scheduler.tokenizer, kind, spec, n_vocab
            )
        except GrammarError as e:
            raise bad_request(str(e), param=param, code="invalid_grammar") from None

    def generation(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        sampling: Sampling,
        stop: Sequence[str],
        *,
        param: str = "prompt",
        n: int = 1,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        grammar: Grammar | None = None,
    ) -> Generation:
        """Submit ``n`` requests per prompt (the choices, prompt by prompt); their events come
        from ``Generation.events``. Choice ``i`` samples with ``seed + i`` when the request
        gave a seed, so every choice is its own stream and a seeded request repeats.
        ``logprobs`` and ``prompt_logprobs``: as :class:`powerpy.scheduler.Request`'s;
        ``grammar``: every choice follows it with its own state.

        Raises:
            APIError: 400 for a prompt longer than the context or more than ``MAX_CHOICES``
                choices, 503 (with ``Retry-After``) when the queue is full or the server is
                shutting down, 503 when the engine cannot run (a dead pipeline stage).
        """
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(
                f"{len(prompts)} prompts x n = {n} make more than {MAX_CHOICES} choices", param="n"
            )
        choices = [ids for ids in prompts for _ in range(n)]
        samplings = [choice_sampling(sampling, i) for i in range(len(choices))]
        gen = Generation(
            self,
            choices,
            max_tokens,
            samplings,
            stop,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
        )
        try:
            for r in gen.requests:
                self.scheduler.submit(r)
        except PromptTooLong as e:
            gen.cancel()
            raise bad_request(str(e), param=param, code="context_length_exceeded") from None
        except (QueueFull, ShuttingDown) as e:
            gen.cancel()
            raise APIError(
                503,
                str(e),
                code="server_busy" if isinstance(e, QueueFull) else "shutting_down",
                headers={"Retry-After": str(self.config.retry_after)},
            ) from None
        except EngineUnavailable as e:
            gen.cancel()
            msg = f"the engine is unavailable: {e}"
            raise APIError(503, msg, code="engine_unavailable") from None
        self.open_generations += 1
        return gen


def choice_sampling(sampling: Sampling, index: int) -> Sampling:
    """The settings of choice ``index``: its own seed, ``seed + index``, when one was given."""
    seed = sampling.params.seed
    if seed is None or index == 0:
        return sampling
    params = dataclasses.replace(sampling.params, seed=(seed + index) % SEED_MOD)
    return dataclasses.replace(sampling, params=params)


class Generation:
    """Scheduler requests (one per choice) whose events arrive on one asyncio queue."""

    def __init__(
        self,
        service: Service,
        prompts: list[list[int]],
        max_tokens: int,
        samplings: Sequence[Sampling],
        stop: Sequence[str],
        *,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        grammar: Grammar | None = None,
    ) -> None:
        self.service = service
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()
        self.requests = [
            Request(
                ids,
                max_tokens,
                sampling,
                stop,
                on_event=self._poster(i),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                constraint=None if grammar is None else grammar.constraint(),
            )
            for i, (ids, sampling) in enumerate(zip(prompts, samplings, strict=True))
        ]
        self.prompts = prompts
        self._open = len(self.requests)
        self._closed = False

    def _poster(self, index: int):
        def post(event: Event) -> None:  # runs on the scheduler's thread
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

        return post

    def cancel(self) -> None:
        """Cancel every request (their slots free at the next token) and end ``events``."""
        for r in self.requests:
            r.cancel()
        self.queue.put_nowait((-1, None))

    def close(self) -> None:
        """Cancel what still runs and stop counting this generation as open (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._open:
            self.cancel()
        self.service.open_generations -= 1

    async def aclose(self) -> None:
        """``close`` on the event loop (a response's background task)."""
        self.close()

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """``(choice index, event)`` until every request has finished or failed."""
        while self._open:
            index, event = await self.queue.get()
            if event is None:
                return
            if isinstance(event, (Finished, Failed)):
                self._open -= 1
            yield index, event

    async def watch_disconnect(self, request: HTTPRequest) -> None:
        """Cancel when the client goes away (for responses that are not streamed)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.cancel()
                return
