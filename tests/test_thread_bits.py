"""The same bits at any thread count (docs/kernels.md#threads-and-bits).

torch's thread count is process-wide, so each count runs in its own process: one process per
count loads every model below and prints a digest of its logits for a long prompt (more than 8
tokens: the batched prompt path), a short one (at most 8: the per-token sums) and greedy decode
steps (the one-call decode). Every count must give the same digests. The models are wide enough
(n_embd >= 512) that the row sums really split over 2 to 4 threads, and most keep f32
activations: llama.cpp's int8 rounding of a quantized matmul's input hides most last-bit
differences, which is how a thread-dependent sum once passed unseen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from moe_files import write_gguf_py

from powerpy.formats.constants import GGMLType, GGUFValueType, Keys
from powerpy.model import kernels
from powerpy.testing import TinySpec, write_tiny_model
from powerpy.testing.moe import write_moe_model

THREADS = (1, 2, 3, 4)
WIDE = TinySpec(n_embd=512, n_layer=2, n_ff=1536, n_head=8, n_head_kv=4, n_pred_hidden=64)
MOE = TinySpec(
    n_embd=512,
    n_layer=2,
    n_ff=512,
    n_head=8,
    n_head_kv=4,
    arch="qwen3moe",
    n_expert=8,
    n_expert_used=2,
    n_ff_exp=512,
)
OSS = TinySpec(
    n_embd=512,
    n_layer=2,
    n_ff=512,
    n_head=8,
    n_head_kv=4,
    arch="gpt-oss",
    n_expert=8,
    n_expert_used=2,
    n_ff_exp=512,
    sliding_window=8,
    key_length=64,
)
MLA = TinySpec(
    arch="deepseek2",
    n_embd=512,
    n_layer=2,
    n_ff=1024,
    n_head=8,
    n_ff_exp=512,
    n_expert=8,
    n_expert_used=2,
    n_layer_dense=1,
    n_rot=32,
    q_lora_rank=256,
    kv_lora_rank=512,
    key_length_mla=96,
    value_length_mla=64,
)

# Runs in a fresh interpreter: argv[1] the thread count, argv[2] the JSON list of cases.
SCRIPT = r"""
import hashlib, json, sys
import torch
torch.set_num_threads(int(sys.argv[1]))
import powerpy
from powerpy.sampling import SamplingParams, make_sampler

def digest(t):
    return hashlib.sha1(t.contiguous().numpy().tobytes()).hexdigest()[:16]

out = {}
for name, path, kw in json.loads(sys.argv[2]):
    llm = powerpy.load(path, **kw)
    long = list(range(3, 40))  # 37 byte tokens
    rows = [digest(llm.logits(long)), digest(llm.logits(long[:6]))]
    cache = llm.model.new_cache(64)
    logits = llm.model.forward(torch.tensor(long[:5]), cache, llm.options)
    for _ in range(6):  # greedy decode steps
        rows.append(digest(logits))
        tok = int(logits[-1].argmax())
        logits = llm.model.forward(torch.tensor([tok]), cache, llm.options)
    out[name] = rows
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list:
    d = tmp_path_factory.mktemp("threads")
    pwri = {}
    for dtype in (GGMLType.F16, GGMLType.Q4_0):
        pwri[dtype] = d / f"wide-{dtype.name}.powerinfer.gguf"
        write_tiny_model(pwri[dtype], WIDE, sparse=True, seed=3, dtype=dtype)
    tau = {
        Keys.FFN_DOWN_THRESHOLD: ([0.02] * WIDE.n_layer, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    }
    cut = d / "cut.gguf"
    write_tiny_model(cut, WIDE, sparse=False, seed=4, dtype=GGMLType.F16, extra_kv=tau)
    moe = write_moe_model(d / "moe.gguf", MOE, GGMLType.Q8_0, seed=5)
    oss = d / "oss-mxfp4.gguf"
    write_gguf_py(oss, OSS, GGMLType.Q8_0, seed=6, experts=GGMLType.MXFP4)
    mla = d / "mla-q8_0.gguf"
    write_gguf_py(mla, MLA, GGMLType.Q8_0, seed=7)
    return [
        ["pwri-f16 predictors", str(pwri[GGMLType.F16]), {"threshold": 0.0}],
        ["pwri-q4_0 predictors", str(pwri[GGMLType.Q4_0]), {"threshold": 0.0}],
        [
            "pwri-q4_0 exact",
            str(pwri[GGMLType.Q4_0]),
            {"threshold": 0.0, "exact_activations": True},
        ],
        ["pwri-f16 dense", str(pwri[GGMLType.F16]), {"dense": True}],
        ["cut", str(cut), {}],
        ["moe q8_0", str(moe), {}],
        ["gpt-oss mxfp4 experts", str(oss), {}],
        ["deepseek2 latent attention", str(mla), {}],
        ["default model (SmolLM2, cut)", None, {}],
    ]


def _digests(threads: int, cases: list) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(threads), json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
def test_logits_are_the_same_bits_at_1_to_4_threads(cases):
    got = {t: _digests(t, cases) for t in THREADS}
    differ = {name: [t for t in THREADS if got[t][name] != got[1][name]] for name, *_ in cases}
    assert not any(differ.values()), f"thread counts whose logits differ from 1 thread's: {differ}"
