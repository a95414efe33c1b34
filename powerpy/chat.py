"""Chat prompts: a GGUF file's ``tokenizer.chat_template`` (Jinja) rendered as HF and llama.cpp do.

The template runs in Jinja's immutable sandbox with the variables HF's ``apply_chat_template``
provides (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``raise_exception``, ``strftime_now``). A file without a template gets ChatML, llama.cpp's
fallback.
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from powerpy.generate import Response, stream_generate
from powerpy.model.options import SPARSE, RunOptions
from powerpy.model.transformer import Model
from powerpy.sampling import SamplingParams
from powerpy.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CHATML_NOTED: set[str] = set()

Message = Mapping[str, Any]  # {"role": "system" | "user" | "assistant" | ..., "content": str}


def template_tools(template: str | None) -> str | None:
    """How a chat template writes tool calls: "qwen" (``<tool_call>`` JSON), "other" (it reads
    ``tools`` in another syntax) or None (it knows no tools; ChatML, the fallback, does not)."""
    if not template or "tools" not in template:
        return None
    return "qwen" if "<tool_call>" in template else "other"


def check_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The messages as plain dicts, after checking each has a string role and content.

    Raises:
        ValueError: an empty list, or a message without a string ``role`` or ``content``.
    """
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError('messages must be a non-empty list of {"role": ..., "content": ...}')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} is a {type(m).__name__}, not a dict")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"message {i} needs a string {key!r}, got {m.get(key)!r}")
        out.append(dict(m))
    return out


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        from jinja2 import TemplateError

        raise TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template)


def render_chat(
    template: str | None,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    source: str = "model",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text of a conversation.

    Args:
        template: the Jinja chat template; None uses ChatML.
        messages: ``[{"role": ..., "content": ...}, ...]``.
        add_generation_prompt: end with the assistant's turn header, ready for its reply.
        bos_token, eos_token: texts of the special tokens, for templates that write them.
        source: the model file, for error messages.
        tools: OpenAI-style tool definitions, the template's ``tools`` (HF's convention).

    Raises:
        ValueError: malformed messages, or a template that fails to compile or raises.
    """
    from jinja2 import TemplateError

    msgs = check_messages(messages)
    if template is None:
        if source not in _CHATML_NOTED:  # once per model, not at every turn
            _CHATML_NOTED.add(source)
            log.info("%s has no tokenizer.chat_template: using ChatML", source)
        template = CHATML
    try:
        return _compile(template).render(
            messages=msgs,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **({"tools": list(tools)} if tools else {}),
        )
    except TemplateError as e:
        raise ValueError(f"{source}: chat template failed: {e}") from None


def encode_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    tokenize: bool = False,
    source: str = "model",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str | list[int]:
    """A conversation as the model's chat prompt (its ``tokenizer.chat_template``).

    Args:
        tokenizer: the model's tokenizer (its chat template and special tokens).
        tools: tool definitions for templates that render them.
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
        add_generation_prompt: end with the assistant's turn header.
        tokenize: return token ids (BOS added per the file, unless the template wrote it).
        source: the model file, for error messages.

    Raises:
        ValueError: malformed messages or a failing template.
    """

    def text_of(token_id: int | None) -> str:
        if token_id is None:
            return ""
        return tokenizer.token_to_piece(token_id, special=True).decode("utf-8", "replace")

    bos, eos = text_of(tokenizer.bos_id), text_of(tokenizer.eos_id)
    text = render_chat(
        tokenizer.chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos,
        eos_token=eos,
        source=source,
        tools=tools,
    )
    if not tokenize:
        return text
    add_bos = tokenizer.add_bos and not (bos and text.startswith(bos))
    return tokenizer.encode(text, add_bos=add_bos)


class ChatSession:
    """A conversation that keeps its KV cache between turns, as llama.cpp's chat mode does.

    Each turn renders the whole conversation with the chat template, finds the longest prefix of
    tokens already in the cache, and runs only the rest, so a long conversation is not prefilled
    again at every turn.

    Example::

        chat = llm.chat_session(system="Answer in one sentence.")  # or ChatSession(model, tok)
        for r in chat.send("What is the capital of France?", temperature=0):
            print(r.text, end="")
    """

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        *,
        system: str | None = None,
        n_ctx: int | None = None,
        opts: RunOptions = SPARSE,
        source: str = "model",
    ) -> None:
        """Args: the ``model`` and its ``tokenizer``; ``system`` an optional system message;
        ``n_ctx`` the context size (default: the model's training context, at most 4096);
        ``opts`` the run options; ``source`` the model's file name for messages."""
        self.model, self.tokenizer, self.opts, self.source = model, tokenizer, opts, source
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.cache = model.new_cache(n_ctx)
        self._cached: list[int] = []  # the tokens whose keys and values are in the cache

    def send(self, text: str, max_tokens: int = 256, **sampling: Any) -> Iterator[Response]:
        """Add a user turn and stream the assistant's reply (``Response`` records); the reply
        joins the history when the stream ends. ``sampling``: ``SamplingParams`` fields.

        Raises:
            ValueError: the conversation no longer fits the context.
        """
        self.messages.append({"role": "user", "content": text})
        ids = encode_chat(self.tokenizer, self.messages, tokenize=True, source=self.source)
        if len(ids) >= self.cache.n_ctx:
            self.messages.pop()
            raise ValueError(
                f"the conversation is {len(ids)} tokens and the context holds {self.cache.n_ctx}: "
                "start a new one, or use a larger context (n_ctx, -c)"
            )
        keep = 0  # reuse the cached prefix, but always run at least one token for the logits
        for a, b in zip(self._cached, ids[:-1], strict=False):
            if a != b:
                break
            keep += 1
        self.cache.pos = keep
        budget = min(max_tokens, self.cache.n_ctx - len(ids)) if max_tokens >= 0 else -1
        generated, reply = [], []
        try:
            for r in stream_generate(
                self.model,
                self.tokenizer,
                ids[keep:],
                budget,
                SamplingParams(**sampling),
                cache=self.cache,
                opts=self.opts,
            ):
                generated.append(r.token)
                reply.append(r.text)
                yield r
        finally:
            if generated:  # the last sampled token was never fed back: it is not in the cache
                self._cached = ids + generated[:-1]
                self.messages.append({"role": "assistant", "content": "".join(reply).strip()})
            else:  # failed before the first token: the turn did not happen, the cache is unknown
                self._cached = []
                self.messages.pop()
