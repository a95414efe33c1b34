"""``powerpy serve --replicas``: whole servers as a Ray Serve deployment behind one endpoint.

Each replica builds the server's own FastAPI app (every route, the streaming and the errors as
they are) over its own model and scheduler; Serve's proxy spreads the requests over the
replicas. A replica's ``check_health`` is its scheduler's liveness probe (``Scheduler.health``):
Serve restarts a replica that fails it or dies, and the others keep answering.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ray import serve

log = logging.getLogger(__name__)

APP_NAME = "powerpy"
HEALTH_PERIOD_S = 5.0
HEALTH_TIMEOUT_S = 30.0


@serve.deployment
@serve.ingress()
class Replica:
    """One server: ``build()`` returns its app, its started scheduler and a banner line."""

    def __init__(self, build: Callable[[], tuple[Any, Any, str]]) -> None:
        self._app, self.scheduler, banner = build()  # (Serve's wrapper has an `app`)
        log.info("replica ready: %s", banner)

    def __serve_build_asgi_app__(self):
        return self._app

    def check_health(self) -> None:
        problem = self.scheduler.health()
        if problem is not None:
            raise RuntimeError(problem.get("message", "unhealthy"))

    def __del__(self) -> None:
        sched = getattr(self, "scheduler", None)
        if sched is not None:
            sched.close(timeout=5.0)


def deploy(
    build: Callable[[], tuple[Any, Any, str]],
    *,
    replicas: tuple[int, int],
    host: str,
    port: int,
    cpus: float = 1.0,
    slots: int = 64,
) -> None:
    """Run ``replicas`` (min, max; equal: fixed) copies of the server on the Ray cluster,
    behind Serve's HTTP proxy on ``host:port``. A replica takes ``slots`` requests at once
    (its sessions and queue, which answer 503 beyond); autoscaling aims at half of them."""
    lo, hi = replicas
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    scaling: dict[str, Any] = {"num_replicas": lo}
    if hi > lo:
        target = max(1, slots // 2)
        scaling = {
            "autoscaling_config": dict(
                min_replicas=lo, max_replicas=hi, target_ongoing_requests=target
            )
        }
    app = Replica.options(
        ray_actor_options={"num_cpus": cpus},
        max_ongoing_requests=slots,
        health_check_period_s=HEALTH_PERIOD_S,
        health_check_timeout_s=HEALTH_TIMEOUT_S,
        **scaling,
    ).bind(build)
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except RuntimeError as e:  # the replicas' own errors are in the log above
        shutdown()
        raise ValueError(f"the replicas did not start ({e}); their error is logged above") from None


def shutdown() -> None:
    """Remove the deployment and Serve's proxy from the cluster."""
    try:
        serve.shutdown()
    except Exception:  # the cluster is gone already
        log.debug("serve.shutdown failed", exc_info=True)
