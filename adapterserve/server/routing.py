"""Adapter-affinity routing: the Serve request router of the generation deployment
(routing mode "adapter", routing_settings.py).

Each request carries its adapter version's content hash as `multiplexed_model_id`.
The router ranks the replicas, and Serve sends the request to the least loaded replica
of the first rank that has room:
  1. replicas that hold the adapter and are below `spill_queue_depth`;
  2. any replica below it: the request spills to the least loaded one, which loads the
     adapter and holds it from then on, so an adapter with more traffic than one replica
     serves becomes hot on several;
  3. every replica is saturated: the holders, then all (Serve's own limit,
     max_ongoing_requests, still applies; beyond it Serve backs off and tries again).
An adapter that no replica holds has a home replica (rendezvous hashing over the replicas
with room), so a burst for it lands on one replica until that one is saturated.
A request with no adapter goes to the least loaded replica.

"Holds": the replica reports the adapter to Serve (its multiplexer, replica.py), or this
router sent it a request for the adapter in the last MEMORY_S seconds. The second covers
the moment before a replica's report arrives, so a burst for a new adapter lands on one
replica rather than on all. Queue depth: the requests a replica runs or queues now, as
Serve counts them (its queue-length cache, kept by every send and completion and
refreshed by probes; a replica not in it counts as below the threshold and is probed).
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

MEMORY_S = 30.0  # how long a route sent here counts as "this replica holds the adapter"
MAX_REMEMBERED = 4096  # adapters whose recent routes are kept (beyond: the least recent go)
R = TypeVar("R")


def rank_replicas(replicas: Sequence[R], replica_id: Callable[[R], Any], adapter: str, holders: set,
                  depth: Callable[[Any], int | None], spill_queue_depth: int) -> list[list[R]]:
    """The replicas in ranks of preference for a request for `adapter` ("": none), which
    `holders` hold; `depth(id)`: a replica's queue depth, None when unknown (counts as room).
    An adapter no replica holds has a home: one replica with room, the same for every router."""
    def below(r: R) -> bool:
        queued = depth(replica_id(r))
        return queued is None or queued < spill_queue_depth

    if not adapter:
        return [list(replicas)]
    held = [r for r in replicas if replica_id(r) in holders]
    if not held:
        held = [home(adapter, [r for r in replicas if below(r)] or replicas, replica_id)]
    ranks = [[r for r in held if below(r)], [r for r in replicas if below(r)], held, list(replicas)]
    return [rank for rank in ranks if rank]


def home(adapter: str, replicas: Sequence[R], replica_id: Callable[[R], Any]) -> R:
    """The replica of `replicas` that `adapter` hashes highest with (rendezvous hashing: every
    router picks the same one, and adding or removing a replica moves only its own adapters)."""
    def score(r: R) -> bytes:
        return hashlib.blake2b(f"{adapter}|{replica_id(r)}".encode(), digest_size=8).digest()

    return max(replicas, key=score)


class RecentRoutes:
    """Adapter -> the replicas this router sent its requests to, each with the time it last did."""

    def __init__(self, memory_s: float = MEMORY_S, max_adapters: int = MAX_REMEMBERED,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.memory_s, self.max_adapters, self._clock = memory_s, max_adapters, clock
        self._routes: OrderedDict[str, dict[Any, float]] = OrderedDict()

    def sent(self, adapter: str, replica: Any) -> None:
        self._routes.setdefault(adapter, {})[replica] = self._clock()
        self._routes.move_to_end(adapter)
        while len(self._routes) > self.max_adapters:
            self._routes.popitem(last=False)

    def replicas(self, adapter: str) -> set:
        """The replicas sent `adapter`'s requests within memory_s."""
        routes = self._routes.get(adapter)
        if not routes:
            return set()
        oldest = self._clock() - self.memory_s
        for replica in [r for r, at in routes.items() if at < oldest]:
            del routes[replica]
        return set(routes)

    def forget_replica(self, replica: Any) -> None:
        for routes in self._routes.values():
            routes.pop(replica, None)


class AdapterAffinityRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Serve request router: adapter affinity with a spill threshold (module docstring)."""

    def initialize_state(self, spill_queue_depth: int = 1, **kwargs: Any) -> None:
        self.spill_queue_depth = spill_queue_depth
        self.recent = RecentRoutes()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        adapter = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        holders = self._holders(adapter, candidate_replicas) if adapter else set()
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every rank full: wait before trying again
        cache = self.replica_queue_len_cache
        return rank_replicas(candidate_replicas, lambda r: r.replica_id, adapter, holders, cache.get,
                             self.spill_queue_depth)

    def _holders(self, adapter: str, replicas: Iterable[RunningReplica]) -> set[ReplicaID]:
        """Replicas that report `adapter` to Serve or were sent its requests lately (among `replicas`)."""
        live = {r.replica_id for r in replicas}
        return (self._multiplexed_model_id_to_replica_ids.get(adapter, set()) | self.recent.replicas(adapter)) & live

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if adapter := pending_request.metadata.multiplexed_model_id:
            self.recent.sent(adapter, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.recent.forget_replica(replica_id)
