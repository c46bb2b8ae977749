"""The `routing` settings (settings.DEFAULTS): how the ingress picks a generation replica.

    routing: {mode: adapter, spill_queue_depth: null}

mode "adapter" (the default): adapter affinity (server/routing.py). "pow2": Serve's default
power of two choices, the request sent with no adapter id, so the adapter plays no part.
spill_queue_depth: a replica whose queue depth (requests it runs or queues) is at least this
is saturated, and an adapter's requests spill past it; null: the engine's max_num_seqs (its
batch is full, so a further request would wait).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

AFFINITY = "adapter"
MODES = (AFFINITY, "pow2")


@dataclass(frozen=True)
class Routing:
    mode: str
    spill_queue_depth: int

    @property
    def by_adapter(self) -> bool:
        return self.mode == AFFINITY


def routes_by_adapter(routing: Mapping[str, Any]) -> bool:
    """Whether requests carry their adapter's content hash to Serve (settings checked by build_app)."""
    return routing["mode"] == AFFINITY


def routing_of(routing: Mapping[str, Any], max_num_seqs: int) -> Routing:
    """The checked `routing` settings; ValueError naming the first bad value."""
    mode, depth = routing["mode"], routing["spill_queue_depth"]
    if mode not in MODES:
        raise ValueError(f"routing.mode must be one of {', '.join(MODES)}, got {mode!r}")
    if depth is None:
        depth = max_num_seqs
    elif isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"routing.spill_queue_depth must be an integer >= 1 (requests a replica runs or queues "
                         f"before an adapter's requests go elsewhere) or null (the engine's max_num_seqs), "
                         f"got {depth!r}")
    return Routing(mode, depth)
