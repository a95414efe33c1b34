"""Structured output: constrained sampling by a grammar engine (llguidance, the ``structured``
extra), for JSON schemas, llama.cpp's GBNF grammars and tool calls.

``import powerpy.structured`` stays light: llguidance is imported when a grammar is compiled.
"""

from powerpy.structured.grammar import (
    KINDS,
    Constraint,
    Grammar,
    GrammarError,
    LazyGrammar,
    compile_grammar,
)

__all__ = ["KINDS", "Constraint", "Grammar", "GrammarError", "LazyGrammar", "compile_grammar"]
