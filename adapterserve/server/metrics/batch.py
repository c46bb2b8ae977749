"""What a replica sends the metrics hub: one numbered batch of deltas and its gauges now."""
from __future__ import annotations

from dataclasses import dataclass

from adapterserve.engine.stats import HistogramValue
from adapterserve.server.metrics.recorder import AdapterTag, Key

ROLES = ("ingress", "model", "encoder")  # the Ingress, the generation backbone's replicas, the encoder's


@dataclass(frozen=True)
class GatewayState:
    """One generation engine's load, as the gateway's endpoint picker reads it (gateway.py)."""

    backbone: str
    waiting: int
    running: int
    kv_blocks: int
    kv_used: int
    block_size: int
    max_lora: int  # adapter slots: adapters that can run in one batch
    running_adapters: tuple[AdapterTag, ...]  # in slots, ready: (name@N, public) and (name, public)
    waiting_adapters: tuple[AdapterTag, ...]  # wanted by waiting requests, not in a slot yet


@dataclass(frozen=True)
class MetricsBatch:
    reporter: str  # unique per replica (process)
    role: str  # one of ROLES
    seq: int  # 0, 1, 2, ... per reporter: a batch sent again after a failure is applied once
    counters: dict[Key, float]  # increments since the previous batch
    histograms: dict[Key, HistogramValue]  # observations since the previous batch
    gauges: dict[Key, float]  # values now (replace this reporter's previous ones)
    gateway: GatewayState | None = None
