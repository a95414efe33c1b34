"""Each family's chat template and end-of-turn token, through ``LLM.chat``, ``infer -cnv`` and
``powerpy serve``: tiny models whose vocabularies hold the family's special tokens and whose
``tokenizer.chat_template`` is the family's own (Qwen2.5's ChatML with its default system turn
and tools branch, Gemma 3's with the system text folded into the first user turn, Phi-3's).

The rendered prompts equal llama.cpp's built-in rendering of the same family, and their tokens
llama.cpp's (its vocabulary alone is loaded: ``vocab_only``). The end of generation is never
the file's ``eos_token_id`` here (``<|endoftext|>``, ``<eos>``): it is the end-of-turn token
llama.cpp recognises by its text (``<|im_end|>``, ``<end_of_turn>``, ``<|end|>``). The weights
make greedy decoding answer "OK" and then that token: the layers are small against the
embeddings, and ``output`` favours the successor of the current token in the chain (last token
of the generation prompt) -> "O" -> "K" -> end of turn.
"""

from __future__ import annotations

import datetime
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from oracle_fixtures import PROMPT, bpe_vocab
from serve_harness import ServerProcess
from test_chat import llama_cpp_chat

import powerpy
from powerpy.chat import encode_chat
from powerpy.cli import main
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys, Names, TokenType
from powerpy.formats.gguf_writer import write_gguf
from powerpy.testing import TinySpec, spec_args, tiny_tensors
from powerpy.tokenizer import Tokenizer

