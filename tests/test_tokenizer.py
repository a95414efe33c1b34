"""Tokenizer tests: llama.cpp (llama-cpp-python) is the oracle for encode, decode and pieces."""

from __future__ import annotations

import logging
import random
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerpy.errors import TokenizerError
from powerpy.tokenizer import StreamDecoder, TokenAttr, Tokenizer, supported_pre_tokenizers

try:
    from tests import tok_fixtures as fx
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    import tok_fixtures as fx

log = logging.getLogger(__name__)

try:
    import llama_cpp  # noqa: F401

    HAVE_LLAMA = True
except ImportError:
    HAVE_LLAMA = False

needs_llama = pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python not installed")

SMOLLM_EXTRA = [
    "<|endoftext|>",
    "<|im_end|><|im_end|>",
    "<repo_name>x<reponame>y<file_sep>z",
    "<|im_start|>assistant\nSure! Here's 1 thing: 42.<|im_end|>\n",
    "a" * 300,
    " " * 17 + "x",
    "\n" * 9 + "y" + "\t" * 5,
    "9" * 25,
    "ab   \n  cd",
    "end with newline\n",
    "?!",
    "\u0085next line and \u2028 line sep",
]
SMOLLM_STRINGS = fx.COMMON_STRINGS + SMOLLM_EXTRA


@pytest.fixture(scope="module")
def smollm_kv(smollm2_path):
    return fx.read_kv(smollm2_path)


@pytest.fixture(scope="module")
def smollm(smollm_kv):
    return Tokenizer.from_gguf_kv(smollm_kv)


@pytest.fixture(scope="module")
def smollm_oracle(smollm2_path):
    if not HAVE_LLAMA:
        pytest.skip("llama-cpp-python not installed")
    oracle = fx.LlamaOracle(smollm2_path)
    yield oracle
    oracle.close()


# --- SmolLM2 (gpt2 / smollm) ----------------------------------------------------------------------
def test_smollm_metadata(smollm):
    assert smollm.model == "gpt2" and smollm.pre == "smollm"
    assert smollm.vocab_size == 49152
    assert (smollm.bos_id, smollm.eos_id, smollm.unk_id, smollm.pad_id) == (1, 2, 0, 2)
    assert smollm.add_bos is False and smollm.add_space_prefix is False
    assert smollm.token_text(2) == "<|im_end|>"
    assert smollm.is_eog(2) and smollm.is_eog(0) and not smollm.is_eog(1)


@needs_llama
def test_smollm_special_ids_match(smollm, smollm_oracle):
    assert smollm_oracle.bos_eos() == (smollm.bos_id, smollm.eos_id)
    assert smollm_oracle.n_vocab() == smollm.vocab_size
    eog = {i for i in range(smollm.vocab_size) if smollm_oracle.is_eog(i)}
    assert eog == set(smollm.eog_ids)


@needs_llama
@pytest.mark.parametrize("idx", range(len(SMOLLM_STRINGS)))
def test_smollm_encode_matches_llama_cpp(smollm, smollm_oracle, idx):
    text = SMOLLM_STRINGS[idx]
    want = smollm_oracle.tokenize(text, add_special=False, special=True)
    assert smollm.encode(text, add_bos=False) == want
    want_plain = smollm_oracle.tokenize(text, add_special=False, special=False)
    assert smollm.encode(text, add_bos=False, parse_special=False) == want_plain
    # add_bos=None follows the vocabulary (false for SmolLM2), as llama.cpp's add_special does
    assert smollm.encode(text) == smollm_oracle.tokenize(text, add_special=True)


@needs_llama
@pytest.mark.parametrize("idx", range(len(SMOLLM_STRINGS)))
def test_smollm_decode_matches_llama_cpp(smollm, smollm_oracle, idx):
    text = SMOLLM_STRINGS[idx]
    ids = smollm.encode(text)
    assert smollm.decode(ids) == text
    for skip in (False, True):
        want = smollm_oracle.detokenize(ids, remove_special=skip, unparse_special=not skip)
        assert smollm.decode_bytes(ids, remove_special=skip, unparse_special=not skip) == want
        assert smollm.decode(ids, skip_special=skip) == want.decode("utf-8", "replace")


