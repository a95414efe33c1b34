"""Log-probabilities and ``n`` choices over HTTP: OpenAI's legacy ``logprobs``/``echo`` (as
evaluation harnesses score prompts), chat ``top_logprobs``, llama.cpp's ``n_probs``, and seeded
choices. The values must be ``LLM.logits``' log-softmax, as the server runs the model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import torch  # noqa: E402
from serve_harness import ServerProcess, assert_error, next_data  # noqa: E402

from powerpy.api import load  # noqa: E402
from powerpy.serve.logprobs import token_text  # noqa: E402
from powerpy.testing import TinySpec, write_tiny_model  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("logprobs") / "tiny.powerinfer.gguf"
    write_tiny_model(path, TinySpec(n_ctx=1024), sparse=True, seed=11)
    return path


@pytest.fixture(scope="module")
def llm(tiny):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server (-t 1)
    yield load(tiny)
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def server(tiny):
    s = ServerProcess("-m", str(tiny), "-t", "1", "-np", "2", "-c", "2048")
    yield s
    assert s.stop() == 0, s.log


def reference(llm, ids: list[int], n_prompt: int | None = None) -> torch.Tensor:
    """Log-softmax of the logits over ``ids`` (row i predicts ids[i + 1]): ``LLM.logits`` of the
    prompt, then (for the tokens after ``n_prompt``) one forward per token as a decode step
    runs them (a step reads its own keys back from the f16 cache, a prompt pass does not)."""
    n_prompt = len(ids) if n_prompt is None else n_prompt
    rows = [llm.logits(ids[:n_prompt])]
    if n_prompt < len(ids):
        cache = llm.model.new_cache(len(ids))
        llm.model.forward(torch.tensor(ids[:n_prompt]), cache, llm.options)
        for t in ids[n_prompt:-1]:
            rows.append(llm.model.forward(torch.tensor([t]), cache, llm.options)[-1:])
    return torch.log_softmax(torch.cat(rows), dim=-1)


def ids_of(llm, tokens: list[str]) -> list[int]:
    """Token ids of legacy ``tokens`` strings (``bytes:\\xNN`` or text), by their pieces."""
    by_piece = {}
    for i in range(llm.tokenizer.vocab_size):
        by_piece.setdefault(llm.tokenizer.token_to_piece(i, special=True), i)
    out = []
    for t in tokens:
        if t.startswith("bytes:"):
            raw = bytes(int(h, 16) for h in t[len("bytes:") :].split("\\x")[1:])
        else:
            raw = t.encode()
        out.append(by_piece[raw])
    return out


def check_against(
    llm, ids: list[int], logprobs: list[float | None], start: int = 1, n_prompt: int | None = None
):
    """``logprobs[j]`` is the log-probability of ``ids[start + j]``; the first ``n_prompt``
    ids are the prompt."""
    ref = reference(llm, ids, n_prompt)
    for j, got in enumerate(logprobs):
        i = start + j
        assert got == pytest.approx(float(ref[i - 1, ids[i]]), abs=TOL), i


def test_echo_logprobs_equal_llm_logits(server, llm):
    prompt = "The quick brown fox"
    ids = llm.tokenize(prompt)
    r = server.client().completions.create(
        model="powerpy", prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=5
    )
    c = r.choices[0]
    lp = c.logprobs
    n_gen = r.usage.completion_tokens
    assert len(lp.tokens) == len(ids) + n_gen
    prompt_tokens = [token_text(llm.tokenizer, t) for t in ids]
    assert lp.tokens[: len(ids)] == prompt_tokens  # echo's tokens are the tokenizer's
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert c.text.startswith(prompt)
    full = ids + ids_of(llm, lp.tokens[len(ids) :])
    check_against(llm, full, lp.token_logprobs[1:], n_prompt=len(ids))
    for i, top in enumerate(lp.top_logprobs[1:], 1):
        values = list(top.values())
        assert 5 <= len(values) <= 6  # the sampled token joins the 5 when it is not among them
        assert values[:5] == sorted(values[:5], reverse=True)  # the top-K are ordered
        assert lp.token_logprobs[i] <= values[0] + TOL
    for i in range(len(ids), len(full)):  # greedy: each generated token is the most likely
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=TOL)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(ids)] == len(prompt)


def test_echo_with_zero_tokens_scores_the_prompt(server, llm):
    prompt = "Scoring a prompt alone"
    ids = llm.tokenize(prompt)
    for _ in range(2):  # the second reuses nothing: a scored prompt runs whole
        r = server.client().completions.create(
            model="powerpy", prompt=prompt, max_tokens=0, echo=True, logprobs=1
        )
        c = r.choices[0]
        assert c.text == prompt and r.usage.completion_tokens == 0
        assert len(c.logprobs.token_logprobs) == len(ids)
        check_against(llm, ids, c.logprobs.token_logprobs[1:])
    status, _, body = server.request(
        "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 0}
    )  # without echo, nothing to do: still a 400
    assert_error(status, body, 400, "max_tokens")


def test_streamed_logprobs_equal_unstreamed(server):
    body = {"prompt": "Streams", "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True}
    _, _, whole = server.request("POST", "/v1/completions", body)
    conn, resp = server.connect("POST", "/v1/completions", {**body, "stream": True})
    text, lps, tokens = "", [], []
    while (data := next_data(resp)) not in (None, "[DONE]"):
        choice = json.loads(data)["choices"][0]
        text += choice["text"]
        if choice["logprobs"]:
            lps += choice["logprobs"]["token_logprobs"]
            tokens += choice["logprobs"]["tokens"]
    conn.close()
    want = whole["choices"][0]
    assert text == want["text"]
    assert lps == want["logprobs"]["token_logprobs"]
    assert tokens == want["logprobs"]["tokens"]


def test_chat_top_logprobs(server, llm):
    messages = [{"role": "user", "content": "Hi there"}]
    ids = llm.apply_chat_template(messages, tokenize=True)
    client = server.client()
    r = client.chat.completions.create(
        model="powerpy",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    full = ids + ids_of(llm, [e.token for e in content])
    check_against(llm, full, [e.logprob for e in content], start=len(ids), n_prompt=len(ids))
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.logprob == pytest.approx(tops[0], abs=TOL)  # greedy
    chunks = list(
        client.chat.completions.create(
            model="powerpy",
            messages=messages,
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
        )
    )
    streamed = [
        e.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert streamed == pytest.approx([e.logprob for e in content], abs=TOL)  # prefix reused


def test_llama_n_probs(server, llm):
    status, _, body = server.request(
        "POST",
        "/completion",
        {"prompt": "Hello", "n_predict": 4, "temperature": 0, "n_probs": 3, "return_tokens": True},
    )
    assert status == 200
    probs = body["completion_probabilities"]
    assert [p["id"] for p in probs] == body["tokens"]
    ids = llm.tokenize("Hello")
    check_against(
        llm, ids + body["tokens"], [p["logprob"] for p in probs], start=len(ids), n_prompt=len(ids)
    )
    assert all(len(p["top_logprobs"]) == 3 for p in probs)


def test_n_choices_are_seeded_streams(server):
    client = server.client()
    kw = dict(model="powerpy", prompt="Once", max_tokens=12, temperature=1.0, seed=1234)
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: repeats
    assert len({c.text for c in a.choices}) > 1  # each choice is its own stream
    for i in range(3):  # choice i samples with seed + i
        one = client.completions.create(n=1, **{**kw, "seed": 1234 + i})
        assert one.choices[0].text == a.choices[i].text
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    chat = client.chat.completions.create(
        model="powerpy",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=7,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    chunks = list(
        client.chat.completions.create(
            model="powerpy",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=6,
            n=2,
            temperature=1.0,
            seed=7,
            stream=True,
        )
    )
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in chat.choices]


BAD = [
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "n": 17}, "n"),
    ("/v1/completions", {"prompt": ["a"] * 16, "n": 16}, "n"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    ("/completion", {"prompt": "Hi", "n_probs": 50}, "n_probs"),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_bad_logprob_requests(server, path, body, param):
    status, _, err = server.request("POST", path, body)
    assert_error(status, err, 400, param)
    r = server.client().completions.create(model="powerpy", prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1  # and the server goes on
