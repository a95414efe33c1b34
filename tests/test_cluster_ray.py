"""Pipeline stages and server replicas on a local Ray cluster of two fake nodes (loopback only):
stages pinned to the nodes give the tokens and log-probabilities of one process, through the
``openai`` client against ``powerpy serve --pipeline``; a stage killed mid-stream ends the stream
with an error and turns /health 503, or with ``--on-stage-failure restart`` is re-run and the
sequence completes as if nothing happened; of two replicas one is killed and requests go on.

One cluster serves the module (its start-up costs seconds on two cores). Run them with
``pytest -m cluster``; they need ``pip install 'powerpy[cluster]'``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from serve_harness import ServerProcess, next_data  # noqa: E402

import powerpy  # noqa: E402
from powerpy.cluster.actors import NAMESPACE, node_for, start_pipeline  # noqa: E402
from powerpy.cluster.spec import StageSpec, parse_pipeline  # noqa: E402
from powerpy.sampling import SamplingParams  # noqa: E402
from powerpy.scheduler import Delta, Failed, Finished, Request, Sampling, Scheduler  # noqa: E402
from powerpy.testing import TinySpec, write_tiny_model  # noqa: E402

pytestmark = pytest.mark.cluster

GREEDY = Sampling(SamplingParams(temperature=0))
STAGES = "pc1:0-1,pc2:2-3"  # each fake node is named by a resource of its own
OBJECT_STORE = 80 << 20  # per node: the machine has little /dev/shm


@pytest.fixture(scope="module")
def cluster():
    """Two fake nodes of one CPU each (resources pc1, pc2), the test process connected."""
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=1,
            resources={"pc1": 1},
            object_store_memory=OBJECT_STORE,
            include_dashboard=False,
        ),
    )
    c.add_node(num_cpus=1, resources={"pc2": 1}, object_store_memory=OBJECT_STORE)
    ray.init(address=c.address, log_to_driver=False)
    yield c
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray") / "m.powerinfer.gguf"
    write_tiny_model(path, TinySpec(n_layer=4, n_ctx=512), sparse=True, seed=2)
    return path, powerpy.load(path)


def _env(cluster) -> dict[str, str]:
    return {"RAY_ADDRESS": cluster.address}


def _run(sched, prompt, n, **kw):
    events, done = [], threading.Event()

    def on_event(ev):
        events.append(ev)
        if isinstance(ev, (Finished, Failed)):
            done.set()

    sched.submit(Request(sched.encode(prompt), n, GREEDY, on_event=on_event, **kw))
    assert done.wait(120)
    return events


def test_two_actor_stages_on_two_nodes_equal_one_process(cluster, model, one_thread):
    """(Each stage has one CPU, so one thread; the whole model too: the kernels' partial sums
    depend on the thread count.)"""
    path, whole = model
    specs = parse_pipeline(STAGES, 4)
    engine = start_pipeline(path, specs, timeout=30)
    try:
        got = [s["node_id"] for s in engine.stages]
        assert got == [node_for("pc1"), node_for("pc2")] and got[0] != got[1]
        runs = {}
        for name, m in (("whole", whole.model), ("pipeline", engine)):
            sched = Scheduler(m, whole.tokenizer, whole.options, n_parallel=2, batch="off")
            sched.start()
            try:
                runs[name] = [_run(sched, p, 10, logprobs=5) for p in ("Hello", "Once upon")]
            finally:
                sched.close()
        for a, b in zip(runs["whole"], runs["pipeline"], strict=True):
            assert isinstance(b[-1], Finished), b[-1]
            # the drawn tokens and their top-5 log-probabilities: the same bits of the logits
            assert [e for e in a if isinstance(e, Delta)] == [e for e in b if isinstance(e, Delta)]
    finally:
        engine.close()


def test_a_stuck_stage_meets_the_deadline(cluster, model):
    """A stage that stops answering (SIGSTOP) fails the step at its deadline, with a 503."""
    path, whole = model
    engine = start_pipeline(path, parse_pipeline(STAGES, 4), timeout=3)
    sched = Scheduler(engine, engine.tokenizer, engine.options, n_parallel=1, batch="off")
    sched.start()
    pid = engine.stages[1]["pid"]
    try:
        assert isinstance(_run(sched, "Hello", 4)[-1], Finished)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        end = _run(sched, "Hello", 50)[-1]
        assert time.monotonic() - t0 < 3 + 10
        assert isinstance(end, Failed) and end.status == 503, end
        assert "stage 1 (layers 2-3" in end.message and "did not answer in time" in end.message
        assert sched.health()["stage"] == 1
    finally:
        os.kill(pid, signal.SIGCONT)
        sched.close()
        engine.close()


def test_a_stage_on_a_missing_node_or_failing_to_load(cluster, model):
    """One clear error naming the stage, and no actor left behind."""
    path, _ = model
    with pytest.raises(ValueError, match="no Ray node is 'pc3'"):
        start_pipeline(path, [StageSpec(range(0, 2), "pc1"), StageSpec(range(2, 4), "pc3")])
    with pytest.raises(ValueError, match=r"stage 0 \(layers 0-1 on pc1\).*cache type 'bogus'"):
        start_pipeline(path, parse_pipeline(STAGES, 4), load_options={"cache_type": "bogus"})
    alive = [n for n in ray.util.list_named_actors(all_namespaces=True) if "stage" in n["name"]]
    assert not alive, alive


def _stream(srv, prompt, n, on_chunk=None):
    """The texts of a streamed greedy completion and how it ended ("stop", or the error)."""
    body = {
        "model": "powerpy",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    conn, resp = srv.connect("POST", "/v1/completions", body)
    texts, end = [], None
    try:
        while (data := next_data(resp)) not in (None, "[DONE]"):
            chunk = json.loads(data)
            if "error" in chunk:
                end = chunk["error"]
                break
            texts.append(chunk["choices"][0]["text"])
            if on_chunk is not None:
                on_chunk(len(texts))
    finally:
        conn.close()
    return texts, end


def _kill_stage(srv, index: int) -> float:
    meta = srv.request("GET", "/v1/models")[2]["data"][0]["meta"]
    ray.kill(ray.get_actor(meta["pipeline"][index]["actor"], namespace=NAMESPACE))
    return time.monotonic()


def test_serve_pipeline_answers_as_one_process_and_fails_a_dead_stage(cluster, model):
    path, whole = model
    srv = ServerProcess(
        "-m",
        str(path),
        "--pipeline",
        STAGES,
        "--batch",
        "off",
        "-np",
        "2",
        "--stage-timeout",
        "20",
        env=_env(cluster),
        timeout=300,
    )
    try:
        client = srv.client()
        r = client.completions.create(
            model="powerpy", prompt="Hello", max_tokens=12, temperature=0, logprobs=3
        )
        assert r.choices[0].text == whole.generate("Hello", 12, temperature=0)
        chat = client.chat.completions.create(
            model="powerpy",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        status, _, health = srv.request("GET", "/health")
        assert status == 200, health
        killed = []
        texts, end = _stream(
            srv, "Hello", 300, lambda n: n == 3 and killed.append(_kill_stage(srv, 1))
        )
        assert killed and end is not None, (texts, end)
        assert time.monotonic() - killed[0] < 20  # within the step's deadline
        assert end["code"] == "engine_unavailable" and "stage 1 (layers 2-3" in end["message"]
        status, _, body = srv.request("GET", "/health")
        assert status == 503, body
        err = body["error"]
        assert (err["stage"], err["layers"], err["code"]) == (1, "2-3", "engine_unavailable")
        assert err["host"] and err["error"]
        assert srv.request("GET", "/v1/models")[0] == 200  # the server keeps answering
        status, _, body = srv.request(
            "POST", "/v1/completions", {"model": "powerpy", "prompt": "Hi", "max_tokens": 2}
        )
        assert status == 503 and body["error"]["code"] == "engine_unavailable", body
    finally:
        srv.stop()


def test_a_restarted_stage_continues_the_interrupted_sequence(cluster, model):
    path, _ = model
    srv = ServerProcess(
        "-m",
        str(path),
        "--pipeline",
        STAGES,
        "--batch",
        "off",
        "-np",
        "2",
        "--on-stage-failure",
        "restart",
        "--stage-timeout",
        "20",
        env=_env(cluster),
        timeout=300,
    )
    try:
        want, end = _stream(srv, "Once upon", 40)
        assert end is None and len(want) == 40
        got, end = _stream(srv, "Once upon", 40, lambda n: n == 5 and _kill_stage(srv, 1))
        assert end is None, end
        assert "".join(got) == "".join(want)  # the same greedy tokens, uninterrupted
        assert "re-running" in srv.log
        r = srv.client().completions.create(model="powerpy", prompt="Hi", max_tokens=4)
        assert r.choices[0].finish_reason == "length"
        assert srv.request("GET", "/health")[0] == 200
    finally:
        srv.stop()


def test_two_replicas_and_one_killed(cluster, model):
    path, whole = model
    srv = ServerProcess(
        "-m", str(path), "--replicas", "2", "-np", "2", env=_env(cluster), timeout=300
    )
    try:
        client = srv.client()
        want = whole.generate("Hello", 8, temperature=0)
        for _ in range(4):
            r = client.completions.create(
                model="powerpy", prompt="Hello", max_tokens=8, temperature=0
            )
            assert r.choices[0].text == want
        replicas = [
            n
            for n in ray.util.list_named_actors(all_namespaces=True)
            if "Replica" in n["name"] and "SERVE_REPLICA" in n["name"]
        ]
        assert len(replicas) == 2, replicas
        ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]))
        ok = 0
        for _ in range(6):  # the other replica answers while Serve replaces the dead one
            try:
                r = client.completions.create(
                    model="powerpy", prompt="Hello", max_tokens=8, temperature=0
                )
                ok += r.choices[0].text == want
            except Exception:
                time.sleep(0.5)
        assert ok >= 5, ok
        assert srv.request("GET", "/health")[0] == 200
    finally:
        srv.stop()
