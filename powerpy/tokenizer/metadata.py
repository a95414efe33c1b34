"""Reading the ``tokenizer.*`` GGUF metadata into ``Tokenizer`` arguments."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from powerpy.errors import TokenizerError
from powerpy.formats.constants import Keys
from powerpy.tokenizer.specials import ROLE_KEYS

__all__ = ["as_list", "as_str", "tokenizer_args"]


def as_str(v: Any) -> str:
    """A metadata string (``bytes`` are decoded as UTF-8, invalid bytes replaced)."""
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).decode("utf-8", errors="replace")
    return str(v)


def as_list(v: Any) -> list[Any]:
    """A metadata array (list, tuple or numpy array) as a list of Python values."""
    tolist = getattr(v, "tolist", None)
    return list(tolist()) if tolist is not None else list(v)


_SHOW_ITEMS = 3
_SHOW_CHARS = 40
_FIX = "re-convert the model, or fix the key (gguf-py's gguf_new_metadata.py)"


def _short(x: Any) -> str:
    r = repr(x.item() if isinstance(x, np.generic) else x)
    return r if len(r) <= _SHOW_CHARS else r[: _SHOW_CHARS - 3] + "..."


def _show_item(x: Any) -> str:
    return f"{_short(x)} ({type(x).__name__})"


def _show(v: Any) -> str:
    """A short description of a metadata value for error messages."""
    if isinstance(v, (list, tuple)) or getattr(v, "ndim", 0):
        items = as_list(v)
        head = ", ".join(_short(x) for x in items[:_SHOW_ITEMS])
        more = ", ..." if len(items) > _SHOW_ITEMS else ""
        return f"[{head}{more}] ({type(v).__name__} of {len(items)})"
    return _show_item(v)


def _bad(key: str, value: Any, need: str, fix: str = _FIX) -> TokenizerError:
    return TokenizerError(f"{key} = {_show(value)}: {need}; {fix}")


def _is_int(x: Any) -> bool:
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _is_number(x: Any) -> bool:
    return type(x) is float or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def _is_text(x: Any) -> bool:
    return type(x) is str or isinstance(x, (str, bytes))


def _array(
    kv: Mapping[str, Any], key: str, what: str, ok: Callable[[Any], bool], n: int | None
) -> list[Any]:
    """``kv[key]`` as a list whose items all pass ``ok`` (and, given ``n``, of length ``n``)."""
    v = kv[key]
    need = f"must be an array of {what}" + ("" if n is None else f", one per token ({n})")
    if isinstance(v, (str, bytes, bytearray, Mapping)) or not (
        isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) == 1
    ):
        raise _bad(key, v, need)
    items = as_list(v)
    if n is not None and len(items) != n:
        raise _bad(key, v, need)
    bad = next((i for i, x in enumerate(items) if not ok(x)), None)
    if bad is not None:
        raise _bad(key, v, f"{need}, but item {bad} is {_show_item(items[bad])}")
    return items


def _one(v: Any) -> Any:
    """A scalar, or the item of a one-item array (``None`` when it is not one of those)."""
    if isinstance(v, (list, tuple)) or getattr(v, "ndim", 0):
        items = as_list(v)
        return items[0] if len(items) == 1 else None
    return v


def _token_id(kv: Mapping[str, Any], key: str, n: int) -> int:
    v = kv[key]
    x = _one(v)
    if x is None or not _is_int(x) or not 0 <= int(x) < n:
        raise _bad(
            key,
            v,
            f"a special-token id must be one integer in [0, {n}) (the vocabulary size)",
            "remove the key or set it to the right token, or re-convert the model",
        )
    return int(x)


def _flag(kv: Mapping[str, Any], key: str) -> bool:
    v = kv[key]
    x = _one(v)
    if not isinstance(x, (bool, np.bool_)):
        raise _bad(key, v, "must be a boolean", "store it as a GGUF BOOL, or remove the key")
    return bool(x)


def tokenizer_args(kv: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``Tokenizer(...)`` read and checked from GGUF metadata.

    Args:
        kv: metadata mapping as produced by ``powerpy.formats.gguf_reader.read_gguf(path).kv``:
            strings as ``str`` (``bytes`` accepted), arrays as lists or numpy arrays.

    Returns:
        The arguments.

    Raises:
        TokenizerError: the metadata has no tokenizer, or a ``tokenizer.ggml.*`` value has the
            wrong type or length, or a special-token id is outside the vocabulary.
    """
    if Keys.TOKENIZER_MODEL not in kv or Keys.TOKENS not in kv:
        raise TokenizerError(
            "GGUF metadata has no tokenizer (tokenizer.ggml.model / tokens); "
            "use a model file converted with its vocabulary"
        )

    def has(key: str) -> bool:
        return key in kv and kv[key] is not None

    tokens = _array(kv, Keys.TOKENS, "strings", _is_text, None)
    n = len(tokens)
    if n == 0:
        raise _bad(Keys.TOKENS, kv[Keys.TOKENS], "the vocabulary is empty")

    special: dict[str, int] = {}
    # deprecated aliases are read after the new keys, so they win when both exist (as in
    # llama.cpp, which reads them last)
    aliases = (
        ("fim_pre", Keys.PREFIX_ID),
        ("fim_suf", Keys.SUFFIX_ID),
        ("fim_mid", Keys.MIDDLE_ID),
    )
    for role, key in [*ROLE_KEYS.items(), *aliases]:
        if has(key):
            special[role] = _token_id(kv, key, n)

    def opt(key: str, read: Callable[[str], Any]) -> Any:
        return read(key) if has(key) else None

    return {
        "model": as_str(kv[Keys.TOKENIZER_MODEL]),
        "tokens": [as_str(t) for t in tokens],
        "token_types": opt(Keys.TOKEN_TYPE, lambda k: _array(kv, k, "integers", _is_int, n)),
        "scores": opt(Keys.SCORES, lambda k: _array(kv, k, "numbers", _is_number, n)),
        "merges": opt(Keys.MERGES, lambda k: _array(kv, k, "strings", _is_text, None)),
        "pre": opt(Keys.TOKENIZER_PRE, lambda k: as_str(kv[k])),
        "special_ids": special,
        "add_bos": opt(Keys.ADD_BOS, lambda k: _flag(kv, k)),
        "add_eos": opt(Keys.ADD_EOS, lambda k: _flag(kv, k)),
        "add_space_prefix": opt(Keys.ADD_SPACE_PREFIX, lambda k: _flag(kv, k)),
        "model_name": opt(Keys.NAME, lambda k: as_str(kv[k])) or "",
        "chat_template": opt(Keys.CHAT_TEMPLATE, lambda k: as_str(kv[k])),
    }