@needs_llama
@needs_llama
@pytest.mark.parametrize("raw", fx.INVALID_UTF8)
def test_smollm_invalid_utf8_matches_llama_cpp(smollm, smollm_oracle, raw):
    text = raw.decode("utf-8", "surrogateescape")
    assert smollm.encode(text) == smollm_oracle.tokenize(raw)
    assert smollm.encode(text, parse_special=False) == smollm_oracle.tokenize(raw, special=False)


@needs_llama
def test_smollm_pieces_match_llama_cpp(smollm, smollm_oracle):
    for i in range(smollm.vocab_size):
        assert smollm.token_to_piece(i) == smollm_oracle.piece(i, True), i
    for i in range(40):
        assert smollm.token_to_piece(i, special=False) == smollm_oracle.piece(i, False), i


_ALPHABET = list(
    " \t\n\r\x0b\x0c'\"!?.,;:-_()[]{}<>|/\\@#$%^&*+=~`0123456789"
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    "éÉüßçñøåœ你好世界テストкиПРİıſ٣½²Ⅻ①\u00a0\u2003\u3000\u0085\u200b\u200d\u0301🙂👍🏽"
) + ["'s", "'T", "'re", "'LL", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "   ", "\n\n"]


def oracle_settings(n: int):
    """Deterministic hypothesis runs against the llama.cpp oracle (a slow, shared fixture)."""
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )


def text_parts(alphabet: list[str]):
    """Up to 40 pieces: tricky strings from ``alphabet`` or any assigned code point."""
    return st.lists(
        st.one_of(
            st.sampled_from(alphabet),
            st.characters(blacklist_categories=("Cs", "Cn", "Co")),
        ),
        max_size=40,
    )


@needs_llama
@oracle_settings(300)
@given(parts=text_parts(_ALPHABET))
def test_smollm_random_text_matches_llama_cpp(smollm, smollm_oracle, parts):
    text = "".join(parts)
    assert smollm.encode(text) == smollm_oracle.tokenize(text), repr(text)
    ids = smollm.encode(text)
    assert smollm.decode_bytes(ids) == smollm_oracle.detokenize(ids)


# --- other pre-tokenizers, on a reduced SmolLM2 vocabulary ----------------------------------------
PRE_VARIANTS = [
    "default",
    "gpt-2",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "stablelm2",
    "falcon",
    "starcoder",
    "gpt-4o",
    "tekken",
    "chameleon",
    "jais-2",
    "exaone-moe",
    "bailingmoe",
    "seed-coder",
    "minicpm5",
    "laguna",
    "chatglm-bpe",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
]


@pytest.fixture(scope="module")
def sub_vocab(smollm_kv):
    return fx.with_extra_merges(fx.bpe_subvocab(smollm_kv, 6000))


@needs_llama
@pytest.mark.parametrize("pre", PRE_VARIANTS)
def test_pre_tokenizers_match_llama_cpp(sub_vocab, tmp_path, pre):
    assert pre in supported_pre_tokenizers()
    kv = {**sub_vocab, "tokenizer.ggml.pre": pre}
    kv.pop("tokenizer.ggml.add_bos_token", None)  # exercise llama.cpp's per-pre default
    path = fx.write_vocab_gguf(tmp_path / f"{pre}.gguf", kv)
    tok = Tokenizer.from_gguf_kv(fx.read_kv(path))
    oracle = fx.LlamaOracle(path)
    try:
        assert oracle.bos_eos() == (
            tok.bos_id if tok.bos_id is not None else -1,
            tok.eos_id if tok.eos_id is not None else -1,
        )
        rng = random.Random(pre)
        extra = ["".join(rng.choice(_ALPHABET) for _ in range(30)) for _ in range(30)]
        for text in fx.COMMON_STRINGS + SMOLLM_EXTRA + extra:
            want = oracle.tokenize(text, add_special=True)
            got = tok.encode(text)
            assert got == want, (pre, text)
            for skip in (False, True):
                assert tok.decode_bytes(
                    got, remove_special=skip, unparse_special=not skip
                ) == oracle.detokenize(got, remove_special=skip, unparse_special=not skip), (
                    pre,
                    text,
                )
    finally:
        oracle.close()


