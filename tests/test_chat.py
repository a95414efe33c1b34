"""Chat templates: rendering vs llama.cpp, BOS handling, errors, chat() and infer -cnv."""

from __future__ import annotations

import ctypes
import io

import pytest

import powerpy
from powerpy.chat import CHATML, render_chat
from powerpy.cli import main
from powerpy.testing import TinySpec, write_tiny_model

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Capital of France?\nOne word."},
]


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return powerpy.load(smollm2_path)


def llama_cpp_chat(lc, template: str, messages: list[dict], add_ass: bool) -> str:
    """llama.cpp's built-in (non-Jinja) rendering (lc: the llama_cpp module): it recognises the
    template's family."""
    arr = (lc.llama_chat_message * len(messages))(
        *[
            lc.llama_chat_message(role=m["role"].encode(), content=m["content"].encode())
            for m in messages
        ]
    )
    buf = ctypes.create_string_buffer(1 << 16)
    n = lc.llama_chat_apply_template(template.encode(), arr, len(messages), add_ass, buf, len(buf))
    assert 0 < n < len(buf)
    return buf.raw[:n].decode()


@pytest.mark.parametrize("turns", [2, 3, 4])
@pytest.mark.parametrize("add_ass", [True, False])
def test_smollm2_template_matches_llama_cpp(llama_cpp, smol, turns, add_ass) -> None:
    msgs = CONVERSATION[:turns]
    got = smol.apply_chat_template(msgs, add_generation_prompt=add_ass)
    assert got == llama_cpp_chat(llama_cpp, smol.tokenizer.chat_template, msgs, add_ass)


def test_smollm2_template_adds_its_default_system_turn(smol) -> None:
    got = smol.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert got == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smol.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert ids[0] == smol.tokenizer.bos_id == 1  # <|im_start|> parsed as one control token
    assert ids == smol.tokenizer.encode(got)


def test_chatml_fallback_and_bos_written_once(llama_cpp, tmp_path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, TinySpec(), sparse=False)  # no chat template, SPM adds BOS
    llm = powerpy.load(path)
    assert llm.tokenizer.chat_template is None and llm.tokenizer.add_bos
    text = llm.apply_chat_template(CONVERSATION[:2])
    assert text == render_chat(CHATML, CONVERSATION[:2])
    assert text == llama_cpp_chat(llama_cpp, "chatml", CONVERSATION[:2], True)
    ids = llm.apply_chat_template(CONVERSATION[:2], tokenize=True)
    assert ids[0] == llm.tokenizer.bos_id and ids[1] != llm.tokenizer.bos_id
    llm.tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    ids = llm.apply_chat_template(CONVERSATION[:2], tokenize=True)
    assert ids[0] == llm.tokenizer.bos_id and ids[1] != llm.tokenizer.bos_id  # not twice


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "non-empty list"),
        ([], "non-empty list"),
        (["hello"], "message 0 is a str"),
        ([{"role": "user"}], "message 0 needs a string 'content'"),
        ([{"role": "user", "content": "a"}, {"role": 1, "content": "b"}], "message 1 needs"),
    ],
)
def test_bad_messages_are_clear_errors(messages, match) -> None:
    with pytest.raises(ValueError, match=match):
        render_chat(None, messages)


@pytest.mark.parametrize(
    "template, match",
    [
        (
            "{{ raise_exception('roles must alternate') }}",
            "m.gguf: chat template failed: roles must",
        ),
        ("{% for m in messages %}", "m.gguf: chat template failed"),  # does not compile
        ("{{ messages.__class__.__mro__ }}", "m.gguf: chat template failed"),  # sandboxed
    ],
)
def test_template_errors_name_the_model(template, match) -> None:
    with pytest.raises(ValueError, match=match):
        render_chat(template, CONVERSATION[:2], source="m.gguf")


def test_chat_replies_and_stops_at_end_of_turn(smollm2_path) -> None:
    """f32 activations: with llama.cpp's Q8_1 rounding this Q4_1 model answers "L'Étoile, la
    Cité, ..." (llama.cpp too)."""
    smol = powerpy.load(smollm2_path, exact_activations=True)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    responses = list(smol.stream_chat(msgs, 48, temperature=0))
    text = "".join(r.text for r in responses)
    assert "Paris" in text and "<|im_end|>" not in text
    assert responses[-1].finish_reason == "stop" and responses[-1].token == 2  # <|im_end|>
    assert smol.chat(msgs, 48, temperature=0) == text


def test_cli_conversation_keeps_history(smollm2_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("\nAnd the capital of Germany?\n"))
    args = ["infer", "-m", str(smollm2_path), "-cnv", "-sys", "Answer in one sentence."]
    args += ["-p", "What is the capital of France?", "-n", "32", "--temp", "0", "-t", "1"]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "Paris" in lines[0] and "Berlin" in lines[1]


def test_chat_session_reuses_the_cache_and_matches_a_fresh_prefill(smol) -> None:
    chat = smol.chat_session(system="Answer in one sentence.", n_ctx=512)
    first = list(chat.send("What is the capital of France?", 32, temperature=0))
    assert first[0].prompt_tokens == len(smol.apply_chat_template(chat.messages[:2], tokenize=True))
    second = list(chat.send("And the capital of Germany?", 32, temperature=0))
    full = smol.apply_chat_template(chat.messages[:4], tokenize=True)
    assert second[0].prompt_tokens < len(full) - len(first)  # only the new turn ran
    fresh = smol.chat(chat.messages[:4], 32, temperature=0)
    assert "".join(r.text for r in second) == fresh and "Berlin" in fresh
    assert [m["role"] for m in chat.messages] == ["system"] + ["user", "assistant"] * 2


def test_chat_session_overflow_is_a_clear_error_and_keeps_history(smol) -> None:
    chat = smol.chat_session(n_ctx=64)
    list(chat.send("Hi", 4, temperature=0))
    before = list(chat.messages)
    with pytest.raises(ValueError, match=r"conversation is \d+ tokens and the context holds 64"):
        list(chat.send("word " * 80, 4))
    assert chat.messages == before


def test_chat_session_failed_turn_leaves_no_trace(smol, monkeypatch) -> None:
    chat = smol.chat_session(n_ctx=128)
    list(chat.send("Hi", 4, temperature=0))
    before = list(chat.messages)

    def boom(*a, **k):
        raise RuntimeError("interrupted during prefill")
        yield

    monkeypatch.setattr("powerpy.chat.stream_generate", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        list(chat.send("Hello again", 4))
    assert chat.messages == before and chat._cached == []
    monkeypatch.undo()
    assert "".join(r.text for r in chat.send("Hello again", 4, temperature=0))  # recovers
