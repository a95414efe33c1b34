"""OpenAI's endpoints: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, field
for field (also answered without the ``/v1`` prefix, as llama-server does)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from powerpy.scheduler import Delta, Failed, Finished
from powerpy.serve.errors import APIError, bad_request, error_body
from powerpy.serve.schemas import ChatRequest, CompletionRequest, parse
from powerpy.serve.service import Generation, Service

router = APIRouter()
MAX_PROMPTS = 16  # prompts in one /v1/completions request


def service_of(request: HTTPRequest) -> Service:
    return request.app.state.service


def usage(finals: list[Finished | None]) -> dict[str, Any]:
    """OpenAI's ``usage`` summed over the choices."""
    done = [f for f in finals if f is not None]
    p = sum(f.prompt_tokens for f in done)
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


async def collect(
    gen: Generation, request: HTTPRequest
) -> tuple[list[str], list[Finished], list[list[int]]]:
    """The full text, the final record and the token ids of every prompt (not streamed).

    Raises:
        APIError: 500 when the generation failed inside the engine.
    """
    texts: list[list[str]] = [[] for _ in gen.requests]
    tokens: list[list[int]] = [[] for _ in gen.requests]
    finals: list[Finished | None] = [None] * len(gen.requests)
    watcher = asyncio.create_task(gen.watch_disconnect(request))
    try:
        async for i, ev in gen.events():
            if isinstance(ev, Delta):
                texts[i].append(ev.text)
                tokens[i].extend(ev.tokens)
            elif isinstance(ev, Finished):
                finals[i] = ev
            elif isinstance(ev, Failed):
                raise APIError(500, ev.message, code="generation_failed")
    finally:
        watcher.cancel()
        gen.close()
    if any(f is None for f in finals):  # the client went away
        raise APIError(499, "the client closed the request")
    return ["".join(t) for t in texts], finals, tokens  # type: ignore[return-value]


def _failed_chunk(ev: Failed) -> dict[str, Any]:
    return error_body(500, ev.message, code="generation_failed")


# ----------------------------------------------------------------------------------- completions
@router.post("/v1/completions")
@router.post("/completions")
async def completions(request: HTTPRequest):
    svc = service_of(request)
    body = parse(CompletionRequest, await request.body())
    svc.check_model(body.model)
    if body.best_of not in (None, 1):
        raise bad_request("only best_of = 1 is supported", param="best_of")
    if body.logprobs:
        raise bad_request("logprobs are not supported", param="logprobs")
    if body.suffix:
        raise bad_request("suffix (insertion) is not supported", param="suffix")
    sampling, stop = svc.sampling(body), body.stop_list()
    max_tokens = svc.budget(body.max_tokens, param="max_tokens")
    raw = body.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        prompts = [raw]
    else:
        prompts = list(raw)
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise bad_request(f"give 1 to {MAX_PROMPTS} prompts", param="prompt")
    ids = [await svc.encode(p) for p in prompts]
    echo = [
        (p if isinstance(p, str) else svc.scheduler.tokenizer.decode(p)) if body.echo else ""
        for p in prompts
    ]
    gen = svc.generation(ids, max_tokens, sampling, stop)
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

    def choice(i: int, text: str, reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": i, "logprobs": None, "finish_reason": reason}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks():
            finals: list[Finished | None] = [None] * len(prompts)
            for i, text in enumerate(echo):
                if text:
                    yield chunk([choice(i, text, None)])
            async for i, ev in gen.events():
                if isinstance(ev, Delta) and ev.text:
                    yield chunk([choice(i, ev.text, None)])
                elif isinstance(ev, Finished):
                    finals[i] = ev
                    yield chunk([choice(i, "", ev.reason)])
                elif isinstance(ev, Failed):
                    yield _failed_chunk(ev)
                    return
            if include_usage:
                yield {**chunk([]), "usage": usage(finals)}

        return sse(gen, chunks())
    texts, finals, _ = await collect(gen, request)
    out = chunk(
        [
            choice(i, echo[i] + t, f.reason)
            for i, (t, f) in enumerate(zip(texts, finals, strict=True))
        ]
    )
    return JSONResponse({**out, "usage": usage(finals)})


# ----------------------------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def chat_completions(request: HTTPRequest):
    svc = service_of(request)
    body = parse(ChatRequest, await request.body())
    svc.check_model(body.model)
    if body.logprobs:
        raise bad_request("logprobs are not supported", param="logprobs")
    if body.tools:
        raise bad_request("tools are not supported by this server", param="tools")
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request("only the 'text' response format is supported", param="response_format")
    sampling, stop = svc.sampling(body), body.stop_list()
    if body.max_completion_tokens is not None:
        max_tokens = svc.budget(body.max_completion_tokens, param="max_completion_tokens")
    else:
        max_tokens = svc.budget(body.max_tokens, param="max_tokens")
    ids = await svc.encode_chat(body.messages)
    gen = svc.generation([ids], max_tokens, sampling, stop, param="messages")
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

    def delta(d: dict[str, Any], reason: str | None = None) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}]

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks():
            yield chunk(delta({"role": "assistant", "content": ""}))
            async for _, ev in gen.events():
                if isinstance(ev, Delta) and ev.text:
                    yield chunk(delta({"content": ev.text}))
                elif isinstance(ev, Finished):
                    yield chunk(delta({}, ev.reason))
                    if include_usage:
                        yield {**chunk([]), "usage": usage([ev])}
                elif isinstance(ev, Failed):
                    yield _failed_chunk(ev)
                    return

        return sse(gen, chunks())
    texts, finals, _ = await collect(gen, request)
    message = {"role": "assistant", "content": texts[0]}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finals[0].reason}
    return JSONResponse({**chunk([choice], "chat.completion"), "usage": usage(finals)})


# ----------------------------------------------------------------------------------- models
def model_card(svc: Service) -> dict[str, Any]:
    c = svc.config
    return {"id": c.model_id, "object": "model", "created": c.created, "owned_by": "powerpy",
            "meta": c.info}  # fmt: skip


@router.get("/v1/models")
@router.get("/models")
async def models(request: HTTPRequest):
    return {"object": "list", "data": [model_card(service_of(request))]}


@router.get("/v1/models/{name:path}")
async def model(name: str, request: HTTPRequest):
    svc = service_of(request)
    svc.check_model(name)
    return model_card(svc)