# --- SentencePiece ("llama") vocabulary -----------------------------------------------------------
SPM_STRINGS = fx.COMMON_STRINGS + [
    "<s>hello</s>",
    "<s> hello </s>",
    "a<s>b",
    "<unk> literal",
    "<tool>call<tool> [[sep]] x",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "the the the the the",
    "thethethe",
    "▁already▁escaped ▁",
    "Zebra-Quux xylophone: qqq zzz",
    "ÆØÅ æøå — “quoted” ‘single’ …",
    "🙂",
    "\u4e00",
    "bytes: \x00\x01\x7f",
]


@pytest.fixture(scope="module")
def spm_kv():
    pytest.importorskip("sentencepiece")
    return fx.build_spm_vocab()


def _spm_variant(spm_kv, tmp_path_factory, name, **extra):
    path = tmp_path_factory.mktemp("spm") / f"{name}.gguf"
    fx.write_vocab_gguf(path, {**spm_kv, **extra})
    return path


@needs_llama
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"tokenizer.ggml.add_space_prefix": False},
        {"tokenizer.ggml.add_bos_token": False},
        {"tokenizer.ggml.add_eos_token": True},
    ],
    ids=["defaults", "no-space-prefix", "no-bos", "add-eos"],
)
def test_spm_matches_llama_cpp(spm_kv, tmp_path_factory, variant):
    path = _spm_variant(spm_kv, tmp_path_factory, "v", **variant)
    kv = fx.read_kv(path)
    tok = Tokenizer.from_gguf_kv(kv)
    assert tok.model == "llama"
    oracle = fx.LlamaOracle(path)
    try:
        assert oracle.bos_eos() == (tok.bos_id, tok.eos_id)
        assert {i for i in range(tok.vocab_size) if oracle.is_eog(i)} == set(tok.eog_ids)
        for i in range(tok.vocab_size):
            assert tok.token_to_piece(i) == oracle.piece(i, True), i
            assert tok.token_to_piece(i, special=False) == oracle.piece(i, False), i
        for text in SPM_STRINGS:
            for special in (True, False):
                want = oracle.tokenize(text, add_special=True, special=special)
                got = tok.encode(text, parse_special=special, add_eos=True)
                assert got == want, (text, special)
                want = oracle.tokenize(text, add_special=False, special=special)
                assert tok.encode(text, add_bos=False, parse_special=special) == want
            for skip in (False, True):
                ref = oracle.detokenize(got, remove_special=skip, unparse_special=not skip)
                assert tok.decode_bytes(got, remove_special=skip, unparse_special=not skip) == ref
        for raw in fx.INVALID_UTF8:
            text = raw.decode("utf-8", "surrogateescape")
            assert tok.encode(text, add_eos=True) == oracle.tokenize(raw, add_special=True), raw
            ids = oracle.tokenize(raw, add_special=False)
            assert tok.decode_bytes(ids) == oracle.detokenize(ids)
    finally:
        oracle.close()


@pytest.fixture(scope="module")
def spm_pair(spm_kv, tmp_path_factory):
    if not HAVE_LLAMA:
        pytest.skip("llama-cpp-python not installed")
    path = _spm_variant(spm_kv, tmp_path_factory, "random")
    oracle = fx.LlamaOracle(path)
    yield Tokenizer.from_gguf_kv(fx.read_kv(path)), oracle
    oracle.close()


_SPM_ALPHABET = _ALPHABET + ["<s>", "</s>", "<unk>", "<tool>", "[[sep]]", "the", " the", "▁"]


@needs_llama
@oracle_settings(200)
@given(parts=text_parts(_SPM_ALPHABET))
def test_spm_random_text_matches_llama_cpp(spm_pair, parts):
    tok, oracle = spm_pair
    text = "".join(parts)
    ids = tok.encode(text)
    assert ids == oracle.tokenize(text, add_special=True), repr(text)
    assert tok.encode(text, parse_special=False) == oracle.tokenize(
        text, add_special=True, special=False
    )
    for skip in (False, True):
        ref = oracle.detokenize(ids, remove_special=skip, unparse_special=not skip)
        assert tok.decode_bytes(ids, remove_special=skip, unparse_special=not skip) == ref


