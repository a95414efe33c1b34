"""Grammars and their per-request state, over llguidance (the ``structured`` extra).

:func:`compile_grammar` turns a JSON schema, llama.cpp's GBNF or a Lark grammar into a checked
:class:`Grammar`; each request then takes its own :class:`Constraint`, which masks the logits of
every step to the tokens the grammar allows and follows the sampled tokens. The scheduler calls
a constraint on its worker thread, so slots never share grammar state.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from powerpy.structured.vocab import tokenizer_for
from powerpy.tokenizer import Tokenizer

log = logging.getLogger(__name__)

KINDS = ("json_schema", "gbnf", "lark", "regex")
INSTALL = "structured output needs llguidance: pip install 'powerpy[structured]'"
JSON_DEFAULTS = {"whitespace_flexible": False}  # compact JSON, as the model's own output


class GrammarError(ValueError):
    """A grammar or schema that the engine cannot compile (the message names the problem)."""


def _llguidance():
    try:
        import llguidance
        import llguidance.torch  # noqa: F401  (the mask helpers)
    except ImportError:
        raise GrammarError(INSTALL) from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar over one tokenizer; :meth:`constraint` starts a request's state."""

    definition: str  # llguidance's grammar JSON
    tokenizer: Any  # llguidance.LLTokenizer
    n_vocab: int

    def constraint(self) -> Constraint:
        return Constraint(self)


def definition(kind: str, spec: str | dict | bool) -> str:
    """llguidance's grammar of a ``kind`` (one of ``KINDS``) and its text or schema.

    Raises:
        GrammarError: an unknown kind or a spec the converter rejects.
    """
    ll = _llguidance()
    try:
        if kind == "json_schema":
            text = spec if isinstance(spec, str) else json.dumps(spec)
            return ll.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
        if kind == "gbnf":
            return ll.grammar_from("gbnf", str(spec))
        if kind == "lark":
            return ll.LLMatcher.grammar_from_lark(str(spec))
        if kind == "regex":
            return ll.LLMatcher.grammar_from_regex(str(spec))
    except (ValueError, TypeError, RuntimeError) as e:
        raise GrammarError(f"invalid {kind}: {e}") from None
    raise GrammarError(f"unknown grammar kind {kind!r}: one of {KINDS}")


def compile_grammar(tok: Tokenizer, kind: str, spec: str | dict | bool, n_vocab: int) -> Grammar:
    """Compile and check a grammar for the model of ``tok`` (``n_vocab`` logits per step).

    Raises:
        GrammarError: the grammar or schema is malformed or uses what the engine does not
            support; the message is the engine's.
    """
    ll = _llguidance()
    grammar = definition(kind, spec)
    tokenizer = tokenizer_for(tok)
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(f"invalid {kind}: {'; '.join(messages) or 'rejected'}")
    for m in messages:
        log.debug("grammar warning: %s", m)
    return Grammar(grammar, tokenizer, n_vocab)


def unpack(bitmask: Tensor, n: int) -> Tensor:
    """The first ``n`` bits of an int32 bitmask (bit i of word w is token 32 w + i) as bools.

    (llguidance's own helper is a ``torch.compile`` kernel, which compiles for seconds on its
    first call on a CPU.)"""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:n]
    return torch.from_numpy(bits.view(np.bool_))


class Constraint:
    """One request's grammar state: masks logits, follows sampled tokens."""

    def __init__(self, grammar: Grammar) -> None:
        ll = _llguidance()
        self.matcher = ll.LLMatcher(grammar.tokenizer, grammar.definition)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.mask = ll.torch.allocate_token_bitmask(1, grammar.n_vocab)
        self.n_vocab = grammar.n_vocab
        self._ll = ll

    def apply(self, logits: Tensor) -> Tensor:
        """``logits`` (n_vocab,) with the tokens the grammar forbids set to -inf (a copy).

        Raises:
            RuntimeError: the grammar reached an error state.
        """
        self._ll.torch.fill_next_token_bitmask(self.matcher, self.mask, 0)
        if self.matcher.is_error():
            raise RuntimeError(f"grammar: {self.matcher.get_error()}")
        allowed = unpack(self.mask[0], self.n_vocab)
        if not bool(allowed.any()):
            raise RuntimeError("grammar: no token is allowed")
        return logits.float().masked_fill(~allowed[: logits.shape[-1]], -float("inf"))

    def accept(self, token: int) -> None:
        """Follow a sampled token.

        Raises:
            RuntimeError: the token breaks the grammar.
        """
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"grammar: token {token} rejected: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but end-of-generation may follow."""
        return self.matcher.is_stopped()


@dataclass(frozen=True)
class LazyGrammar:
    """A grammar that starts after a ``trigger`` token (a tool call's opening token): the
    model writes freely until it emits the trigger, then the grammar holds it."""

    trigger: int
    grammar: Grammar

    def constraint(self) -> LazyConstraint:
        return LazyConstraint(self)


class LazyConstraint:
    """One request's state of a :class:`LazyGrammar`."""

    def __init__(self, lazy: LazyGrammar) -> None:
        self.lazy = lazy
        self.inner: Constraint | None = None

    def apply(self, logits: Tensor) -> Tensor:
        return logits if self.inner is None else self.inner.apply(logits)

    def accept(self, token: int) -> None:
        if self.inner is not None:
            self.inner.accept(token)
        elif token == self.lazy.trigger:
            self.inner = self.lazy.grammar.constraint()

    @property
    def finished(self) -> bool:
        return self.inner is not None and self.inner.finished
