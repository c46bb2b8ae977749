"""Prometheus metrics reach Ray's metrics endpoint (exported every 0.5 s in these tests); per-chunk
work stays off them: tokens are counted once per request, queue gauges set when they change."""
from __future__ import annotations

import asyncio
import re
import time
from types import SimpleNamespace

import requests

from adapterserve.server.ingress import Ingress
from adapterserve.server.metrics import ReplicaMetrics

EXPECTED = {
    "ray_adapterserve_requests_total": r'code="OK".*method="Generate"|method="Generate".*code="OK"',
    "ray_adapterserve_generated_tokens_total": "",
    "ray_adapterserve_prompt_tokens_total": "",
    "ray_adapterserve_time_to_first_token_seconds_count": "",
    "ray_adapterserve_adapter_loads_total": "",
    "ray_adapterserve_adapter_cache_misses_total": 'tier="host"',
    "ray_adapterserve_adapter_cache_hits_total": 'tier="engine"',
    "ray_adapterserve_queue_depth": "",
    "ray_adapterserve_running_requests": "",
}


def _positive_samples(body: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in body.splitlines():
        match = re.match(r"(ray_adapterserve_\w+)(\{.*\})? ([0-9.e+-]+)$", line)
        if match:
            found.setdefault(match[1], []).append(f"{match[2] or ''} {match[3]}")
    return found


def _seen(samples: dict[str, list[str]], name: str, labels: str) -> bool:
    values = samples.get(name, [])
    if name.endswith(("queue_depth", "running_requests")):
        return bool(values)  # gauges: present (they may read 0 now)
    return any(float(v.split()[-1]) > 0 and re.search(labels, v) for v in values)


def test_request_token_and_adapter_metrics_are_exported(server, alice, uploaded):
    for adapter in ("sql", "sql"):  # a load, then an engine-tier hit
        alice.generate("hello", adapter=adapter, max_tokens=4, temperature=0.0)
    deadline = time.monotonic() + 60
    while True:  # the exporter is periodic: there is no event to wait for
        samples = _positive_samples(requests.get(server.metrics, timeout=10).text)
        missing = [n for n, labels in EXPECTED.items() if not _seen(samples, n, labels)]
        if not missing:
            return
        assert time.monotonic() < deadline, f"metrics never exported: {missing}; got {sorted(samples)}"
        time.sleep(0.5)


class _Metric:
    def __init__(self) -> None:
        self.values: list = []

    def inc(self, value=1.0, tags=None) -> None:
        if value <= 0:
            raise ValueError(f"value must be >0, got {value}")  # as Ray's Counter
        self.values.append(value)

    def set(self, value, tags=None) -> None:
        self.values.append(value)

    observe = set


def test_generated_tokens_are_counted_once_per_request():
    metrics = SimpleNamespace(ttft=_Metric(), prompt_tokens=_Metric(), generated_tokens=_Metric())
    ingress = SimpleNamespace(metrics=metrics)

    async def relay(chunks):
        async def source():
            for chunk in chunks:
                yield chunk
        return [c async for c in Ingress.func_or_class._measured(ingress, source(), 0.0)]

    asyncio.run(relay([{"token_ids": [5], "prompt_tokens": 3}, {"token_ids": [6, 7]}, {"token_ids": []}]))
    assert (metrics.prompt_tokens.values, metrics.generated_tokens.values) == ([3], [3])
    asyncio.run(relay([{"token_ids": [], "prompt_tokens": 2}]))  # no tokens: nothing counted, nothing raised
    assert metrics.generated_tokens.values == [3] and len(metrics.ttft.values) == 2


def test_queue_gauges_are_set_when_they_change():
    replica = object.__new__(ReplicaMetrics)  # its gauges without Ray's
    replica.queue_depth, replica.running, replica._queues = _Metric(), _Metric(), None
    for waiting, running in ((1, 2), (1, 2), (1, 2), (0, 3)):
        replica.queues(waiting, running)
    assert (replica.queue_depth.values, replica.running.values) == ([1, 0], [2, 3])
