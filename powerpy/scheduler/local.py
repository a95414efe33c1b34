"""What the scheduler runs a model through (:class:`Engine`), and the engine of a model in this
process (:class:`LocalEngine`).

The scheduler decides what runs (which slots prefill, which decode together, in which batching
mode); an engine runs it and returns, for each segment, what its logits gave (``picks.Drawn``):
the next token, its log-probability, the prompt's scores. A local engine computes them from the
model's logits here; a pipeline's (``powerpy.cluster.PipelineEngine``) on its last stage.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from powerpy.config import ModelArgs
from powerpy.model.options import RunOptions
from powerpy.model.transformer import Model
from powerpy.scheduler.picks import Drawn, Pick, Score, take

log = logging.getLogger(__name__)

SEQUENTIAL = "off"  # one forward per session


class EngineUnavailable(RuntimeError):
    """The engine cannot run at all (a pipeline stage died or hangs): requests end with a 503.

    Attributes:
        detail: what ``/health`` reports (a pipeline names the stage, host, layers and error).
    """

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.detail = detail or {}


@dataclass
class Prefill:
    """One prompt chunk of one session: ``tokens`` at ``cache.pos``; ``pick`` its next token
    (the prompt's last chunk), ``score`` its rows (``prompt_logprobs``)."""

    cache: Any
    tokens: list[int]
    pick: Pick | None = None
    score: Score | None = None


class Engine(Protocol):
    """The model as the scheduler sees it. ``new_cache`` gives a session's cache, whose
    ``pos`` and ``n_ctx`` the scheduler reads and whose ``pos`` it may lower (to reuse a
    prefix); ``prefill`` and ``decode`` advance the caches they run."""

    args: ModelArgs

    @property
    def can_gate(self) -> bool: ...

    def new_cache(self, n_ctx: int) -> Any: ...

    def prefill(self, works: Sequence[Prefill], opts: RunOptions) -> list[Drawn | Exception]:
        """Run each chunk; one result (or the exception that ended it) per chunk, in order."""
        ...

    def decode(
        self,
        caches: Sequence[Any],
        tokens: Sequence[int],
        picks: Sequence[Pick],
        opts: RunOptions,
        mode: str,
    ) -> tuple[list[Drawn | Exception], int]:
        """One token per session, batched by ``mode`` (``SEQUENTIAL``, or an FFN mode of
        ``Model.decode_batch``); the results in order and the number of forwards run."""
        ...

    def health(self) -> dict[str, Any] | None:
        """None while the engine can run, else what is wrong (``EngineUnavailable.detail``);
        may probe for a short while (call it off the event loop)."""
        ...

    @property
    def failure(self) -> EngineUnavailable | None:
        """The known failure, without probing (None: none known)."""
        ...

    def close(self) -> None: ...


class LocalEngine:
    """The engine of a ``Model`` in this process: its logits never leave it."""

    def __init__(self, model: Model) -> None:
        self.model, self.args = model, model.args

    @property
    def can_gate(self) -> bool:
        return self.model.can_gate

    def new_cache(self, n_ctx: int):
        return self.model.new_cache(n_ctx)

    def prefill(self, works: Sequence[Prefill], opts: RunOptions) -> list[Drawn | Exception]:
        out: list[Drawn | Exception] = []
        for w in works:
            try:
                tokens = torch.tensor(w.tokens, dtype=torch.long)
                logits = self.model.forward(tokens, w.cache, opts, all_logits=w.score is not None)
                out.append(take(logits, w.pick, w.score))
            except Exception as e:
                out.append(e)
        return out

    def decode(
        self,
        caches: Sequence[Any],
        tokens: Sequence[int],
        picks: Sequence[Pick],
        opts: RunOptions,
        mode: str,
    ) -> tuple[list[Drawn | Exception], int]:
        rows: list = []
        if len(caches) > 1 and mode != SEQUENTIAL:
            try:
                ids = torch.tensor(list(tokens), dtype=torch.long)
                rows = list(self.model.decode_batch(ids, list(caches), opts, ffn_mode=mode))
            except Exception:
                log.exception("batched decode failed: running the sessions one by one")
        steps = 1 if rows else len(caches)
        if not rows:
            for c, t in zip(caches, tokens, strict=True):
                try:
                    rows.append(self.model.forward(torch.tensor([t]), c, opts)[-1])
                except Exception as e:
                    rows.append(e)
        out: list[Drawn | Exception] = []
        for r, p in zip(rows, picks, strict=True):
            if isinstance(r, Exception):
                out.append(r)
                continue
            try:
                out.append(take(r[None], p))
            except Exception as e:
                out.append(e)
        return out, steps

    def health(self) -> dict[str, Any] | None:
        return None

    @property
    def failure(self) -> EngineUnavailable | None:
        return None

    def close(self) -> None:
        pass
