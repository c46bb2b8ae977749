"""The ingress's recent adapter resolutions: a request naming an adapter it resolved within
`resolve_ttl_s` is served from memory, on the event loop, with no store read and no thread.

Keyed by (ref, the caller's store view), so a tenant only ever gets what the store gave that
tenant. Only successes are kept (a name not found is looked up again, so a new publish
shows at once), for `ttl_s` at most; this ingress's own publishes and deletes drop the name
at once (`forget`). Other servers' deletes, and other ingress replicas', show within the TTL,
for `name@N` as for a bare `name`. ttl_s 0 turns the cache off.
"""
from __future__ import annotations

import time
from collections import OrderedDict

from adapterserve.adapters_store.records import AdapterVersion

MAX_ENTRIES = 4096  # beyond: the oldest go first


class Resolutions:
    def __init__(self, ttl_s: float, max_entries: int = MAX_ENTRIES) -> None:
        if ttl_s < 0:
            raise ValueError(f"resolve_ttl_s must be >= 0, got {ttl_s}")
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._entries: OrderedDict[tuple[str, str | None], tuple[float, AdapterVersion]] = OrderedDict()

    def get(self, ref: str, view: str | None) -> AdapterVersion | None:
        """The version `ref` resolved to for `view` within the TTL, else None."""
        entry = self._entries.get((ref, view))
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            del self._entries[(ref, view)]
            return None
        return entry[1]

    def put(self, ref: str, view: str | None, version: AdapterVersion) -> None:
        if self.ttl_s <= 0:
            return
        self._entries[(ref, view)] = (time.monotonic() + self.ttl_s, version)
        self._entries.move_to_end((ref, view))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, name: str) -> None:
        """Drop every ref of adapter `name` (`name` and `name@N`), for every view."""
        for key in [k for k in self._entries if k[0].partition("@")[0] == name]:
            del self._entries[key]
