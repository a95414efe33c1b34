"""Pre-tokenizers of byte-level BPE vocabularies, selected by ``tokenizer.ggml.pre``.

A pre-tokenizer splits text into words before merging: a sequence of llama.cpp's regexes, each
splitting the pieces the previous one left (matches and the gaps between them). The regexes are
llama.cpp's, translated for Python's ``re`` (see :func:`compile_split`); the table of names maps
each ``tokenizer.ggml.pre`` value to its regexes and to the per-vocabulary flags llama.cpp sets
with it (space clean-up on decode, ``ignore_merges``, the BOS default).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from powerpy.tokenizer.unicode import UCAT_CLASS, UCAT_RE, collapse, widen

__all__ = [
    "PRE_TYPES",
    "PreSpec",
    "Split",
    "compile_split",
    "pretokenize",
    "splits_for",
    "supported_pre_tokenizers",
]


@dataclass(frozen=True)
class Split:
    """One compiled pre-tokenizer regex."""

    pattern: re.Pattern[str]
    collapsed: bool  # run on the collapsed text (pattern uses \p{..}) or on the widened text


def compile_split(expr: str) -> Split:
    """Translate one of llama.cpp's pre-tokenizer regexes into a Python pattern.

    ``\\p{X}`` becomes a character class over the category placeholder plus the ASCII members of
    the category, inside or outside brackets, as llama.cpp does for its std::regex fallback.

    Args:
        expr: the regex as llama.cpp writes it.

    Returns:
        The compiled pattern and which text representation it must run on.
    """
    if not UCAT_RE.search(expr):
        return Split(re.compile(expr, re.ASCII), collapsed=False)
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside = True
            out.append(c)
            i += 1
            continue
        if inside and c == "]" and expr[i - 1] != "\\":
            inside = False
            out.append(c)
            i += 1
            continue
        m = UCAT_RE.match(expr, i)
        if m:
            cls = UCAT_CLASS[m.group(1)]
            out.append(cls if inside else f"[{cls}]")
            i = m.end()
            continue
        out.append(c)
        i += 1
    return Split(re.compile("".join(out), re.ASCII), collapsed=True)


# --- pre-tokenizers (regexes are llama.cpp's, per tokenizer.ggml.pre) -----------------------------
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# llama.cpp's custom GPT-2 splitter implements this regex including the final "|\s+".
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_RE_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + r"|\s+(?!\S)|\s+"
)
_RE_JAIS2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)"
    + r"|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
_RE_GPT4O_WORDS = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    + _CONTRACTIONS
    + r"?"
)
_RE_GPT4O = _RE_GPT4O_WORDS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_RE_GRANITE_EMB = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*"
    + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
_RE_SEED_CODER = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_RE_EXAONE_MOE = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
    + r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
_RE_MINICPM5 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek's (V1/V2 LLM, Coder, V3): letters of the scripts with case as one literal class, CJK
# runs, then digits; the ranges are llama.cpp's (``$`` is ``\Z``: Python's also matches before
# a final newline)
_DEEPSEEK_CASED = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a"
    "\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
    "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_RE_DEEPSEEK3 = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_RE_GPT2,),
    "starcoder": (r"\p{N}", _RE_GPT2),
    "llama3": (_RE_LLAMA3,),
    "qwen2": (_RE_QWEN2,),
    "qwen35": (_RE_QWEN35,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _RE_GPT2, r"[0-9][0-9][0-9]"),
    "jais2": (_RE_JAIS2,),
    "gpt4o": (_RE_GPT4O,),
    "granite-emb": (_RE_GRANITE_EMB,),
    "tekken": (_RE_TEKKEN,),
    "bailingmoe": (_RE_BAILINGMOE,),
    "seed-coder": (_RE_SEED_CODER,),
    "ufakzeka": (_RE_UFAKZEKA,),
    "exaone-moe": (_RE_EXAONE_MOE,),
    "minicpm5": (r"\p{N}{1,3}", _RE_MINICPM5),
    "laguna": (r"[^\n]+|[\n]+", _RE_QWEN2),
    "deepseek-llm": (
        r"[\r\n]",
        f"\\s?[{_DEEPSEEK_CASED}]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+\Z",
        _DEEPSEEK_CJK,
        r"\p{N}+",
    ),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}"),
    "deepseek-v3": (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _RE_DEEPSEEK3),
    "chameleon": (
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _RE_GPT2,
    ),
}


@dataclass(frozen=True)
class PreSpec:
    """What one ``tokenizer.ggml.pre`` value selects."""

    split: str  # key of SPLITS
    clean_spaces: bool = True  # llama.cpp's clean_up_tokenization_spaces on decode
    ignore_merges: bool = False  # a word that is a token is not merged
    add_bos: bool = False  # default of tokenizer.ggml.add_bos_token
    no_bos: bool = False  # no default BOS id


def _pre_table() -> dict[str, PreSpec]:
    table: dict[str, PreSpec] = {}

    def put(names: str, spec: PreSpec) -> None:
        for n in names.split():
            table[n] = spec

    put("default", PreSpec("default"))
    put(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        PreSpec("llama3", ignore_merges=True, add_bos=True),
    )
    put("falcon", PreSpec("falcon"))
    put(
        "mpt gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert"
        " jina-v1-en jina-v2-code roberta-bpe olmo jais exaone4",
        PreSpec("gpt2"),
    )
    put("trillion granite-docling", PreSpec("gpt2", clean_spaces=False))
    put("starcoder refact codeshell exaone minerva-7b mellum2", PreSpec("starcoder"))
    put("command-r smollm", PreSpec("starcoder", clean_spaces=False))
    put(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open grok-2",
        PreSpec("qwen2", clean_spaces=False),
    )
    put("stablelm2 megrez", PreSpec("qwen2"))
    put("qwen35", PreSpec("qwen35", clean_spaces=False))
    put("dbrx smaug-bpe", PreSpec("llama3"))
    put("chatglm-bpe", PreSpec("llama3", no_bos=True))
    put("glm4 glm5", PreSpec("llama3", no_bos=True, ignore_merges=True))
    put("jais-2", PreSpec("jais2"))
    put("gpt-4o llama4 kanana2 talkie minimax-m2", PreSpec("gpt4o", clean_spaces=False))
    put(
        "granite-embed-multi-97m",
        PreSpec("granite-emb", clean_spaces=False, ignore_merges=True),
    )
    put("tekken", PreSpec("tekken", clean_spaces=False, ignore_merges=True, add_bos=True))
    put("bailingmoe bailingmoe2 llada-moe", PreSpec("bailingmoe", clean_spaces=False))
    put("seed-coder", PreSpec("seed-coder", clean_spaces=False))
    put("ufakzeka", PreSpec("ufakzeka", clean_spaces=False))
    put("exaone-moe", PreSpec("exaone-moe"))
    put("minicpm5", PreSpec("minicpm5", ignore_merges=True))
    put("laguna", PreSpec("laguna", clean_spaces=False))
    put("chameleon", PreSpec("chameleon", clean_spaces=False, add_bos=True))
    put("deepseek-llm", PreSpec("deepseek-llm", clean_spaces=False))
    put("deepseek-coder", PreSpec("deepseek-coder", clean_spaces=False))
    put("deepseek-v3 hunyuan-dense joyai-llm", PreSpec("deepseek-v3", clean_spaces=False))
    return table


PRE_TYPES = _pre_table()
_COMPILED_SPLITS: dict[str, tuple[Split, ...]] = {}


def splits_for(name: str) -> tuple[Split, ...]:
    """The compiled regexes of ``SPLITS[name]`` (``PreSpec.split``), compiled on first use."""
    if name not in _COMPILED_SPLITS:
        _COMPILED_SPLITS[name] = tuple(compile_split(e) for e in SPLITS[name])
    return _COMPILED_SPLITS[name]


def supported_pre_tokenizers() -> list[str]:
    """Names of ``tokenizer.ggml.pre`` values this module implements.

    Returns:
        Sorted pre-tokenizer names.
    """
    return sorted(PRE_TYPES)


def pretokenize(text: str, splits: tuple[Split, ...]) -> list[str]:
    """Split a text fragment into BPE words with the pre-tokenizer regexes.

    Args:
        text: one fragment (special tokens already cut out).
        splits: the regexes, from :func:`splits_for`.

    Returns:
        The words, in order; their concatenation is ``text``.
    """
    spans = [(0, len(text))]
    collapsed: str | None = None
    widened: str | None = None
    for split in splits:
        if split.collapsed:
            if collapsed is None:
                collapsed = collapse(text)
            subject = collapsed
        else:
            if widened is None:
                widened = widen(text)
            subject = widened
        finditer = split.pattern.finditer
        new: list[tuple[int, int]] = []
        for a, b in spans:
            pos = a
            for m in finditer(subject, a, b):
                s, e = m.span()
                if s > pos:
                    new.append((pos, s))
                if e > s:
                    new.append((s, e))
                pos = e
            if pos < b:
                new.append((pos, b))
        spans = new
    return [text[a:b] for a, b in spans]