@needs_llama
def test_spm_score_ties_match_llama_cpp(tmp_path):
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(pieces)
    for piece, score in [
        ("▁", -1.0),
        ("a", -1.0),
        ("b", -1.0),
        ("ab", -2.0),
        ("ba", -2.0),
        ("aa", -2.0),
        ("▁a", -2.0),
        ("bab", -2.0),
        ("aba", -3.0),
        ("▁ab", -1.5),
        ("abab", -2.0),
    ]:
        pieces.append(piece)
        types.append(1)
        scores.append(score)
    kv = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": np.asarray(scores, dtype=np.float32),
        "tokenizer.ggml.token_type": np.asarray(types, dtype=np.int32),
    }
    path = fx.write_vocab_gguf(tmp_path / "ties.gguf", kv)
    tok = Tokenizer.from_gguf_kv(fx.read_kv(path))
    oracle = fx.LlamaOracle(path)
    try:
        for text in ["aba", "abab", "baba", "aaaa", "aaa", " a b", "ab ab  aba", "bababab", "xab"]:
            assert tok.encode(text) == oracle.tokenize(text, add_special=True), text
    finally:
        oracle.close()


def test_spm_roundtrip_and_byte_fallback(spm_kv):
    tok = Tokenizer.from_gguf_kv(spm_kv)
    assert tok.add_bos and tok.add_space_prefix
    for text in SPM_STRINGS:
        if not text or "<" in text or "▁" in text:
            continue
        ids = tok.encode(text, add_bos=False)
        assert tok.decode(ids) == text, text
        # with BOS first the prefix space is kept, exactly like llama_detokenize
        assert tok.decode([tok.bos_id, *ids], skip_special=True) == " " + text
    ids = tok.encode("\u4e00", add_bos=False)  # not in the vocabulary: "▁" + three <0xXX> bytes
    assert [tok.token_attr(i) for i in ids[-3:]] == [TokenAttr.BYTE] * 3
    assert b"".join(tok.token_to_piece(i) for i in ids[-3:]) == "\u4e00".encode()
    assert tok.encode("<tool>x", add_bos=False, parse_special=False)[0] == tok.token_id("<tool>")


# --- StreamDecoder --------------------------------------------------------------------------------
STREAM_TEXTS = [
    "emoji 🙂😀🎉 and 👨‍👩‍👧‍👦 family",
    "你好，世界！日本語のテキスト 한국어",
    "mixed ascii é ü ß and math ∑∫√ ½",
    "<|im_start|>user\nhé 🙂<|im_end|>",
]


def _check_stream(tok: Tokenizer, text: str, **kw) -> None:
    ids = tok.encode(text, add_bos=False)
    dec = tok.stream_decoder(**kw)
    assert isinstance(dec, StreamDecoder)
    chunks = [dec.push(i) for i in ids]
    tail = dec.flush()
    assert "".join(chunks) + tail == tok.decode(ids, skip_special=kw.get("skip_special", False))
    assert all("\ufffd" not in c for c in chunks)
    assert tail == ""


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_decoder_smollm(smollm, text):
    _check_stream(smollm, text)
    dec = smollm.stream_decoder()
    assert "".join(dec.push(i) for i in smollm.encode(text)) == text
    _check_stream(smollm, text, skip_special=True)


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_decoder_spm(spm_kv, text):
    tok = Tokenizer.from_gguf_kv(spm_kv)
    _check_stream(tok, text)
    if "<|" not in text:
        dec = tok.stream_decoder()
        out = "".join(dec.push(i) for i in tok.encode(text, add_bos=False)) + dec.flush()
        assert out == text


def test_stream_decoder_incomplete_tail(smollm):
    ids = smollm.encode("🙂")
    assert len(ids) > 1
    dec = smollm.stream_decoder()
    assert dec.push(ids[0]) == ""
    assert dec.flush() == "\ufffd"


# --- misc -----------------------------------------------------------------------------------------
def test_accepts_lists_and_arrays(smollm_kv, smollm):
    kv = dict(smollm_kv)
    kv["tokenizer.ggml.token_type"] = [int(x) for x in kv["tokenizer.ggml.token_type"]]
    kv["tokenizer.ggml.tokens"] = np.asarray(kv["tokenizer.ggml.tokens"], dtype=object)
    tok = Tokenizer.from_gguf_kv(kv)
    text = "<|im_start|>user\nHello there 123!<|im_end|>"
    assert tok.encode(text) == smollm.encode(text)


