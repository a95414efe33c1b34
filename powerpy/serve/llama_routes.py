"""llama.cpp's native endpoints, for PowerInfer's users: ``/completion``, ``/tokenize``,
``/detokenize`` (llama-server's field names). ``/tokenize`` also takes vLLM's fields and, with
``/tokenizer_info``, serves evaluation harnesses the model's own tokenizer (lm-eval's
``tokenizer_backend=remote``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

import powerpy.serve.logprobs as lp
from powerpy.scheduler import Delta, Failed, Finished, Sampling
from powerpy.serve.errors import bad_request
from powerpy.serve.openai_routes import check_top, collect, service_of, sse
from powerpy.serve.schemas import DetokenizeRequest, LlamaCompletionRequest, TokenizeRequest, parse

router = APIRouter()


def settings(s: Sampling, n_predict: int, stop: list[str]) -> dict[str, Any]:
    p = s.params
    return {
        "n_predict": n_predict,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_penalty": p.repeat_penalty,
        "repeat_last_n": p.repeat_last_n,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "seed": -1 if p.seed is None else p.seed,
        "ignore_eos": s.ignore_eos,
        "stop": stop,
    }


def timings(f: Finished) -> dict[str, float]:
    run = max(f.prompt_tokens - f.cached_tokens, 0)
    decoded = max(f.completion_tokens - 1, 0)  # tokens after the first
    return {
        "prompt_n": run,
        "prompt_ms": 1e3 * f.prompt_seconds,
        "prompt_per_token_ms": 1e3 * f.prompt_seconds / max(run, 1),
        "prompt_per_second": run / f.prompt_seconds if f.prompt_seconds > 0 else 0.0,
        "predicted_n": f.completion_tokens,
        "predicted_ms": 1e3 * f.decode_seconds,
        "predicted_per_token_ms": 1e3 * f.decode_seconds / max(decoded, 1),
        "predicted_per_second": decoded / f.decode_seconds if f.decode_seconds > 0 else 0.0,
    }


def final(f: Finished, content: str, tokens: list[int], extra: dict[str, Any]) -> dict[str, Any]:
    stop_type = "word" if f.stop_word else "eos" if f.eos else "limit"
    return {
        "content": content,
        "tokens": tokens,
        "id_slot": f.slot,
        "stop": True,
        "tokens_predicted": f.completion_tokens,
        "tokens_evaluated": f.prompt_tokens,
        "tokens_cached": f.cached_tokens,
        "truncated": False,
        "stop_type": stop_type,
        "stopped_eos": stop_type == "eos",
        "stopped_word": stop_type == "word",
        "stopped_limit": stop_type == "limit",
        "stopping_word": f.stop_word or "",
        "timings": timings(f),
        **extra,
    }


@router.post("/completion")
async def completion(request: HTTPRequest):
    svc = service_of(request)
    body = parse(LlamaCompletionRequest, await request.body())
    svc.check_model(body.model)
    n_probs = check_top(body.n_probs, "n_probs") or 0
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request("give one prompt", param="prompt")
        prompt = prompt[0]
    sampling, stop = svc.sampling(body), body.stop_list()
    n_predict = svc.budget(body.n_predict, param="n_predict", allow_unlimited=True)
    ids = await svc.encode(prompt)
    if body.grammar and body.json_schema is not None:
        raise bad_request("give either grammar or json_schema", param="grammar")
    grammar = None
    if body.json_schema is not None:
        grammar = await svc.grammar("json_schema", body.json_schema, param="json_schema")
    elif body.grammar:
        grammar = await svc.grammar("gbnf", body.grammar, param="grammar")
    gen = svc.generation(
        [ids], n_predict, sampling, stop, logprobs=n_probs or None, grammar=grammar
    )
    tok = svc.scheduler.tokenizer
    prompt_text = prompt if isinstance(prompt, str) else svc.scheduler.tokenizer.decode(prompt)
    extra = {
        "model": svc.config.model_id,
        "prompt": prompt_text,
        "generation_settings": {**settings(sampling, n_predict, stop), "n_probs": n_probs},
    }
    if body.stream:

        async def chunks():
            tokens: list[int] = []
            async for _, ev in gen.events():
                if isinstance(ev, Delta):
                    tokens.extend(ev.tokens)
                    if ev.text or n_probs:
                        out = {
                            "content": ev.text,
                            "tokens": list(ev.tokens),
                            "stop": False,
                            "id_slot": -1,
                            "index": 0,
                        }
                        if n_probs:
                            out["completion_probabilities"] = lp.llama(tok, ev.logprobs)
                        yield out
                elif isinstance(ev, Finished):
                    yield {**final(ev, "", tokens if body.return_tokens else [], extra), "index": 0}
                elif isinstance(ev, Failed):
                    yield {
                        "error": {"code": ev.status, "message": ev.message, "type": "server_error"}
                    }
                    return

        return sse(gen, chunks(), done=False)
    (c,) = await collect(gen, request)
    assert c.final is not None
    out = final(c.final, c.text, c.tokens if body.return_tokens else [], extra)
    if n_probs:
        out["completion_probabilities"] = lp.llama(tok, c.logprobs)
    return JSONResponse(out)


@router.post("/tokenize")
async def tokenize(request: HTTPRequest):
    svc = service_of(request)
    body = parse(TokenizeRequest, await request.body())
    tok = svc.scheduler.tokenizer
    if body.prompt is not None:  # vLLM's form
        ids = await run_in_threadpool(
            tok.encode, body.prompt, add_bos=body.add_special_tokens and tok.add_bos
        )
        return {"tokens": ids, "count": len(ids), "max_model_len": svc.scheduler.n_ctx}
    if body.content is None:
        raise bad_request("missing required parameter 'content'", param="content")
    ids = await run_in_threadpool(
        tok.encode, body.content, add_bos=body.add_special and tok.add_bos
    )
    if not body.with_pieces:
        return {"tokens": ids}
    pieces = []
    for i in ids:
        raw = tok.token_to_piece(i, special=True)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": i, "piece": piece})
    return {"tokens": pieces}


@router.get("/tokenizer_info")
async def tokenizer_info(request: HTTPRequest):
    """vLLM's tokenizer facts: the special tokens' texts and the chat template."""
    svc = service_of(request)
    tok = svc.scheduler.tokenizer

    def text(token_id: int | None) -> str | None:
        if token_id is None:
            return None
        return tok.token_to_piece(token_id, special=True).decode("utf-8", "replace")

    return {
        "tokenizer_class": "powerpy",
        "bos_token": text(tok.bos_id),
        "eos_token": text(tok.eos_id),
        "pad_token": text(tok.pad_id),
        "add_bos_token": tok.add_bos,
        "chat_template": tok.chat_template,
        "model_max_length": svc.scheduler.n_ctx,
        "vocab_size": tok.vocab_size,
    }


@router.post("/detokenize")
async def detokenize(request: HTTPRequest):
    svc = service_of(request)
    body = parse(DetokenizeRequest, await request.body())
    n_vocab = svc.scheduler.args.n_vocab
    bad = [t for t in body.tokens if not 0 <= t < n_vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary", param="tokens")
    return {"content": svc.scheduler.tokenizer.decode(body.tokens)}