QWEN25 = (  # Qwen2.5-Instruct's template, as its GGUFs carry it
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == "
    "'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are "
    "Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n    {{- "
    '"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- '
    'endfor %}\n    {{- "\\n</tools>\\n\\nFor each function call, return a json object with '
    'function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"'
    'name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" '
    "}}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>"
    "system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|"
    "im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|"
    "im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if "
    '(message.role == "user") or (message.role == "system" and not loop.first) or (message.role'
    " == \"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + message.role"
    " + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == "
    "\"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n        {%- if message."
    "content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n        {%- "
    "for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}"
    "\n                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n    "
    '        {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n     '
    '       {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n    '
    "        {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n        {%- if (loop.index0 == 0) or (messages['
    "loop.index0 - 1].role != \"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- "
    "endif %}\n        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n        "
    "{{- '\\n</tool_response>' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role "
    "!= \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}"
    "\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
GEMMA3 = (  # Gemma 3's (text only)
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- set first_user_prefix"
    " = messages[0]['content'] + '\\n\\n' -%}\n    {%- set loop_messages = messages[1:] -%}\n"
    '{%- else -%}\n    {%- set first_user_prefix = "" -%}\n    {%- set loop_messages = '
    "messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n    {%- if (message["
    "'role'] == 'user') != (loop.index0 % 2 == 0) -%}\n        {{ raise_exception(\"Conversation"
    ' roles must alternate user/assistant/user/assistant/...") }}\n    {%- endif -%}\n    {%- '
    "if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n    {%- else"
    " -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n    {{ '<start_of_turn"
    ">' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n    {%- if message["
    "'content'] is string -%}\n        {{ message['content'] | trim }}\n    {%- elif message["
    "'content'] is iterable -%}\n        {%- for item in message['content'] -%}\n            "
    "{%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n            "
    "{%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n          "
    "  {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n        {{ raise_exception("
    "\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n{%- "
    "endfor -%}\n{%- if add_generation_prompt "
    "-%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n"
)
PHI3 = (  # Phi-3-mini-instruct's
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + "
    "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + "
    "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>"
    "\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
HARMONY = (  # GPT-OSS's harmony format, as its GGUFs' template renders a plain conversation
    '{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.'
    '\\nKnowledge cutoff: 2024-06\\nCurrent date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}\n'
    "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}\n"
    '{{- "Reasoning: " + reasoning_effort + "\\n\\n# Valid channels: analysis, commentary, final.'
    ' Channel must be included for every message.<|end|>" }}\n'
    '{%- if messages[0].role == "developer" or messages[0].role == "system" %}\n'
    '    {{- "<|start|>developer<|message|># Instructions\\n\\n" + messages[0].content + '
    '"\\n\\n<|end|>" }}\n    {%- set loop_messages = messages[1:] %}\n'
    "{%- else %}\n    {%- set loop_messages = messages %}\n{%- endif %}\n"
    "{%- for message in loop_messages -%}\n    {%- if message.role == 'assistant' -%}\n"
    '        {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}'
    "\n    {%- elif message.role == 'user' -%}\n"
    '        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}\n    {%- endif -%}\n'
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n<|start|>assistant\n{%- endif -%}"
)
SPM_BYTES = [f"<0x{b:02X}>" for b in range(256)]


@dataclass(frozen=True)
class ChatFamily:
    """A family's tokenizer and template: ``specials`` (control tokens) first, then the byte
    tokens (SPM byte fallback, or a byte-level BPE learned from the oracle's prompt)."""

    arch: str
    template: str
    specials: tuple[str, ...]
    eos: str
    eot: str
    bos: str | None = None
    name: str = "tiny"
    bpe: bool = False
    extra: dict = field(default_factory=dict)  # more tokenizer keys: {key: (value, type)}
    spec: dict = field(default_factory=dict)  # the model's shape beyond the dense default
    builtin: bool = True  # llama.cpp's built-in rendering of the family is the template's

    def vocab_kv(self) -> dict:
        s, u32 = GGUFValueType.STRING, GGUFValueType.UINT32
        if self.bpe:
            v = bpe_vocab(PROMPT, 32, specials=self.specials)
            tokens, types = v["tokens"], v["types"]
            kv = {
                Keys.TOKENIZER_MODEL: ("gpt2", s),
                Keys.TOKENIZER_PRE: ("qwen2", s),
                Keys.MERGES: (v["merges"], GGUFValueType.ARRAY),
            }
        else:
            tokens = [*self.specials, *SPM_BYTES]
            types = [TokenType.CONTROL] * len(self.specials) + [TokenType.BYTE] * 256
            kv = {
                Keys.TOKENIZER_MODEL: ("llama", s),
                Keys.SCORES: (np.zeros(len(tokens), np.float32), GGUFValueType.ARRAY),
            }
        ids = {t: i for i, t in enumerate(tokens)}
        kv |= {
            Keys.TOKENS: (tokens, GGUFValueType.ARRAY),
            Keys.TOKEN_TYPE: (np.array(types, np.int32), GGUFValueType.ARRAY),
            Keys.EOS_ID: (ids[self.eos], u32),
            Keys.ADD_BOS: (self.bos is not None, GGUFValueType.BOOL),
            Keys.CHAT_TEMPLATE: (self.template, s),
            Keys.NAME: (self.name, s),
            **self.extra,
        }
        if self.bos is not None:
            kv[Keys.BOS_ID] = (ids[self.bos], u32)
        return kv


FAMILIES = {
    "qwen2": ChatFamily(
        "qwen2",
        QWEN25,
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        eos="<|endoftext|>",
        eot="<|im_end|>",
        bpe=True,
    ),
    "gemma3": ChatFamily(
        "gemma3",
        GEMMA3,
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        eos="<eos>",
        eot="<end_of_turn>",
        bos="<bos>",
        extra={Keys.ADD_SPACE_PREFIX: (False, GGUFValueType.BOOL)},
    ),
    "phi3": ChatFamily(
        "phi3",
        PHI3,
        (
            "<unk>",
            "<s>",
            "</s>",
            "<|endoftext|>",
            "<|assistant|>",
            "<|end|>",
            "<|system|>",
            "<|user|>",
        ),
        eos="<|endoftext|>",
        eot="<|end|>",
        bos="<s>",
        name="Phi-3-mini-tiny",
    ),
    # harmony: the turn ends at <|return|> (or <|call|>); <|end|> closes a message, not the
    # generation; llama.cpp's built-in rendering writes no system header
    "gpt-oss": ChatFamily(
        "gpt-oss",
        HARMONY,
        (
            "<|startoftext|>",
            "<|endoftext|>",
            "<|return|>",
            "<|constrain|>",
            "<|channel|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|call|>",
        ),
        eos="<|endoftext|>",
        eot="<|return|>",
        bpe=True,
        builtin=False,
        extra={Keys.TOKENIZER_PRE: ("gpt-4o", GGUFValueType.STRING)},
        spec=dict(n_expert=4, n_expert_used=2, n_ff_exp=32, sliding_window=16, n_ctx=1024),
    ),
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Capital of France?"},
]
WANT = {  # the prompt of CONVERSATION, as each family's model sees it
    "qwen2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "gemma3": "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model"
    "\nHello!<end_of_turn>\n<start_of_turn>user\nCapital of France?<end_of_turn>\n"
    "<start_of_turn>model\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>"
    "\n<|user|>\nCapital of France?<|end|>\n<|assistant|>\n",
    "gpt-oss": "<|start|>system<|message|>You are ChatGPT, a large language model trained by "
    "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: medium\n\n# Valid "
    "channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|><|start|>user<|message|>"
    "Hi there<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|end|><|start|>user"
    "<|message|>Capital of France?<|end|><|start|>assistant",
}


def write_chat_model(path: Path, fam: ChatFamily, seed: int = 0) -> Path:
    """A dense tiny model of ``fam`` whose greedy reply to any chat prompt is "OK", then the
    family's end-of-turn token (module docstring)."""
    rng = np.random.default_rng(seed)
    spec = TinySpec(
        arch=fam.arch, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, tied=True, **fam.spec
    )
    vocab = fam.vocab_kv()
    tok = Tokenizer.from_gguf_kv({k: v[0] for k, v in vocab.items()})
    start = encode_chat(tok, CONVERSATION[1:2], tokenize=True)[-1]  # the prompt's last token
    ok = [tok.token_id(t) for t in (("O", "K") if fam.bpe else ("<0x4F>", "<0x4B>"))]
    chain = [start, *ok, tok.token_id(fam.eot)]
    assert len(set(chain)) == 4, chain
    n_vocab, d = tok.vocab_size, spec.n_embd
    tensors = {}
    for name, a in tiny_tensors(spec, sparse=False, seed=seed).items():
        tensors[name] = a * 0.02 if a.ndim >= 2 else a  # small layers: x stays ~ its embedding
    emb = rng.standard_normal((n_vocab, d)).astype(np.float32)
    out = 0.1 * rng.standard_normal((n_vocab, d)).astype(np.float32)
    for a, b in zip(chain, chain[1:], strict=False):
        out[b] = 4.0 * emb[a] / np.linalg.norm(emb[a]) * d**0.5
    tensors[Names.TOKEN_EMBD], tensors[Names.OUTPUT] = emb, out
    kv = spec_args(spec, n_vocab, sparse=False).to_gguf_kv() | vocab
    write_gguf(path, kv, [(n, a, GGMLType.F32) for n, a in tensors.items()])
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    fam = FAMILIES[request.param]
    path = write_chat_model(tmp_path_factory.mktemp("chat") / f"{request.param}.gguf", fam)
    return request.param, fam, path


def test_the_template_renders_as_llama_cpp_renders_the_family(family_model, llama_cpp):
    name, fam, path = family_model
    llm = powerpy.load(path)
    text = llm.apply_chat_template(CONVERSATION)
    assert text == WANT[name].replace("{date}", datetime.date.today().strftime("%Y-%m-%d"))
    bos = fam.bos if "bos_token" in fam.template else ""  # llama.cpp's built-ins write no BOS
    if fam.builtin:
        assert text == bos + llama_cpp_chat(llama_cpp, fam.template, CONVERSATION, True)
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        want = ref.tokenize(text.encode(), add_bos=False, special=True)
    finally:
        ref.close()
    assert llm.tokenize(text, add_bos=False) == want
    ids = llm.apply_chat_template(CONVERSATION, tokenize=True)
    assert ids.count(llm.tokenizer.bos_id) == (fam.bos is not None)  # once, template or file
    assert llm.tokenizer.is_eog(llm.tokenizer.token_id(fam.eot))


def test_chat_stops_at_the_families_end_of_turn(family_model):
    _, fam, path = family_model
    llm = powerpy.load(path)
    eot = llm.tokenizer.token_id(fam.eot)
    assert eot != llm.tokenizer.eos_id  # it ends the turn by its text, as in llama.cpp
    for msgs in (CONVERSATION[1:2], CONVERSATION):
        responses = list(llm.stream_chat(msgs, 16, temperature=0))
        assert [r.token for r in responses][-1] == eot
        assert responses[-1].finish_reason == "stop"
        assert "".join(r.text for r in responses) == "OK" == llm.chat(msgs, 16, temperature=0)
    chat = llm.chat_session(system="Be brief.")
    for turn in ("Hi there", "Capital of France?"):
        assert "".join(r.text for r in chat.send(turn, 16, temperature=0)) == "OK"
    assert llm.apply_chat_template(chat.messages[:3]) == llm.apply_chat_template(
        [*CONVERSATION[:2], {"role": "assistant", "content": "OK"}]
    )


def test_infer_conversation_stops_at_end_of_turn(family_model, monkeypatch, capsys):
    _, _, path = family_model
    monkeypatch.setattr("sys.stdin", io.StringIO("Capital of France?\n"))
    args = ["infer", "-m", str(path), "-cnv", "-sys", "Be brief.", "-p", "Hi there"]
    assert main([*args, "-n", "16", "--temp", "0", "-t", "1"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == ["OK", "OK"]


@pytest.mark.slow
def test_serve_chat_stops_at_end_of_turn(tmp_path):
    """One server per family, in turn: the chat endpoint renders the file's template and its
    reply ends at the family's end-of-turn token ("stop", not "length")."""
    for name, fam in FAMILIES.items():
        path = write_chat_model(tmp_path / f"{name}.gguf", fam)
        server = ServerProcess("-m", str(path), "-t", "1", "-np", "1", "--alias", name)
        try:
            r = server.client().chat.completions.create(
                model=name, messages=CONVERSATION, max_tokens=16, temperature=0
            )
            assert r.choices[0].message.content == "OK", (name, r)
            assert r.choices[0].finish_reason == "stop", (name, r)
            assert r.usage.completion_tokens == 3  # O, K and the end of turn
        finally:
            assert server.stop() == 0, server.log
