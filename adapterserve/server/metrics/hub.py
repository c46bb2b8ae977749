"""The metrics hub: one small deployment of the application that every replica reports to,
and that every scrape reads (GET /metrics through the Ingress, and the metrics port).

Why a hub: a scrape must give the totals of every Ingress and engine replica (and of the
engine process inside each), whichever replica answers it. Each replica sends its deltas
and gauges about once a second (reporter.py); the hub adds them up (aggregate.py). Ray's
own metrics agents would also aggregate, but per node, seconds late, mixed into Ray's
1 MB of series, and a stopped replica's counts would vanish from the totals.

It runs on the head node (the metrics port has one place), takes no CPU and keeps no
state worth saving: if it is replaced, counters start again from what replicas report
next (Prometheus' rate() reads that as a counter reset).
"""
from __future__ import annotations

from typing import Any

from ray import serve

from adapterserve.server.metrics import exposition
from adapterserve.server.metrics.aggregate import Aggregate
from adapterserve.server.metrics.batch import MetricsBatch
from adapterserve.server.metrics.labels import AdapterLabels
from adapterserve.server.metrics.listener import MetricsListener
from adapterserve.server.metrics.settings import stale_after_s

HEAD_NODE = {"node:__internal_head__": 0.001}  # Ray's resource of the head node: the hub runs there


@serve.deployment
class MetricsHub:
    async def __init__(self, config: dict[str, Any]) -> None:
        metrics = config["metrics"]
        labels = AdapterLabels(metrics["adapter_labels"], metrics["label_refresh_s"])
        self.aggregate = Aggregate(labels, stale_after_s(metrics))
        self.listener = None
        if metrics["port"] is not None:
            self.listener = MetricsListener(metrics["host"], metrics["port"], lambda: self.render_now("full"))
            self.listener.start()

    async def report(self, batch: MetricsBatch) -> bool:
        """A replica's batch; False if it was applied before (a batch sent again)."""
        return self.aggregate.apply(batch)

    async def render(self, view: str) -> bytes:
        """Every series of `view` ("public" or "full") in Prometheus' text format."""
        return self.render_now(view)

    async def by_replica(self, role: str = "model") -> dict[str, dict[str, float]]:
        """Each live replica of `role`'s own totals and gauges by series name, e.g. its
        adapterserve_adapter_slot_loads and its requests started
        (adapterserve_request_queue_seconds_count): what benchmarks/scale.py reads."""
        return self.aggregate.by_reporter(role)

    def render_now(self, view: str) -> bytes:
        return exposition.render(self.aggregate, view)


def hub_options() -> dict[str, Any]:
    """Serve options of the hub: one replica, no CPU, on the head node."""
    return {"name": "MetricsHub", "num_replicas": 1, "max_ongoing_requests": 256,
            "ray_actor_options": {"num_cpus": 0, "resources": dict(HEAD_NODE)}}
