"""Prometheus metrics reach Ray's metrics endpoint (exported every 0.5 s in these tests)."""
from __future__ import annotations

import re
import time

import requests

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