def test_rejects_unknown_vocab():
    with pytest.raises(TokenizerError, match="unsupported tokenizer"):
        Tokenizer.from_gguf_kv({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    kv = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a"],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.pre": "no-such-pre",
    }
    with pytest.raises(TokenizerError, match="pre-tokenizer"):
        Tokenizer.from_gguf_kv(kv)
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.from_gguf_kv({})
    assert issubclass(TokenizerError, ValueError)


# --- metadata checks in from_gguf_kv --------------------------------------------------------------
def _tiny_kv(**extra) -> dict:
    """A five-token SPM vocabulary: <unk> <s> </s> ▁a ▁b."""
    kv = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "▁a", "▁b"],
        "tokenizer.ggml.scores": np.asarray([0, 0, 0, -1, -2], dtype=np.float32),
        "tokenizer.ggml.token_type": np.asarray([2, 3, 3, 1, 1], dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
    }
    kv.update(extra)
    return kv


def test_metadata_checks_accept_valid_forms():
    base = Tokenizer.from_gguf_kv(_tiny_kv())
    assert base.encode("a b") == [1, 3, 4]
    forms = _tiny_kv(
        **{
            "tokenizer.ggml.tokens": np.asarray(["<unk>", "<s>", "</s>", "▁a", "▁b"], dtype=object),
            "tokenizer.ggml.scores": [0, 0, 0, -1.0, -2.0],  # ints and floats
            "tokenizer.ggml.token_type": (2, 3, 3, 1, 1),
            "tokenizer.ggml.bos_token_id": np.uint32(1),
            "tokenizer.ggml.eos_token_id": np.asarray([2], dtype=np.uint32),  # a one-item array
            "tokenizer.ggml.add_bos_token": np.bool_(False),
            "tokenizer.ggml.add_eos_token": [True],
            "tokenizer.ggml.unknown_token_id": None,  # None reads as absent
        }
    )
    tok = Tokenizer.from_gguf_kv(forms)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, False, True)
    assert tok.encode("a b") == [3, 4]
    gpt2 = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": np.asarray(["a b"]),
    }
    assert Tokenizer.from_gguf_kv(gpt2).encode("ab") == [2]


_N = 5  # tokens in _tiny_kv
_BAD_METADATA = [
    # key, value, what the message must hold (besides the key)
    ("tokenizer.ggml.tokens", "abc", "'abc' (str): must be an array of strings"),
    ("tokenizer.ggml.tokens", [], "the vocabulary is empty"),
    ("tokenizer.ggml.tokens", ["<unk>", 7], "item 1 is 7 (int)"),
    ("tokenizer.ggml.tokens", np.zeros(5, np.float32), "item 0 is 0.0 (float)"),
    ("tokenizer.ggml.scores", [0.0] * (_N - 1), f"numbers, one per token ({_N})"),
    ("tokenizer.ggml.scores", [0.0] * (_N + 1), f"numbers, one per token ({_N})"),
    ("tokenizer.ggml.scores", ["0"] * _N, "item 0 is '0' (str)"),
    ("tokenizer.ggml.scores", [0.0, 0.0, True, 0.0, 0.0], "item 2 is True (bool)"),
    ("tokenizer.ggml.scores", 0.5, "0.5 (float): must be an array of numbers"),
    ("tokenizer.ggml.token_type", [1.0] * _N, "item 0 is 1.0 (float)"),
    ("tokenizer.ggml.token_type", np.ones(_N + 2, np.int32), f"integers, one per token ({_N})"),
    ("tokenizer.ggml.merges", "a b", "'a b' (str): must be an array of strings"),
    ("tokenizer.ggml.merges", ["a b", 3], "item 1 is 3 (int)"),
    (
        "tokenizer.ggml.bos_token_id",
        float("inf"),
        f"inf (float): a special-token id must be one integer in [0, {_N})",
    ),
    ("tokenizer.ggml.bos_token_id", np.asarray([], np.uint32), "[] (ndarray of 0)"),
    ("tokenizer.ggml.bos_token_id", [1, 2], "(list of 2)"),
    ("tokenizer.ggml.bos_token_id", -1, "-1 (int)"),
    ("tokenizer.ggml.eos_token_id", _N, f"{_N} (int)"),
    ("tokenizer.ggml.eos_token_id", 2.0, "2.0 (float)"),
    ("tokenizer.ggml.eos_token_id", True, "True (bool)"),
    ("tokenizer.ggml.padding_token_id", 2**32 - 1, "4294967295 (int)"),
    ("tokenizer.ggml.prefix_token_id", 99, "99 (int)"),  # a deprecated alias
    ("tokenizer.ggml.add_bos_token", 1, "1 (int): must be a boolean"),
    ("tokenizer.ggml.add_bos_token", "true", "'true' (str): must be a boolean"),
    ("tokenizer.ggml.add_eos_token", [], "[] (list of 0): must be a boolean"),
    ("tokenizer.ggml.add_eos_token", np.float32(1), "1.0 (float32): must be a boolean"),
    ("tokenizer.ggml.add_space_prefix", 0, "0 (int): must be a boolean"),
]


