"""Tool calls over HTTP: a forced call on the default model (its template has no tool syntax:
the tools go into a system message, a grammar forces the call), an ``auto`` call on a tiny model
with a Qwen-style template (``<tool_call>`` as one token starts the call's grammar), both streamed
and not; ``auto`` on a model without tool support is a 400."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

import numpy as np  # noqa: E402
from serve_harness import ServerProcess, assert_error  # noqa: E402

from powerpy.formats.constants import GGUFValueType, Keys, TokenType  # noqa: E402
from powerpy.testing import BYTE_VOCAB, TinySpec, write_tiny_model  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 10}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
QWEN_TEMPLATE = (
    '{% if tools %}system: call a tool with <tool_call>{"name": ..., "arguments": ...}'
    "</tool_call>. Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call, tools=(WEATHER, TIME)):
    fn = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])


@pytest.fixture(scope="module")
def smol(smollm2_path):
    s = ServerProcess("-m", str(smollm2_path), "-t", "1", "-np", "2")
    yield s
    assert s.stop() == 0, s.log


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    """A tiny model whose token 0 is ``<tool_call>`` (a control token) and whose chat template
    writes Qwen-style tool calls."""
    path = tmp_path_factory.mktemp("tools") / "qwen-like.gguf"
    tokens = ["<tool_call>"] + BYTE_VOCAB[1:]
    types = [TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL]
    types += [TokenType.BYTE] * (len(tokens) - 3)
    write_tiny_model(
        path,
        TinySpec(n_ctx=1024),
        sparse=False,
        seed=5,
        extra_kv={
            Keys.TOKENS: (tokens, GGUFValueType.ARRAY),
            Keys.TOKEN_TYPE: (np.array(types, np.int32), GGUFValueType.ARRAY),
            Keys.CHAT_TEMPLATE: (QWEN_TEMPLATE, GGUFValueType.STRING),
        },
    )
    s = ServerProcess("-m", str(path), "-t", "1", "-np", "1")
    yield s
    assert s.stop() == 0, s.log


def test_forced_call_on_the_default_model(smol):
    client = smol.client(timeout=300)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(
            model="powerpy",
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            temperature=0.8,
            seed=1,
            max_tokens=100,
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        (call,) = c.message.tool_calls
        check_call(call)
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
    chunks = list(
        client.chat.completions.create(
            model="powerpy",
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice="required",
            temperature=0,
            max_tokens=100,
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0
    check_call(calls[0])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_without_tool_support_is_a_400(smol):
    body = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "auto"}
    status, _, err = smol.request("POST", "/v1/chat/completions", body)
    assert_error(status, err, 400, "tool_choice")
    assert "no tool support" in err["error"]["message"]
    for bad, param in [
        ({"tools": [{"type": "nope"}]}, "tools.0"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
    ]:
        status, _, err = smol.request("POST", "/v1/chat/completions", {"messages": MESSAGES, **bad})
        assert_error(status, err, 400, param)
    r = smol.client().chat.completions.create(model="powerpy", messages=MESSAGES, max_tokens=3)
    assert r.choices[0].message.content is not None  # the server goes on


def test_auto_call_on_a_qwen_style_template(qwen_like):
    client = qwen_like.client()
    # the random model would rarely open a call by itself: the bias makes it; the grammar that
    # <tool_call> starts makes the call well-formed
    kw = dict(
        model="powerpy",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="auto",
        max_tokens=200,
        temperature=0.8,
        seed=3,
        logit_bias={"0": 100},
    )
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    (call,) = c.message.tool_calls
    check_call(call)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(x.function.name, x.function.arguments) for x in calls] == [
        (call.function.name, call.function.arguments)
    ]
    plain = client.chat.completions.create(**{**kw, "logit_bias": None, "max_tokens": 8})
    assert plain.choices[0].finish_reason in ("length", "stop")  # free text stays text
