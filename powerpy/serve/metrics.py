"""``GET /metrics``: Prometheus text from the scheduler's counters (read at each scrape) and the
HTTP responses by endpoint and status. Each app has its own registry."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from powerpy.scheduler import Scheduler

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]


class _SchedulerCollector:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self):
        s = self.scheduler.snapshot()
        req = CounterMetricFamily(
            "powerpy_requests", "Generation requests by outcome", labels=["outcome"]
        )
        for outcome, n in s["outcomes"].items():
            req.add_metric([outcome], n)
        req.add_metric(["rejected"], s["rejected"])
        yield req
        yield CounterMetricFamily(
            "powerpy_prompt_tokens", "Prompt tokens run (reused ones excluded)", s["prompt_tokens"]
        )
        yield CounterMetricFamily(
            "powerpy_prompt_tokens_cached",
            "Prompt tokens reused from a session's KV cache",
            s["cached_tokens"],
        )
        yield CounterMetricFamily(
            "powerpy_generated_tokens", "Tokens generated", s["generated_tokens"]
        )
        yield CounterMetricFamily(
            "powerpy_prompt_seconds", "Seconds spent on prompts", s["prompt_seconds"]
        )
        yield CounterMetricFamily(
            "powerpy_decode_seconds", "Seconds spent on decode steps", s["decode_seconds"]
        )
        rate = s["prompt_tokens"] / s["prompt_seconds"] if s["prompt_seconds"] else 0.0
        yield GaugeMetricFamily(
            "powerpy_prompt_tokens_per_second", "Prompt tokens per second (since start)", rate
        )
        rate = s["generated_tokens"] / s["decode_seconds"] if s["decode_seconds"] else 0.0
        yield GaugeMetricFamily(
            "powerpy_decode_tokens_per_second",
            "Generated tokens per second, all sessions together (since start)",
            rate,
        )
        rows = s["decode_rows"] / s["decode_steps"] if s["decode_steps"] else 0.0
        yield GaugeMetricFamily("powerpy_decode_batch_size", "Mean tokens per decode forward", rows)
        yield GaugeMetricFamily(
            "powerpy_queue_depth", "Requests waiting for a slot", s["queue_depth"]
        )
        yield GaugeMetricFamily("powerpy_slots_busy", "Slots running a request", s["slots_busy"])
        yield GaugeMetricFamily("powerpy_slots_total", "Session slots", s["slots_total"])
        if s["active_fraction"] is not None:
            yield GaugeMetricFamily(
                "powerpy_predicted_active_ratio",
                "Predicted-active FFN neurons, mean over layers and tokens",
                s["active_fraction"],
            )


class Metrics:
    """The registry of one app: scheduler counters plus HTTP responses."""

    def __init__(self, scheduler: Scheduler) -> None:
        disable_created_metrics()  # no *_created series (process-wide; this is a server)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(scheduler))
        self.http = Counter(
            "powerpy_http_responses",
            "HTTP responses by endpoint and status code",
            ["endpoint", "code"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
