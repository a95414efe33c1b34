"""Request bodies of the OpenAI and llama.cpp endpoints, checked strictly (types are not coerced:
``"max_tokens": "5"`` is a 400). Unknown fields are ignored, as OpenAI-compatible servers do."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from powerpy.serve.errors import APIError, bad_request

MAX_STOP = 16  # stop strings per request
MAX_SEED = 2**64 - 1

M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """What every generating endpoint takes (OpenAI names plus llama.cpp's extras)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, ge=0)
    repeat_last_n: int | None = Field(None, ge=0, le=1 << 20)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), le=MAX_SEED)  # negative: random
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    n: int | None = None
    user: str | None = None

    def stop_list(self) -> list[str]:
        """The stop strings as a list (at most ``MAX_STOP``)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise bad_request(f"at most {MAX_STOP} stop strings are allowed", param="stop")
        return stops


class JSONSchemaFormat(_Body):
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    type: str
    json_schema: JSONSchemaFormat | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for this endpoint
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None
    response_format: ResponseFormat | None = None


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


class LlamaCompletionRequest(SamplingFields):
    """llama.cpp's ``POST /completion``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    n_predict: int | None = Field(None, ge=-1)
    n_probs: int | None = None
    grammar: str | None = None  # GBNF
    json_schema: dict[str, Any] | bool | None = None
    return_tokens: bool = False
    cache_prompt: bool = True


class TokenizeRequest(_Body):
    """llama.cpp's ``content``/``add_special``, or vLLM's ``prompt``/``add_special_tokens``."""

    content: str | None = None
    add_special: bool = False
    with_pieces: bool = False
    prompt: str | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    tokens: list[int]


def parse(model: type[M], raw: bytes) -> M:
    """Parse and check a JSON body.

    Raises:
        APIError: 400 for malformed JSON, a body that is not an object, or a field of the wrong
            type or range (``param`` names the field).
    """
    try:
        obj = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in err["loc"] if not _is_type_tag(p))
        kind = err["type"]
        if kind == "missing":
            message = f"missing required parameter {loc!r}"
        else:
            message = f"invalid value for {loc!r}: {err['msg']}"
        raise APIError(400, message, param=loc or None, code="invalid_value") from None


def _is_type_tag(part: Any) -> bool:
    # pydantic names union members in locations ("str", "list[int]", ...): not fields
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "dict") or "[" in part or "function" in part
    )
