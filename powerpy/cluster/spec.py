"""Where each stage runs: :class:`StageSpec`, and ``--pipeline HOST:A-B,...`` parsed.

A stage is a contiguous run of layers on one node, written as users of ``--pipeline`` write it:
``10.0.0.1:0-39,10.0.0.2:40-79`` (layers inclusive, as ``VLLM_PP_LAYER_PARTITION`` counts
them). An optional third field is the stage's own VRAM budget in GiB: ``pc2:40-79:22``. A host
is a Ray node's IP address, its hostname, its node id, or a custom resource only it has
(``ray start --resources='{"pc2": 1}'``); ``*`` lets Ray choose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from powerpy.model.stage import layer_span

ANY_HOST = "*"


@dataclass(frozen=True)
class StageSpec:
    """One stage: ``layers`` of the model on ``host`` (None: any node), placed within
    ``vram_budget`` GiB of that node's GPU (None: the server's ``--vram-budget``)."""

    layers: range
    host: str | None = None
    vram_budget: float | None = None

    def __str__(self) -> str:
        text = f"{self.host or ANY_HOST}:{layer_span(self.layers)}"
        return text if self.vram_budget is None else f"{text}:{self.vram_budget:g}"


def parse_pipeline(text: str, n_layer: int) -> list[StageSpec]:
    """The stages of ``--pipeline HOST:A-B[:GIB],...`` for a model of ``n_layer`` layers.

    Raises:
        ValueError: an entry that does not parse, or ranges that do not cover the layers
            0..n_layer-1 in order, each once; the message names the entry.
    """
    specs, expect = [], 0
    for entry in (e.strip() for e in text.split(",")):
        host, span, budget = _fields(entry)
        first, _, last = span.partition("-")
        if not (first.isdigit() and last.isdigit()):
            raise ValueError(
                f"--pipeline {entry!r}: the layers must be FIRST-LAST, e.g. 0-39 (in "
                f"HOST:FIRST-LAST[:VRAM_GIB])"
            )
        layers = range(int(first), int(last) + 1)
        if layers.start != expect or not layers:
            raise ValueError(
                f"--pipeline {entry!r}: the stages must cover the model's layers 0-{n_layer - 1} "
                f"in order, each once; this one should start at layer {expect}"
            )
        specs.append(StageSpec(layers, None if host == ANY_HOST else host, budget))
        expect = layers.stop
    if expect != n_layer:
        raise ValueError(
            f"--pipeline {text!r} covers layers 0-{expect - 1}, the model has 0-{n_layer - 1}"
        )
    return specs


def _fields(entry: str) -> tuple[str, str, float | None]:
    """(host, FIRST-LAST, budget) of ``HOST:FIRST-LAST[:GIB]`` (an IPv6 host in brackets)."""
    if entry.startswith("[") and "]:" in entry:
        host, rest = entry[1:].split("]:", 1)
    else:
        host, _, rest = entry.partition(":")
    fields = rest.split(":")
    if not host or not rest or len(fields) > 2 or not all(fields):
        raise ValueError(
            f"--pipeline {entry!r}: write each stage as HOST:FIRST-LAST[:VRAM_GIB], e.g. "
            f"10.0.0.2:40-79 or pc2:40-79:22 (* for any host)"
        )
    budget = None
    if len(fields) == 2:
        try:
            budget = float(fields[1])
        except ValueError:
            budget = math.nan
        if not math.isfinite(budget):
            raise ValueError(f"--pipeline {entry!r}: the VRAM budget {fields[1]!r} is not a number")
    return host, fields[0], budget
