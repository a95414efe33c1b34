"""Beyond one machine: a model split by layer range into pipeline stages, and server replicas.

- ``stage``: one stage (layers [first, end) of a model, its KV caches, the last stage's
  samplers), in any process;
- ``pipeline``: :class:`PipelineEngine`, the scheduler's engine over stages, with deadlines,
  failure and restart handling;
- ``actors``: the stages as Ray actors pinned to nodes (``pip install 'powerpy[cluster]'``);
- ``plan``: which layers go to which node (``powerpy plan``, ``--pipeline auto``);
- ``replicas``: ``powerpy serve --replicas``, the server as a Ray Serve deployment.

Nothing here imports Ray until a pipeline or replicas are started over Ray::

    from powerpy.cluster import start_pipeline, parse_pipeline
    from powerpy.scheduler import Scheduler

    engine = start_pipeline("m.gguf", parse_pipeline("pc1:0-39,pc2:40-79", 80), restart=True)
    sched = Scheduler(engine, engine.tokenizer, engine.options, n_parallel=4)
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Stage": "powerpy.cluster.stage",
    "PipelineEngine": "powerpy.cluster.pipeline",
    "LocalTransport": "powerpy.cluster.pipeline",
    "StageError": "powerpy.cluster.pipeline",
    "StageSpec": "powerpy.cluster.spec",
    "parse_pipeline": "powerpy.cluster.spec",
    "Node": "powerpy.cluster.plan",
    "Plan": "powerpy.cluster.plan",
    "plan_pipeline": "powerpy.cluster.plan",
    "start_pipeline": "powerpy.cluster.actors",  # imports Ray
    "cluster_nodes": "powerpy.cluster.actors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'powerpy.cluster' has no attribute {name!r}")
