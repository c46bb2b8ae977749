"""What the engine counts about its own work, for metrics (no torch: the metrics hub reads it too).

Counts only grow while the engine lives (a restarted engine counts from zero again).

    stats.step(batch.requests, batch.num_tokens, seconds)   # Engine.step, for a batch that ran
    stats.snapshot().step_seconds.count                       # steps so far
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass

STEP_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKENS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384)
QUEUE_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class HistogramValue:
    """Observations per bucket (bucket i: at most bounds[i]; the last: above every bound), and their sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def minus(self, earlier: HistogramValue) -> HistogramValue:
        """What was observed since `earlier` (a value of the same histogram)."""
        counts = tuple(a - b for a, b in zip(self.counts, earlier.counts))
        return HistogramValue(self.bounds, counts, self.sum - earlier.sum)


class Histogram:
    """Counts observations into Prometheus-style buckets (upper bounds, inclusive)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must increase strictly, got {bounds!r}")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sum += value

    def add(self, other: HistogramValue) -> None:
        """Count another histogram's observations (of the same bounds) as this one's."""
        if other.bounds != self.bounds:
            raise ValueError(f"cannot add a histogram with bounds {other.bounds} to one with {self.bounds}")
        self._counts = [a + b for a, b in zip(self._counts, other.counts)]
        self._sum += other.sum

    def value(self) -> HistogramValue:
        return HistogramValue(self.bounds, tuple(self._counts), self._sum)


@dataclass(frozen=True)
class StatsSnapshot:
    step_seconds: HistogramValue  # wall time of steps that ran a batch
    batch_requests: HistogramValue  # requests in each such step
    batch_tokens: HistogramValue  # tokens computed in each such step
    queue_seconds: HistogramValue  # time from a request's arrival to its first step
    prefix_queries: int = 0  # prompt tokens of requests first scheduled with the prefix cache on
    prefix_hits: int = 0  # of which found in the prefix cache


class EngineStats:
    def __init__(self) -> None:
        self.step_seconds = Histogram(STEP_SECONDS)
        self.batch_requests = Histogram(BATCH_REQUESTS)
        self.batch_tokens = Histogram(BATCH_TOKENS)
        self.queue_seconds = Histogram(QUEUE_SECONDS)
        self.prefix_queries = 0
        self.prefix_hits = 0

    def step(self, requests: Sequence, num_tokens: int, seconds: float) -> None:
        """A step ran `requests` (Request objects) computing `num_tokens` tokens in `seconds`;
        each request scheduled for the first time leaves the queue now (and counts its prompt
        tokens found in the prefix cache, if that is on)."""
        now = time.monotonic()
        self.step_seconds.observe(seconds)
        self.batch_requests.observe(len(requests))
        self.batch_tokens.observe(num_tokens)
        for request in requests:
            if request.scheduled_at is None:
                request.scheduled_at = now
                self.queue_seconds.observe(now - request.arrived_at)
                if request.cached_tokens is not None:
                    self.prefix_queries += len(request.prompt_ids)
                    self.prefix_hits += request.cached_tokens

    def snapshot(self) -> StatsSnapshot:
        return StatsSnapshot(self.step_seconds.value(), self.batch_requests.value(),
                             self.batch_tokens.value(), self.queue_seconds.value(),
                             self.prefix_queries, self.prefix_hits)