@pytest.mark.parametrize(("key", "value", "want"), _BAD_METADATA)
def test_metadata_checks_refuse_bad_values(key, value, want):
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_gguf_kv(_tiny_kv(**{key: value}))
    msg = str(err.value)
    assert msg.startswith(f"{key} = "), msg
    assert want in msg, msg
    assert "; " in msg and ("re-convert" in msg or "remove the key" in msg), msg  # what to do
    assert "\n" not in msg


def test_metadata_check_message_in_full():
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_gguf_kv(_tiny_kv(**{"tokenizer.ggml.bos_token_id": 7}))
    assert str(err.value) == (
        "tokenizer.ggml.bos_token_id = 7 (int): a special-token id must be one integer in [0, 5) "
        "(the vocabulary size); remove the key or set it to the right token, or re-convert the "
        "model"
    )
    long_token = "x" * 100
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_gguf_kv(_tiny_kv(**{"tokenizer.ggml.tokens": [long_token, 1, 2, 3, 4]}))
    msg = str(err.value)
    assert long_token not in msg and "'xxx" in msg and "..." in msg  # values are cut short
    assert "(list of 5)" in msg and "item 1 is 1 (int)" in msg


def _synthetic_text(n_bytes: int, seed: int = 0) -> str:
    """Prose-like text mixing real words, made-up words (cold BPE cache), digits and unicode."""
    rng = random.Random(seed)
    words = fx.GENESIS.split() + ["naïve", "你好", "🙂", "2024", "it's", "x=1;", "\n\n", "\t"]
    syllables = ["ka", "lo", "mi", "tra", "ble", "qu", "ion", "é", "ö", "ж", "中", "zz", "ph"]
    out: list[str] = []
    size = 0
    while size < n_bytes:
        if rng.random() < 0.5:
            w = rng.choice(words)
        else:
            w = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 5)))
        if rng.random() < 0.2:
            w = w.upper()
        if rng.random() < 0.1:
            w += str(rng.randint(0, 99999))
        out.append(w)
        size += len(w.encode()) + 1
    return " ".join(out)


@needs_llama
def test_smollm_long_text_matches_llama_cpp(smollm, smollm_oracle):
    text = _synthetic_text(20_000, seed=2)
    ids = smollm.encode(text)
    assert ids == smollm_oracle.tokenize(text)
    assert smollm.decode(ids) == text


def test_encode_speed(smollm_kv):
    tok = Tokenizer.from_gguf_kv(smollm_kv)  # cold word cache
    text = _synthetic_text(20_000)
    t0 = time.perf_counter()
    ids = tok.encode(text)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok.encode(text)
    warm = time.perf_counter() - t0
    log.info(
        "encode 20 KB: %.1f ms cold, %.1f ms warm, %d tokens", cold * 1e3, warm * 1e3, len(ids)
    )
    assert tok.decode(ids) == text
    assert cold < 2.0


def test_encode_speed_spm(spm_kv):
    tok = Tokenizer.from_gguf_kv(spm_kv)
    text = _synthetic_text(20_000, seed=1)
    t0 = time.perf_counter()
    ids = tok.encode(text)
    dt = time.perf_counter() - t0
    log.info("SPM encode 20 KB: %.1f ms, %d tokens", dt * 1e3, len(ids))
    assert dt < 2.0
