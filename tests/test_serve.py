"""`powerpy serve` end to end: a real server process on a loopback port, driven by the official
``openai`` package and by raw HTTP (errors, auth, 503 past the queue, draining on Ctrl-C).

Tiny random models (powerpy.testing) stand in where no real model is needed; the real SmolLM2
checks the chat template path and the KV prefix reuse of a follow-up turn.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

import torch  # noqa: E402
from serve_harness import ServerProcess, assert_error, next_data  # noqa: E402

from powerpy.api import load  # noqa: E402
from powerpy.testing import TinySpec, write_tiny_model  # noqa: E402

PROMPTS = ["Hello", "Once upon a time", "abc", "The Lord is my", "x", "zzzz yyy", "q!", "42"]
KEY = "sk-test-123"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny.powerinfer.gguf"
    write_tiny_model(path, TinySpec(n_ctx=4096), sparse=True, seed=4)
    return path


@pytest.fixture(scope="module")
def reference(tiny):
    """``want(prompt, n)``: the greedy text of ``llm.generate`` (one thread, as the server)."""
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = load(tiny)
    cache = {}

    def want(prompt: str, n: int) -> str:
        if (prompt, n) not in cache:
            cache[prompt, n] = llm.generate(prompt, n, temperature=0)
        return cache[prompt, n]

    want.llm = llm
    yield want
    torch.set_num_threads(n_threads)


@pytest.fixture(scope="module")
def server(tiny):
    """Four sessions on the tiny sparse model (batching chosen by measurement)."""
    s = ServerProcess("-m", str(tiny), "-t", "1", "-np", "4", "-c", "2048", "--queue", "64")
    yield s
    assert s.stop() == 0, s.log


# ----------------------------------------------------------------------------------- basics
def test_completions_greedy_equal_generate(server, reference):
    client = server.client()
    for prompt, n in [("Hello", 12), ("Once upon a time", 20)]:
        r = client.completions.create(model="powerpy", prompt=prompt, max_tokens=n, temperature=0)
        assert r.choices[0].text == reference(prompt, n)
        assert r.choices[0].finish_reason in ("length", "stop")
        assert r.usage.prompt_tokens == len(reference.llm.tokenize(prompt))
        assert 0 < r.usage.completion_tokens <= n
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        chunks = list(
            client.completions.create(
                model="powerpy", prompt=prompt, max_tokens=n, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == reference(prompt, n)
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_streamed_and_not(server, reference):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = reference.llm.apply_chat_template(messages, tokenize=True)
    want = reference.llm.generate(ids, 10, temperature=0)
    r = client.chat.completions.create(
        model="powerpy", messages=messages, max_tokens=10, temperature=0
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model="powerpy",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_stop_strings_never_leak(server, reference):
    client = server.client()
    full = reference("Once upon a time", 40)
    stop = full[12:15]  # cut mid-text; tokens are single bytes, so streaming splits it
    want = full[: full.find(stop)]
    r = client.completions.create(
        prompt="Once upon a time",
        max_tokens=40,
        temperature=0,
        stop=[stop, "\x00never"],
        model="powerpy",
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(
        client.completions.create(
            prompt="Once upon a time",
            max_tokens=40,
            temperature=0,
            stop=stop,
            stream=True,
            model="powerpy",
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_health_metrics_and_llama_endpoints(server, reference):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["powerpy"]
    status, _, body = server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok"
    status, _, body = server.request("POST", "/tokenize", {"content": "Hello"})
    assert status == 200 and body["tokens"] == reference.llm.tokenize("Hello", add_bos=False)
    status, _, body = server.request("POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body["content"] == reference.llm.detokenize(
        reference.llm.tokenize("Hello", add_bos=False)
    )
    status, _, body = server.request(
        "POST", "/completion", {"prompt": "Hello", "n_predict": 12, "temperature": 0}
    )
    assert status == 200 and body["content"] == reference("Hello", 12)
    assert body["stop"] is True and body["tokens_predicted"] == 12 and body["stopped_limit"]
    conn, resp = server.connect(
        "POST",
        "/completion",
        {"prompt": "Hello", "n_predict": 12, "temperature": 0, "stream": True},
    )
    events = []
    while (data := next_data(resp)) is not None:
        events.append(json.loads(data))
    conn.close()
    assert "".join(e["content"] for e in events) == reference("Hello", 12)
    assert events[-1]["stop"] is True and events[-1]["timings"]["predicted_n"] == 12
    status, headers, text = server.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in (
        "powerpy_requests_total",
        "powerpy_prompt_tokens_total",
        "powerpy_generated_tokens_total",
        "powerpy_prompt_tokens_per_second",
        "powerpy_decode_tokens_per_second",
        "powerpy_queue_depth",
        "powerpy_predicted_active_ratio",
    ):
        assert re.search(rf"^{name}(\{{.*\}})? [0-9.e+]+$", text, re.M), name
    generated = re.search(r"^powerpy_generated_tokens_total (\S+)$", text, re.M)
    assert float(generated.group(1)) > 0


# ----------------------------------------------------------------------------------- many clients
def test_sixteen_streaming_clients(server, reference):
    """16 clients x 4 streamed greedy requests on 4 sessions: each equals the lone output."""
    jobs = [
        (c, k, PROMPTS[(c + k) % len(PROMPTS)], 8 + 4 * ((c * 4 + k) % 5))
        for c in range(16)
        for k in range(4)
    ]
    wants = {(p, n): reference(p, n) for _, _, p, n in jobs}
    health_codes: list[int] = []
    stop = threading.Event()

    def poll_health():
        while not stop.is_set():
            health_codes.append(server.request("GET", "/health")[0])
            time.sleep(0.05)

    def one_client(c: int) -> list[tuple[str, int, str, str]]:
        client, out = server.client(), []
        for cc, _, prompt, n in jobs:
            if cc != c:
                continue
            stream = client.completions.create(
                model="powerpy", prompt=prompt, max_tokens=n, temperature=0, stream=True
            )
            chunks = list(stream)
            out.append(
                (
                    prompt,
                    n,
                    "".join(x.choices[0].text for x in chunks),
                    chunks[-1].choices[0].finish_reason,
                )
            )
        return out

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        with ThreadPoolExecutor(16) as pool:
            results = [r for rs in pool.map(one_client, range(16)) for r in rs]
    finally:
        stop.set()
        poller.join()
    assert len(results) == 64
    for prompt, n, text, reason in results:
        assert text == wants[prompt, n], (prompt, n)
        assert reason in ("stop", "length")
    assert health_codes and set(health_codes) == {200}
    _, _, text = server.request("GET", "/metrics")
    batch = float(re.search(r"^powerpy_decode_batch_size (\S+)$", text, re.M).group(1))
    assert batch >= 1.0


def test_disconnect_frees_the_session(server):
    conn, resp = server.connect(
        "POST",
        "/v1/completions",
        {"prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "stream": True},
    )
    assert resp.status == 200 and next_data(resp)
    conn.close()  # the client goes away mid-generation
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        _, _, body = server.request("GET", "/health")
        _, _, text = server.request("GET", "/metrics")
        cancelled = re.search(r'^powerpy_requests_total\{outcome="cancelled"\} (\S+)$', text, re.M)
        if body["slots_processing"] == 0 and float(cancelled.group(1)) >= 1:
            return
        time.sleep(0.05)
    raise AssertionError("the session was not freed")


# ----------------------------------------------------------------------------------- bad requests
BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "Hi", ', 400, None),  # malformed JSON
    ("/v1/completions", b"[1, 2]", 400, None),  # not an object
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),  # missing field
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "Hi", "stop": [1, 2]}, 400, "stop"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "Hi", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi " * 800}, 400, "prompt"),  # longer than the context
    ("/v1/completions", {"prompt": "Hi", "model": "gpt-4o"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ("/completion", {"prompt": "Hi", "n_predict": -7}, 400, "n_predict"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/tokenize", {"content": 5}, 400, "content"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    got, headers, err = server.request("POST", path, body)
    assert headers["content-type"] == "application/json"
    assert_error(got, err, status, param)


def test_other_errors_and_the_server_goes_on(server, reference):
    assert_error(*server.request("GET", "/v1/nothing")[::2], 404)
    assert_error(*server.request("GET", "/v1/completions")[::2], 405)
    big = {"prompt": "x" * (2 << 20)}  # over the 1 MiB body limit
    assert_error(*server.request("POST", "/v1/completions", big)[::2], 413)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model="powerpy", prompt="Hi", max_tokens=-1)
    r = server.client().completions.create(
        model="powerpy", prompt="Hello", max_tokens=12, temperature=0
    )
    assert r.choices[0].text == reference("Hello", 12)


# ------------------------------------------------------------------------ auth, 503, drain
@pytest.fixture(scope="module")
def keyed(tiny):
    """One session, one queue place, an API key from the environment."""
    s = ServerProcess(
        "-m", str(tiny), "-t", "1", "-np", "1", "--queue", "1", env={"POWERPY_API_KEY": KEY}
    )
    yield s
    s.stop(signal.SIGKILL)


def test_api_key(keyed, reference):
    with pytest.raises(openai.AuthenticationError):
        keyed.client().completions.create(model="powerpy", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        keyed.client("sk-wrong").models.list()
    for path in ("/v1/models", "/metrics", "/tokenize"):
        assert_error(*keyed.request("GET" if path != "/tokenize" else "POST", path)[::2], 401)
    assert keyed.request("GET", "/health")[0] == 200  # the one open endpoint
    r = keyed.client(KEY).completions.create(
        model="powerpy", prompt="Hello", max_tokens=12, temperature=0
    )
    assert r.choices[0].text == reference("Hello", 12)


def test_503_past_the_queue_and_disconnects(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    long = {"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    first = keyed.connect("POST", "/v1/completions", long, auth)
    assert first[1].status == 200 and next_data(first[1])  # running in the only session
    second = keyed.connect("POST", "/v1/completions", long, auth)  # waits in the queue
    deadline = time.monotonic() + 20
    while keyed.request("GET", "/health")[2]["queue_depth"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, headers, body = keyed.request("POST", "/v1/completions", long, auth)
    assert_error(status, body, 503)
    assert int(headers["retry-after"]) >= 1
    with pytest.raises(openai.APIStatusError) as e:
        keyed.client(KEY).completions.create(model="powerpy", prompt="Hi", max_tokens=2)
    assert e.value.status_code == 503
    first[0].close()  # both clients go away: the session and the queue place free
    second[0].close()
    deadline = time.monotonic() + 20
    while (h := keyed.request("GET", "/health")[2])["slots_processing"] or h["queue_depth"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = keyed.client(KEY).completions.create(model="powerpy", prompt="Hi", max_tokens=3)
    assert r.usage.completion_tokens <= 3


def test_ctrl_c_drains_running_requests(keyed, reference):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {
        "prompt": "Hello",
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    conn, resp = keyed.connect("POST", "/v1/completions", body, auth)
    texts = [json.loads(next_data(resp))["choices"][0]["text"]]
    keyed.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 10
    while keyed.request("GET", "/health")[0] != 503:  # draining: no new work
        assert time.monotonic() < deadline
    status, _, err = keyed.request("POST", "/v1/completions", {"prompt": "Hi"}, auth)
    assert_error(status, err, 503)
    while (data := next_data(resp)) not in (None, "[DONE]"):
        chunk = json.loads(data)["choices"][0]
        texts.append(chunk["text"])
        reason = chunk["finish_reason"]
    conn.close()
    assert data == "[DONE]" and reason == "length"
    assert len("".join(texts).encode("utf-8", "surrogatepass")) > 0
    assert keyed.proc.wait(30) == 0, keyed.log


# ----------------------------------------------------------------------------------- real model
def test_smollm2_chat_and_prefix_reuse(smollm2_path):
    """f32 activations (as the reference below): with llama.cpp's Q8_1 rounding this Q4_1 model
    answers "L'Étoile, la Cité, ..." here, in llama.cpp and in powerpy alike."""
    threads = str(torch.get_num_threads())  # as the reference below
    server = ServerProcess(
        "-m",
        str(smollm2_path),
        "-np",
        "1",
        "--alias",
        "smol",
        "-t",
        threads,
        "--exact-activations",
    )
    try:
        llm = load(smollm2_path, exact_activations=True)
        client = server.client()
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=24, temperature=0
        )
        want = llm.chat(messages, 24, temperature=0)
        assert r.choices[0].message.content == want
        assert "Paris" in want
        messages += [
            {"role": "assistant", "content": want},
            {"role": "user", "content": "And of Germany?"},
        ]
        chunks = list(
            client.chat.completions.create(
                model="smol",
                messages=messages,
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == llm.chat(messages, 16, temperature=0)
        usage = chunks[-1].usage
        assert usage.prompt_tokens_details.cached_tokens > usage.prompt_tokens // 2  # reused
    finally:
        assert server.stop() == 0, server.log
