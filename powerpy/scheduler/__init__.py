"""Many sessions over one model: a bounded queue, session slots with their own KV caches, and
one worker thread that advances them in turn (batching their decode steps where that pays).

The HTTP server (``powerpy.serve``) talks to it through :class:`Request` callbacks; nothing here
knows about HTTP.
"""

from powerpy.scheduler.engine import (
    BATCH_MODES,
    PromptTooLong,
    QueueFull,
    Scheduler,
    ShuttingDown,
    Stats,
)
from powerpy.scheduler.local import Engine, EngineUnavailable, LocalEngine
from powerpy.scheduler.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from powerpy.scheduler.request import (
    Delta,
    Event,
    Failed,
    Finished,
    PromptLogprobs,
    Request,
    Sampling,
    StopMatcher,
    build_sampler,
)

__all__ = [
    "BATCH_MODES",
    "Delta",
    "Engine",
    "EngineUnavailable",
    "Event",
    "Failed",
    "Finished",
    "LocalEngine",
    "MAX_TOP_LOGPROBS",
    "PromptLogprobs",
    "PromptTooLong",
    "QueueFull",
    "Request",
    "Sampling",
    "Scheduler",
    "ShuttingDown",
    "Stats",
    "StopMatcher",
    "TokenLogprob",
    "build_sampler",
]
