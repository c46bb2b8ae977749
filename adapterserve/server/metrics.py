"""Prometheus metrics, through Ray's metrics agent (scraped from each Ray node).

Ray exports them with a `ray_` prefix, e.g. `ray_adapterserve_requests_total`.
"""
from __future__ import annotations

from ray.serve import metrics

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class IngressMetrics:
    """Per request, seen from the entry point."""

    def __init__(self) -> None:
        self.requests = metrics.Counter(
            "adapterserve_requests", description="Requests by method and gRPC status code.",
            tag_keys=("method", "code"),
        )
        self.prompt_tokens = metrics.Counter("adapterserve_prompt_tokens", description="Prompt tokens received.")
        self.generated_tokens = metrics.Counter("adapterserve_generated_tokens", description="Tokens generated.")
        self.ttft = metrics.Histogram(
            "adapterserve_time_to_first_token_seconds", description="Time from request to first token.",
            boundaries=_LATENCY_BUCKETS,
        )
        self.latency = metrics.Histogram(
            "adapterserve_request_seconds", description="Time from request to last message.",
            boundaries=_LATENCY_BUCKETS, tag_keys=("method",),
        )

    def finished(self, method: str, code: str, seconds: float) -> None:
        self.requests.inc(tags={"method": method, "code": code})
        self.latency.observe(seconds, tags={"method": method})


class ReplicaMetrics:
    """Adapter loading and engine queues, per replica."""

    def __init__(self) -> None:
        self.cache_hits = metrics.Counter(
            "adapterserve_adapter_cache_hits", description="Adapter lookups served from memory, by tier.",
            tag_keys=("tier",),
        )
        self.cache_misses = metrics.Counter(
            "adapterserve_adapter_cache_misses", description="Adapter lookups that had to load, by tier.",
            tag_keys=("tier",),
        )
        self.adapter_loads = metrics.Counter(
            "adapterserve_adapter_loads", description="Adapters registered with the engine (slot loads follow)."
        )
        self.adapter_unloads = metrics.Counter("adapterserve_adapter_unloads", description="Adapters unloaded.")
        self.queue_depth = metrics.Gauge("adapterserve_queue_depth", description="Requests waiting in the engine.")
        self.running = metrics.Gauge("adapterserve_running_requests", description="Requests the engine is running.")
        self.restarts = metrics.Counter(
            "adapterserve_engine_restarts",
            description="Engine processes restarted after a fault (gone, broken, stalled).",
        )
        self._queues: tuple[int, int] | None = None  # as last set
        self._restarts = 0  # as last counted

    def lookup(self, tier: str, hit: bool) -> None:
        (self.cache_hits if hit else self.cache_misses).inc(tags={"tier": tier})

    def engine_restarts(self, total: int) -> None:
        """Count the restarts since the last call (`total`: all of this replica's)."""
        if total > self._restarts:
            self.restarts.inc(total - self._restarts)
            self._restarts = total

    def queues(self, waiting: int, running: int) -> None:
        """Set both gauges, when they changed (this is called for every streamed chunk)."""
        if self._queues != (waiting, running):
            self._queues = (waiting, running)
            self.queue_depth.set(waiting)
            self.running.set(running)
