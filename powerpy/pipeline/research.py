"""What sparsity does to a loaded model, on a text: its activation statistics, predictors trained
on it, and perplexity against the share of the FFN skipped (``powerpy.plot`` draws the results).

Each function takes a loaded model (``powerpy.load``'s ``LLM``, or anything with its fields:
:class:`Loaded`) and runs with its numerics (``llm.options.numerics``)::

    from powerpy.pipeline import research
    prof = research.profile(llm, text)
    report = research.train_predictors(llm, text, "predictors/")
    sweep = research.sparsity_sweep(llm, heldout, thresholds=[-1, 0, 1])

The command line runs the same pipeline steps (``powerpy profile``, ``powerpy train``,
``powerpy perplexity``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from powerpy.model.options import RunOptions
    from powerpy.model.transformer import Model
    from powerpy.pipeline.profile import ProfileResult
    from powerpy.pipeline.sweep import SweepResult
    from powerpy.pipeline.train_report import TrainReport
    from powerpy.tokenizer import Tokenizer


class Loaded(Protocol):
    """The fields of a loaded model these functions read (``powerpy.api.LLM`` has them)."""

    model: Model
    tokenizer: Tokenizer
    path: Path
    options: RunOptions

    @property
    def name(self) -> str: ...

    def tokenize(self, text: str, *, add_bos: bool | None = None) -> list[int]: ...


def _ids(llm: Loaded, text: str | Sequence[int]) -> list[int]:
    return llm.tokenize(text, add_bos=False) if isinstance(text, str) else list(text)


def profile(
    llm: Loaded,
    text: str | Sequence[int],
    tokens: int | None = 20_000,
    *,
    ctx: int | None = None,
    target_sparsity: float = 0.5,
    progress: bool = True,
) -> ProfileResult:
    """Activation statistics of the model on a text (``pipeline.profile.profile``).

    Args:
        llm: the loaded model.
        text: the text, or its token ids.
        tokens: tokens to run, spread over the text (None: all).
        ctx: window length (default: min(256, the training context)).
        target_sparsity: SiLU models: the per-layer share of scores counted inactive.
        progress: show a tqdm bar.
    """
    from powerpy.pipeline import profile as profile_mod

    ctx = ctx or min(256, llm.model.args.n_ctx_train)
    res = profile_mod.profile(
        llm.model,
        _ids(llm, text),
        ctx=ctx,
        max_tokens=tokens,
        target_sparsity=target_sparsity,
        progress=progress,
        numerics=llm.options.numerics,
    )
    res.model = llm.name
    return res


def train_predictors(
    llm: Loaded,
    text: str | Sequence[int],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    tokens: int | None = 20_000,
    progress: bool = True,
    **options,
) -> TrainReport:
    """Profile the model on a text and train one predictor per layer
    (docs/architecture.md#predictor-training).

    Args:
        llm: the loaded model.
        text: the training text, or its token ids.
        out_dir: the predictor directory (``model_{l}.pt``, ``config.json``, statistics);
            default: a new temporary directory, named in ``report.directory``.
        tokens: tokens to profile and train on.
        progress: tqdm bars.
        **options: fields of ``pipeline.train.TrainOptions`` (``hidden``, ``epochs``,
            ...) and ``ctx``, ``target_sparsity`` of ``pipeline.train.train_predictors``.

    Returns:
        The held-out metrics per layer. The model keeps its own predictors: build a PWRI
        file with ``powerpy convert`` to run the new ones.
    """
    from powerpy.pipeline import train

    kw = {k: options.pop(k) for k in ("ctx", "target_sparsity") if k in options}
    kw.setdefault("ctx", min(256, llm.model.args.n_ctx_train))
    opts = train.TrainOptions(**options)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="powerpy-"))
    report, _ = train.train_predictors(
        llm.model,
        _ids(llm, text),
        out,
        opts,
        tokens=tokens,
        progress=progress,
        numerics=llm.options.numerics,
        **kw,
    )
    report.model, report.directory = llm.name, str(out)
    return report


def sparsity_sweep(
    llm: Loaded,
    text: str | Sequence[int],
    thresholds: Sequence[float] | None = None,
    *,
    oracle: Sequence[float] | None = None,
    cut: Sequence[float] | None = None,
    ctx: int | None = None,
    chunks: int | None = 8,
    progress: bool = True,
) -> SweepResult:
    """Perplexity and skipped share at each predictor threshold, or of the top-k oracle at
    each skipped share (``oracle=[0.2, 0.5, ...]``), or of the file's cuts at each scale
    (``cut=[0.5, 1, 2]``), on held-out text.

    Args:
        llm: the loaded model.
        text: held-out text, or its token ids.
        thresholds: predictor thresholds (default ``sweep.DEFAULT_THRESHOLDS``).
        oracle: run the oracle at these skipped shares instead of the predictors.
        cut: run the file's cuts (``powerpy.ffn_down_threshold``) at these scales instead.
        ctx: chunk length (default: min(512, the training context)).
        chunks: at most this many chunks (None: the whole text).
        progress: tqdm bars.
    """
    from powerpy.pipeline import sweep

    kw = dict(
        ctx=ctx or min(512, llm.model.args.n_ctx_train),
        chunks=chunks,
        bos_id=llm.tokenizer.bos_id if llm.tokenizer.add_bos else None,
        name=llm.name,
        progress=progress,
        numerics=llm.options.numerics,
    )
    ids = _ids(llm, text)
    if oracle is not None:
        return sweep.oracle_sweep(llm.model, ids, oracle, **kw)
    if cut is not None:
        return sweep.cut_sweep(llm.model, ids, cut, **kw)
    return sweep.sparsity_sweep(llm.model, ids, thresholds or sweep.DEFAULT_THRESHOLDS, **kw)
