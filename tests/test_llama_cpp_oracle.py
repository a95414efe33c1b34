"""SmolLM2-135M against llama.cpp (llama-cpp-python): tokens, logits, greedy continuations.

Two files are compared. ``f32``: the packaged model with every tensor dequantized to F32, so both
engines multiply the same numbers; the remaining difference is the float order of llama.cpp's
f32 matmuls, a few hundredths of a logit. ``q4_1``: the packaged file itself. There powerpy
follows llama.cpp's numerics step by step (``powerpy.model.ggml_numerics``): activations rounded
to Q8_1 (Q8_0 for the Q8_0 output) with the same integer block sums in the same float order,
RMSNorm with a double sum, ggml's exp in SiLU and softmax, RoPE angles by ggml's f32
recurrence, q and the softmax weights rounded to f16 for the f16 KV cache, and ggml's summation
orders for one token and for a batch. So every logit of a prompt and of a greedy continuation is
bit-identical to llama.cpp's, with the default (f16) cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from powerpy.api import load
from powerpy.formats.constants import GGMLType
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.gguf_writer import write_gguf

pytestmark = pytest.mark.llama_cpp

PROMPTS = [
    "The capital of France is",
    "In the beginning God created the heaven and the earth. And the earth was",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def f32_path(smollm2_path, tmp_path_factory):
    gf = read_gguf(smollm2_path)
    path = tmp_path_factory.mktemp("smol") / "smollm2-f32.gguf"
    tensors = [(n, gf.dequantize(n), GGMLType.F32) for n in gf.tensors]
    write_gguf(path, gf.typed_kv(), tensors)
    return path


def _engines(lc, path):
    """(llama.cpp, powerpy) on one file; lc: the llama_cpp module."""
    ref = lc.Llama(model_path=str(path), n_ctx=256, logits_all=True, n_threads=2, verbose=False)
    return ref, load(path)


@pytest.fixture(scope="module", params=["f32", "q4_1"])
def pair(request, llama_cpp, smollm2_path, f32_path):
    path = f32_path if request.param == "f32" else smollm2_path
    return (request.param, *_engines(llama_cpp, path))


def _ref_logits(ref, ids: list[int]) -> np.ndarray:
    ref.reset()
    ref.eval(ids)
    return np.array(ref.scores[: len(ids)], dtype=np.float64)


def _greedy_ref(ref, ids: list[int], n: int, eos: int) -> list[int]:
    ref.reset()
    ref.eval(ids)
    out: list[int] = []
    while len(out) < n:
        tok = int(np.argmax(ref.scores[ref.n_tokens - 1]))
        out.append(tok)
        if tok == eos:
            break
        ref.eval([tok])
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_agree(pair, prompt):
    kind, ref, ours = pair
    ids = ours.tokenize(prompt)
    assert ids == ref.tokenize(prompt.encode(), add_bos=False, special=True)
    want = _ref_logits(ref, ids)
    got = ours.logits(ids).double().numpy()
    err = np.abs(got - want)
    if kind == "f32":
        assert err.max() < 0.05, err.max()
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
    else:  # llama.cpp's numerics (module docstring): bit-identical
        np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def f32_pair(llama_cpp, f32_path):
    return _engines(llama_cpp, f32_path)


# The f32 file: the engines' f32 matmuls sum in different orders, yet greedy runs agree.
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_agrees(f32_pair, prompt):
    ref, ours = f32_pair
    ids = ours.tokenize(prompt)
    want = _greedy_ref(ref, ids, 32, ours.tokenizer.eos_id)
    got = [r.token for r in ours.stream(ids, 32, temperature=0)]
    assert got == want, (ours.detokenize(got), ours.detokenize(want))
    assert len(got) >= 8  # both may stop at end of text, but not trivially early


@pytest.fixture(scope="module")
def q4_1_pair(llama_cpp, smollm2_path):
    return _engines(llama_cpp, smollm2_path)


def test_single_token_logits_bit_identical_q4_1(q4_1_pair):
    """One token: the same float32 logits as llama.cpp, bit for bit."""
    ref, ours = q4_1_pair
    for tok in [1, 5, 33, 100, 260, 788, 1000, 1604, 19556, 20000, 49000]:
        ref.reset()
        ref.eval([tok])
        want = np.array(ref.scores[:1])
        cache = ours.model.new_cache(4)  # f16, llama.cpp's KV cache type
        got = ours.model.forward(torch.tensor([tok]), cache).numpy()
        np.testing.assert_array_equal(got, want, err_msg=f"token {tok}")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_q4_1_equals_llama_cpp(q4_1_pair, prompt):
    """The packaged Q4_1 file: 32 greedy tokens equal llama.cpp's, and so does every logit of
    the prompt (one batch) and of each decoded token (one at a time), bit for bit."""
    ref, ours = q4_1_pair
    ids = ours.tokenize(prompt)
    want = _greedy_ref(ref, ids, 32, ours.tokenizer.eos_id)
    got = [r.token for r in ours.stream(ids, 32, temperature=0)]  # the API, default options
    assert got == want, (ours.detokenize(got), ours.detokenize(want))
    assert len(got) >= 8
    seq = ids + want[:-1]
    ref_logits = np.array(ref.scores[: len(seq)])  # _greedy_ref left the whole run in ref
    cache = ours.model.new_cache(len(seq))
    steps = [ours.model.forward(torch.tensor(ids), cache, all_logits=True)]
    steps += [ours.model.forward(torch.tensor([t]), cache) for t in want[:-1]]
    np.testing.assert_array_equal(torch.cat(steps).numpy(), ref_logits)


def test_long_prompt_logits_bit_identical_q4_1(q4_1_pair):
    """A 58-token prompt: attention over 16+ cells takes the batched kernels' 16-cell steps."""
    ref, ours = q4_1_pair
    text = (
        "In the beginning God created the heaven and the earth. And the earth was without form, "
        "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
        "the face of the waters. And God said, Let there be light: and there was light."
    )
    ids = ours.tokenize(text)
    assert len(ids) > 48
    np.testing.assert_array_equal(ours.logits(ids).numpy(), _ref_logits(ref, ids))
