"""OpenAI's endpoints: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, field
for field (also answered without the ``/v1`` prefix, as llama-server does)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

import powerpy.serve.logprobs as lp
from powerpy.scheduler import (
    MAX_TOP_LOGPROBS,
    Delta,
    Failed,
    Finished,
    PromptLogprobs,
    TokenLogprob,
)
from powerpy.serve.errors import APIError, bad_request, error_body
from powerpy.serve.schemas import ChatRequest, CompletionRequest, ResponseFormat, parse
from powerpy.serve.service import Generation, Service
from powerpy.serve.tools import parse as parse_calls
from powerpy.serve.tools import plan as tool_plan

if TYPE_CHECKING:
    from powerpy.structured import Grammar

router = APIRouter()
MAX_PROMPTS = 16  # prompts in one /v1/completions request


def service_of(request: HTTPRequest) -> Service:
    return request.app.state.service


def usage(finals: list[Finished | None], n: int = 1) -> dict[str, Any]:
    """OpenAI's ``usage`` summed over the choices (each prompt counted once: ``n`` choices
    per prompt)."""
    done = [f for f in finals if f is not None]
    p = sum(f.prompt_tokens for f in finals[::n] if f is not None)
    c = sum(f.completion_tokens for f in done)
    cached = sum(f.cached_tokens for f in done)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sse(gen: Generation, chunks: AsyncIterator[dict[str, Any]], *, done: bool = True):
    """A server-sent-event response of JSON ``chunks`` (then ``data: [DONE]``); a failed
    generation sends an ``error`` object instead. The client going away cancels it."""

    async def events():
        try:
            async for chunk in chunks:
                yield {"data": json.dumps(chunk, ensure_ascii=False)}
                if "error" in chunk:
                    return
            if done:
                yield {"data": "[DONE]"}
        finally:
            gen.close()

    # the background task closes it too when the stream never started (an early disconnect)
    return EventSourceResponse(events(), sep="\n", ping=15, background=BackgroundTask(gen.aclose))


@dataclass
class Choice:
    """What one choice produced (a response that is not streamed)."""

    parts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the sampled tokens
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    final: Finished | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def collect(gen: Generation, request: HTTPRequest) -> list[Choice]:
    """Every choice's text, tokens, log-probabilities and final record (not streamed).

    Raises:
        APIError: 500 when the generation failed inside the engine.
    """
    choices = [Choice() for _ in gen.requests]
    watcher = asyncio.create_task(gen.watch_disconnect(request))
    try:
        async for i, ev in gen.events():
            c = choices[i]
            if isinstance(ev, Delta):
                c.parts.append(ev.text)
                c.tokens.extend(ev.tokens)
                c.logprobs.extend(ev.logprobs)
            elif isinstance(ev, PromptLogprobs):
                c.prompt_logprobs = list(ev.entries)
            elif isinstance(ev, Finished):
                c.final = ev
            elif isinstance(ev, Failed):
                raise APIError(ev.status, ev.message, code=ev.code)
    finally:
        watcher.cancel()
        gen.close()
    if any(c.final is None for c in choices):  # the client went away
        raise APIError(499, "the client closed the request")
    return choices


async def response_grammar(svc: Service, rf: ResponseFormat | None) -> Grammar | None:
    """The grammar of OpenAI's ``response_format`` (None for text).

    Raises:
        APIError: 400 for an unknown type, a ``json_schema`` without its schema, or a schema
            the grammar engine cannot compile.
    """
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return await svc.grammar("json_schema", {"type": "object"}, param="response_format")
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request(
                "response_format.json_schema.schema is required", param="response_format"
            )
        return await svc.grammar("json_schema", rf.json_schema.schema_, param="response_format")
    raise bad_request(
        f"unknown response_format type {rf.type!r}: 'text', 'json_object' or 'json_schema'",
        param="response_format",
    )


def check_top(k: int | None, param: str) -> int | None:
    """A requested count of alternatives, within ``0..MAX_TOP_LOGPROBS``.

    Raises:
        APIError: 400 outside that range.
    """
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad_request(
            f"{param} must be 0..{MAX_TOP_LOGPROBS}, got {k}", param=param, code="invalid_value"
        )
    return k


def _failed_chunk(ev: Failed) -> dict[str, Any]:
    return error_body(ev.status, ev.message, code=ev.code)


# ----------------------------------------------------------------------------------- completions
@router.post("/v1/completions")
@router.post("/completions")
async def completions(request: HTTPRequest):
    """OpenAI's legacy completions; ``logprobs: K`` and ``echo`` as evaluation harnesses use
    them (``echo`` with ``max_tokens: 0`` scores the prompt alone), ``n`` choices per prompt."""
    svc = service_of(request)
    body = parse(CompletionRequest, await request.body())
    svc.check_model(body.model)
    if body.best_of not in (None, 1, body.n):
        raise bad_request("best_of must equal n (no server-side ranking)", param="best_of")
    if body.suffix:
        raise bad_request("suffix (insertion) is not supported", param="suffix")
    k = check_top(body.logprobs, "logprobs")
    sampling, stop = svc.sampling(body), body.stop_list()
    max_tokens = svc.budget(body.max_tokens, param="max_tokens", allow_zero=body.echo)
    raw = body.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        prompts = [raw]
    else:
        prompts = list(raw)
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise bad_request(f"give 1 to {MAX_PROMPTS} prompts", param="prompt")
    n = body.n or 1
    ids = [await svc.encode(p) for p in prompts]
    tok = svc.scheduler.tokenizer
    echo = [
        (p if isinstance(p, str) else tok.decode(p)) if body.echo else ""
        for p in prompts
        for _ in range(n)
    ]
    scored = body.echo and k is not None  # the prompt's own logprobs
    grammar = await response_grammar(svc, body.response_format)
    gen = svc.generation(
        ids, max_tokens, sampling, stop, n=n, logprobs=k, prompt_logprobs=scored, grammar=grammar
    )
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), svc.config.model_id

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def choice(i: int, text: str, reason: str | None, logprobs=None) -> dict[str, Any]:
        return {"text": text, "index": i, "logprobs": logprobs, "finish_reason": reason}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks():
            finals: list[Finished | None] = [None] * len(echo)
            offsets = [0] * len(echo)  # text sent so far, per choice (text_offset)
            decoders = [lp.offsets(tok, prompt=False) for _ in echo]
            if not scored:
                for i, text in enumerate(echo):
                    offsets[i] = len(text)
                    if text:
                        yield chunk([choice(i, text, None, lp.legacy(tok, []) if k else None)])
            async for i, ev in gen.events():
                if isinstance(ev, PromptLogprobs):
                    logprobs = lp.legacy(tok, ev.entries, lp.offsets(tok, prompt=True))
                    offsets[i] = len(echo[i])
                    yield chunk([choice(i, echo[i], None, logprobs)])
                elif isinstance(ev, Delta) and (ev.text or ev.logprobs):
                    logprobs = None
                    if k is not None:
                        logprobs = lp.legacy(tok, ev.logprobs, decoders[i], offsets[i])
                    offsets[i] += len(ev.text)
                    yield chunk([choice(i, ev.text, None, logprobs)])
                elif isinstance(ev, Finished):
                    finals[i] = ev
                    yield chunk([choice(i, "", ev.reason)])
                elif isinstance(ev, Failed):
                    yield _failed_chunk(ev)
                    return
            if include_usage:
                yield {**chunk([]), "usage": usage(finals, n)}

        return sse(gen, chunks())
    results = await collect(gen, request)
    out = []
    for i, c in enumerate(results):
        logprobs = None
        if k is not None:
            parts = (
                [lp.legacy(tok, c.prompt_logprobs, lp.offsets(tok, prompt=True))] if scored else []
            )
            parts.append(lp.legacy(tok, c.logprobs, offset=len(echo[i])))
            logprobs = lp.merge_legacy(parts)
        assert c.final is not None
        out.append(choice(i, echo[i] + c.text, c.final.reason, logprobs))
    return JSONResponse({**chunk(out), "usage": usage([c.final for c in results], n)})


# ----------------------------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(request: HTTPRequest):
    """OpenAI's chat completions: ``n`` choices, ``logprobs`` with ``top_logprobs``,
    ``response_format``, ``tools`` (:mod:`powerpy.serve.tools`; a tool request's reply is
    parsed when it ends, so its stream sends the content and calls then)."""
    svc = service_of(request)
    body = parse(ChatRequest, await request.body())
    svc.check_model(body.model)
    top = check_top(body.top_logprobs, "top_logprobs")
    if top is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    k = (top or 0) if body.logprobs else None
    tok = svc.scheduler.tokenizer
    plan = tool_plan(body.tools, body.tool_choice, tok.chat_template)
    grammar = await response_grammar(svc, body.response_format)
    if plan is not None:
        if grammar is not None and plan.forced:
            raise bad_request(
                "a forced tool call and a response_format exclude each other", param="tool_choice"
            )
        forced, lazy = plan.grammar(tok), plan.lazy(tok)
        if forced is not None:
            grammar = await svc.grammar(*forced, param="tools")
        elif lazy is not None and grammar is None:
            from powerpy.structured import LazyGrammar

            grammar = LazyGrammar(lazy[0], await svc.grammar("lark", lazy[1], param="tools"))
    sampling, stop = svc.sampling(body), body.stop_list()
    if body.max_completion_tokens is not None:
        max_tokens = svc.budget(body.max_completion_tokens, param="max_completion_tokens")
    else:
        max_tokens = svc.budget(body.max_tokens, param="max_tokens")
    ids = await svc.encode_chat(
        body.messages,
        tools=plan.template_tools if plan else None,
        system=plan.system if plan else None,
    )
    n = body.n or 1
    gen = svc.generation(
        [ids], max_tokens, sampling, stop, param="messages", n=n, logprobs=k, grammar=grammar
    )
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), svc.config.model_id

    def chunk(choices: list[dict[str, Any]], obj: str = "chat.completion.chunk") -> dict:
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def logprobs_of(entries) -> dict[str, Any] | None:
        return None if k is None else {"content": lp.chat(tok, entries, k), "refusal": None}

    def delta(i: int, d: dict[str, Any], reason: str | None = None, entries=()) -> list[dict]:
        logprobs = logprobs_of(entries) if entries else None
        return [{"index": i, "delta": d, "logprobs": logprobs, "finish_reason": reason}]

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks():
            finals: list[Finished | None] = [None] * n
            held: list[list[str]] = [[] for _ in range(n)]  # a tool request's text, parsed at end
            for i in range(n):
                yield chunk(delta(i, {"role": "assistant", "content": ""}))
            async for i, ev in gen.events():
                if isinstance(ev, Delta) and plan is not None:
                    held[i].append(ev.text)
                elif isinstance(ev, Delta) and (ev.text or (k is not None and ev.logprobs)):
                    yield chunk(delta(i, {"content": ev.text}, entries=ev.logprobs))
                elif isinstance(ev, Finished):
                    finals[i] = ev
                    reason = ev.reason
                    if plan is not None:
                        content, calls = parse_calls("".join(held[i]), plan.style)
                        if content:
                            yield chunk(delta(i, {"content": content}))
                        if calls:
                            reason = "tool_calls"
                            indexed = [{"index": j, **c} for j, c in enumerate(calls)]
                            yield chunk(delta(i, {"tool_calls": indexed}))
                    yield chunk(delta(i, {}, reason))
                elif isinstance(ev, Failed):
                    yield _failed_chunk(ev)
                    return
            if include_usage:
                yield {**chunk([]), "usage": usage(finals, n)}

        return sse(gen, chunks())
    results = await collect(gen, request)
    choices = []
    for i, c in enumerate(results):
        assert c.final is not None
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        reason = c.final.reason
        if plan is not None:
            content, calls = parse_calls(c.text, plan.style)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                reason = "tool_calls"
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": logprobs_of(c.logprobs),
                "finish_reason": reason,
            }
        )
    return JSONResponse(
        {**chunk(choices, "chat.completion"), "usage": usage([c.final for c in results], n)}
    )


# ----------------------------------------------------------------------------------- models
def model_card(svc: Service) -> dict[str, Any]:
    c = svc.config
    return {
        "id": c.model_id,
        "object": "model",
        "created": c.created,
        "owned_by": "powerpy",
        "meta": c.info,
    }


@router.get("/v1/models")
@router.get("/models")
async def models(request: HTTPRequest):
    return {"object": "list", "data": [model_card(service_of(request))]}


@router.get("/v1/models/{name:path}")
async def model(name: str, request: HTTPRequest):
    svc = service_of(request)
    svc.check_model(name)
    return model_card(svc)
