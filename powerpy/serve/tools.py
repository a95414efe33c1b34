"""Tool calls on ``/v1/chat/completions``: ``tools`` and ``tool_choice`` checked, rendered through
the model's own chat template, forced by a grammar, and parsed back into OpenAI ``tool_calls``.

Two ways of writing a call:

* ``qwen``: the template reads ``tools`` and writes ``<tool_call>{"name", "arguments"}</tool_call>``
  (Qwen-style templates). With ``tool_choice: "auto"`` the model writes freely; once it emits the
  ``<tool_call>`` token, a grammar holds the rest of the call to the tools' schemas (a lazy
  grammar, as llama-server's trigger tokens).
* ``json``: templates without tool syntax (the default model's): the tools are described in a
  system message and, for ``"required"`` or a named function, the whole reply is a grammar-forced
  ``{"name", "arguments"}`` object. ``"auto"`` there is a 400: the model has no way to call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from powerpy.chat import template_tools
from powerpy.serve.errors import bad_request
from powerpy.tokenizer import Tokenizer

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass
class ToolPlan:
    """How one request handles its tools.

    Attributes:
        style: "qwen" or "json" (see the module's docstring).
        functions: the tools' ``function`` objects, by name.
        forced: the functions a grammar forces a call to (empty: "auto").
        template_tools: what the template gets as ``tools`` (None: described in ``system``).
        system: the system message that describes the tools, for templates without tools.
    """

    style: str
    functions: dict[str, dict[str, Any]]
    forced: list[str] = field(default_factory=list)
    template_tools: list[dict[str, Any]] | None = None
    system: str | None = None

    def call_schema(self, names: list[str]) -> dict[str, Any]:
        """The JSON schema of one call to any of ``names``."""
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": n},
                    "arguments": self.functions[n].get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for n in names
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "x-guidance": {"whitespace_flexible": False}}  # compact, as JSON_DEFAULTS

    def grammar(self, tok: Tokenizer) -> tuple[str, Any] | None:
        """``(kind, spec)`` of the grammar that forces a call (None for "auto")."""
        if not self.forced:
            return None
        schema = json.dumps(self.call_schema(self.forced))
        if self.style == "json":
            return "json_schema", schema
        return "lark", f'start: {lark_text(tok, CALL_OPEN)} "\\n" call "\\n" ' + (
            f"{lark_text(tok, CALL_CLOSE)}\ncall: %json {schema}\n"
        )

    def lazy(self, tok: Tokenizer) -> tuple[int, str] | None:
        """For "auto" on a qwen template: the trigger token and the Lark grammar of what follows
        it (None when ``<tool_call>`` is not one token: the reply is then only parsed)."""
        trigger = tok.token_id(CALL_OPEN)
        if self.forced or self.style != "qwen" or trigger is None:
            return None
        schema = json.dumps(self.call_schema(list(self.functions)))
        return trigger, (
            f'start: "\\n" call "\\n" {lark_text(tok, CALL_CLOSE)}\ncall: %json {schema}\n'
        )


def lark_text(tok: Tokenizer, text: str) -> str:
    """``text`` in a Lark grammar: its special token where it is one, else the quoted text."""
    tid = tok.token_id(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def plan(tools: list[Any] | None, choice: Any, template: str | None) -> ToolPlan | None:
    """Check ``tools`` and ``tool_choice`` against the model's chat template.

    Raises:
        APIError: 400 for malformed tools, an unknown tool_choice or function name, or
            ``"auto"`` on a model whose template has no tool syntax.
    """
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    functions: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                f"tools.{i}: expected {{'type': 'function', 'function': {{...}}}}",
                param=f"tools.{i}",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise bad_request(f"tools.{i}: a function needs a name", param=f"tools.{i}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(
                f"tools.{i}: parameters must be a JSON schema object", param=f"tools.{i}"
            )
        functions[name] = fn
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    if choice == "auto":
        forced = []
    elif choice == "required":
        forced = list(functions)
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise bad_request(
                f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
        forced = [name]
    else:
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    style = template_tools(template)
    if style is None or style == "other":
        if not forced:
            why = "has no tool support" if style is None else "writes tool calls in a syntax "
            why += "" if style is None else "this server does not parse (only <tool_call> JSON)"
            raise bad_request(
                f"tool_choice 'auto': this model's chat template {why}; use tool_choice "
                "'required' or name a function (a grammar then forces the call)",
                param="tool_choice",
            )
        return ToolPlan("json", functions, forced, system=describe(functions, forced))
    return ToolPlan("qwen", functions, forced, template_tools=list(tools))


def describe(functions: dict[str, dict[str, Any]], forced: list[str]) -> str:
    """The system message that tells a model without tool syntax how to call."""
    lines = ["You can call these functions:"]
    for name in forced:
        fn = functions[name]
        params = json.dumps(fn.get("parameters") or {"type": "object"})
        lines.append(f"- {name}: {fn.get('description', '')} Parameters (JSON schema): {params}")
    lines.append('Reply with only a JSON object: {"name": <function>, "arguments": {...}}.')
    return "\n".join(lines)


def parse(text: str, style: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply's content (None when only calls) and its calls as OpenAI ``tool_calls``.
    Text that is not a well-formed call stays content."""
    if style == "json":
        found = [text.strip()]
        rest = ""
    else:
        found = _QWEN_CALL.findall(text)
        rest = _QWEN_CALL.sub("", text).strip()
    calls = []
    for raw in found:
        try:
            obj = json.loads(raw)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": json.dumps(args, ensure_ascii=False),
                },
            }
        )
    if not calls:
        return text, []
    return rest or None, calls


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as HF templates read them: the arguments of earlier tool calls as objects."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                fixed.append({**c, "function": fn})
            m["tool_calls"] = fixed
        out.append(m)
    return out
