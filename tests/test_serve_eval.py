"""An evaluation harness as a real client: lm-evaluation-harness's ``local-completions`` backend
scores a small multiple-choice task through ``/v1/completions`` (``echo``, ``logprobs``) of a
real ``python -m powerpy serve`` with the default model (the sparse SmolLM2, its FFN cut), using
the server's own tokenizer (``tokenizer_backend=remote``: ``/tokenizer_info`` and
``/tokenize``). Its scores must be, to the bit, the ones computed from ``LLM.logits`` directly in
this process, which runs at another thread count than the server (a sparse model's sums give the
same bits at any count: tests/test_thread_bits.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import torch  # noqa: E402
from serve_harness import ROOT, ServerProcess  # noqa: E402

from powerpy.api import load  # noqa: E402

ITEMS = [  # question, choices, answer
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What is the capital of Germany?", ["Rome", "Berlin", "Paris", "Lisbon"], 1),
    ("What color is the sky on a clear day?", ["green", "red", "blue", "yellow"], 2),
    ("How many legs does a dog have?", ["two", "six", "eight", "four"], 3),
    ("What is the largest planet in the solar system?", ["Jupiter", "Mars", "Venus", "Mercury"], 0),
    ("Which animal says moo?", ["cat", "cow", "dog", "duck"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("What is frozen water called?", ["steam", "sand", "glass", "ice"], 3),
    ("Which season comes after winter?", ["spring", "autumn", "summer", "winter"], 0),
    ("What is the opposite of hot?", ["warm", "cold", "big", "fast"], 1),
    ("How many days are in a week?", ["five", "ten", "seven", "three"], 2),
    ("What do you use to write on paper?", ["spoon", "shoe", "plate", "pen"], 3),
    ("What is the capital of Italy?", ["Rome", "Vienna", "Prague", "Oslo"], 0),
    ("Which fruit is yellow and curved?", ["apple", "banana", "grape", "cherry"], 1),
    ("What gas do humans breathe in to live?", ["helium", "neon", "oxygen", "argon"], 2),
    ("Which star is closest to the Earth?", ["Sirius", "Vega", "Polaris", "the Sun"], 3),
    ("What is two plus two?", ["four", "five", "three", "six"], 0),
    ("Which ocean is the largest?", ["Atlantic", "Pacific", "Indian", "Arctic"], 1),
    ("What is the capital of Spain?", ["Lisbon", "Athens", "Madrid", "Dublin"], 2),
    ("What do cows drink?", ["milk", "juice", "coffee", "water"], 3),
]
TASK = """task: powerpy_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


def context(question: str) -> str:
    return f"Question: {question}\nAnswer:"


@pytest.fixture(scope="module")
def smol_server():
    s = ServerProcess("-t", "1", "-np", "1")  # the default model, one thread
    yield s
    assert s.stop() == 0, s.log


@pytest.fixture(scope="module")
def smol():
    n = torch.get_num_threads()
    torch.set_num_threads(2)  # not the server's count
    yield load()
    torch.set_num_threads(n)


def loglikelihood(llm, ctx: str, continuation: str) -> float:
    """The continuation's log-probability after the context, tokenized as lm-eval does (the
    whole text, split after the context's tokens; no BOS)."""
    whole = llm.tokenize(ctx + continuation, add_bos=False)
    n_ctx = len(llm.tokenize(ctx, add_bos=False))
    rows = torch.log_softmax(llm.logits(whole), dim=-1)
    return sum(float(rows[i - 1, whole[i]]) for i in range(n_ctx, len(whole)))


def test_smollm2_echo_logprobs_equal_llm_logits(smol_server, smol):
    prompt = context(ITEMS[0][0]) + " Paris"
    ids = smol.tokenize(prompt, add_bos=False)
    r = smol_server.client().completions.create(
        model="powerpy", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    rows = torch.log_softmax(smol.logits(ids), dim=-1)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == float(rows[i - 1, ids[i]])  # the same bits
    status, _, info = smol_server.request("GET", "/tokenizer_info")
    assert status == 200 and info["eos_token"] == "<|im_end|>"
    status, _, toks = smol_server.request(
        "POST", "/tokenize", {"prompt": prompt, "add_special_tokens": False}
    )
    assert status == 200 and toks["tokens"] == ids


@pytest.mark.slow
def test_lm_eval_local_completions(smol_server, smol, tmp_path):
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval's API models need it (lm-eval[api])
    data = tmp_path / "items.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS)
    )
    (tmp_path / "powerpy_mc.yaml").write_text(TASK.format(data=data))
    args = (
        f"base_url={smol_server.url}/v1/completions,model=powerpy,tokenizer_backend=remote,"
        "num_concurrent=1,max_retries=1"
    )
    t0 = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            args,
            "--tasks",
            "powerpy_mc",
            "--include_path",
            str(tmp_path),
            "--output_path",
            str(tmp_path / "out"),
            "--log_samples",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={
            **os.environ,
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT),
        },
    )
    seconds = time.monotonic() - t0
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    acc = json.loads(results.read_text())["results"]["powerpy_mc"]["acc,none"]
    (samples,) = (tmp_path / "out").rglob("samples_powerpy_mc_*.jsonl")
    served = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        served[s["doc_id"]] = [float(r[0]) for r in s["filtered_resps"]]
    correct = 0
    for doc, (question, choices, answer) in enumerate(ITEMS):
        want = [loglikelihood(smol, context(question), " " + c) for c in choices]
        assert served[doc] == want, doc  # the same bits
        correct += max(range(len(want)), key=want.__getitem__) == answer
    assert acc == correct / len(ITEMS)
    print(f"lm-eval: accuracy {acc:.2f} in {seconds:.1f} s")
