"""Structured output over HTTP on the default model: OpenAI's ``response_format`` (JSON object,
JSON schema), llama.cpp's ``grammar`` (GBNF) and ``json_schema`` on ``/completion``; sampled
replies parse and validate; concurrent clients keep their own grammars (batched slots); what
does not compile is a 400 that names the problem, and the server goes on."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from serve_harness import ServerProcess, assert_error  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "geo": {
                    "type": "object",
                    "properties": {  # bounded integers: a sampled number cannot run on
                        "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                        "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                    },
                    "required": ["lat", "lon"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "geo"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}


def small_schema(i: int) -> dict:
    """Eight different schemas, one per concurrent client."""
    key = f"field_{i}"
    kinds = [
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"enum": [f"v{i}a", f"v{i}b"]},
        {"type": "boolean"},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    ]
    return {
        "type": "object",
        "properties": {key: kinds[i % 4], "id": {"const": i}},
        "required": [key, "id"],
        "additionalProperties": False,
    }


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = ServerProcess("-m", str(smollm2_path), "-t", "1", "-np", "4")
    yield s
    assert s.stop() == 0, s.log


def ask(client, schema: dict, seed: int, temperature: float = 0.8, **kw):
    return client.chat.completions.create(
        model="powerpy",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        temperature=temperature,
        seed=seed,
        max_tokens=300,
        **kw,
    )


@pytest.mark.slow  # about 80 s on two shared cores
def test_twenty_json_schema_replies_validate(server):
    client = server.client(timeout=300)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: ask(client, PERSON, seed=i), range(20)))
    for r in replies:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_eight_clients_keep_their_own_schema(server):
    client = server.client(timeout=300)

    def one(i: int):
        return i, ask(client, small_schema(i), seed=100 + i, temperature=1.0)

    with ThreadPoolExecutor(8) as pool:
        for i, r in pool.map(one, range(8)):
            doc = json.loads(r.choices[0].message.content)
            jsonschema.validate(doc, small_schema(i))
            assert doc["id"] == i


def test_json_object_streamed_and_llama_fields(server):
    client = server.client(timeout=300)
    chunks = list(
        client.chat.completions.create(
            model="powerpy",
            messages=[{"role": "user", "content": "Give me a JSON object."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": small_schema(2)},
            },
            temperature=0,
            max_tokens=100,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), small_schema(2))
    r = client.chat.completions.create(
        model="powerpy",
        messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"},
        temperature=0.8,
        seed=5,
        max_tokens=60,
    )
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":  # a free object may run past max_tokens
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")
    status, _, body = server.request(
        "POST",
        "/completion",
        {
            "prompt": "Is the sky blue? Answer:",
            "grammar": 'root ::= " " ("yes" | "no")',
            "n_predict": 10,
            "temperature": 0.8,
            "seed": 3,
        },
    )
    assert status == 200 and body["content"] in (" yes", " no") and body["stop_type"] == "eos"
    status, _, body = server.request(
        "POST",
        "/completion",
        {"prompt": "A person:", "json_schema": small_schema(3), "n_predict": 100, "seed": 1},
    )
    assert status == 200
    jsonschema.validate(json.loads(body["content"]), small_schema(3))
    r = client.completions.create(
        model="powerpy",
        prompt="JSON:",
        max_tokens=100,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": small_schema(1)},
            }
        },
    )
    jsonschema.validate(json.loads(r.choices[0].text), small_schema(1))


BAD = [
    (
        "/v1/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "s",
                    "schema": {"type": "object", "properties": {"a": {"type": "strng"}}},
                },
            }
        },
        "response_format",
        "strng",
    ),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
        "response_format",
        "schema",
    ),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ("/completion", {"grammar": 'root ::= ("yes" | '}, "grammar", "gbnf"),
    ("/completion", {"grammar": "root ::= undefined-rule"}, "grammar", "undefined"),
    (
        "/completion",
        {"json_schema": {"type": "object", "minProperties": "x"}},
        "json_schema",
        "json_schema",
    ),
]


@pytest.mark.parametrize("path,extra,param,word", BAD)
def test_bad_grammars_get_400_and_the_server_goes_on(server, path, extra, param, word):
    body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    status, _, err = server.request("POST", path, {**body, **extra})
    assert_error(status, err, 400, param)
    assert word.lower() in err["error"]["message"].lower(), err
    r = server.client().chat.completions.create(
        model="powerpy", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert r.choices[0].message.content is not None
