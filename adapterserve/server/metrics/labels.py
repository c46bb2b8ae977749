"""Which adapter names the `adapter` label shows: the top N by traffic; the rest count as `_other`.

Counters must only grow, so a name's counts never move between labels after the fact:
each increment is filed under the label its adapter has when it arrives (aggregate.py). A
name that leaves the top N keeps its series as they are, frozen (they stop growing; its
new traffic counts under `_other`), for `keep_s`, long enough for every scraper to read
their final values; then they are dropped. A series that ends is ordinary in Prometheus
(rate() and increase() see it stop; nothing counts down). A name that comes back resumes
its frozen series, or starts new ones once they were dropped.

Traffic is a decayed request count (half-life `half_life_s`). While fewer than N names
have a label, a new name gets one at once. With N labelled, the table is revised every
`refresh_s`: a name takes the place of the coldest labelled one only with `hysteresis`
times its traffic, so names near the boundary do not flap. At most N names grow at a
time, and at most N more are frozen per `refresh_s` (in practice, far fewer).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from adapterserve.server.metrics.series import OTHER

_FORGET = 1e-3  # decayed traffic below this, of a name without a label, is forgotten


class AdapterLabels:
    def __init__(self, limit: int, refresh_s: float = 60.0, *, half_life_s: float = 600.0, keep_s: float = 600.0,
                 hysteresis: float = 1.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.refresh_s, self.half_life_s = limit, refresh_s, half_life_s
        self.keep_s, self.hysteresis, self._clock = keep_s, hysteresis, clock
        self.named: set[str] = set()  # names whose series grow
        self.frozen: dict[str, float] = {}  # name -> when it lost its label (its series kept, not growing)
        self._traffic: dict[str, tuple[float, float]] = {}  # name -> (decayed requests, as of when)
        self._next_refresh = clock() + refresh_s

    def count(self, name: str, requests: float) -> None:
        """`requests` more calls used adapter `name`."""
        now = self._clock()
        self._traffic[name] = (self.traffic(name, now) + requests, now)

    def traffic(self, name: str, now: float | None = None) -> float:
        value, at = self._traffic.get(name, (0.0, 0.0))
        now = self._clock() if now is None else now
        return value * 0.5 ** ((now - at) / self.half_life_s) if value else 0.0

    def label(self, name: str) -> str:
        """The label an increment for adapter `name` is filed under now."""
        if name in self.named:
            return name
        if len(self.named) < self.limit:
            self._name(name)
            return name
        return OTHER

    def refresh(self) -> list[str]:
        """Revise the table if it is time; returns the frozen names whose series to drop now."""
        now = self._clock()
        if now < self._next_refresh:
            return []
        self._next_refresh = now + self.refresh_s
        self._promote(now)
        dropped = [name for name, since in self.frozen.items() if now - since >= self.keep_s]
        for name in dropped:
            del self.frozen[name]
        for name in [n for n in self._traffic if n not in self.named and self.traffic(n, now) < _FORGET]:
            del self._traffic[name]
        return dropped

    def _promote(self, now: float) -> None:
        waiting = sorted(((self.traffic(n, now), n) for n in self._traffic if n not in self.named), reverse=True)
        for heat, name in waiting:
            if len(self.named) < self.limit:
                self._name(name)
                continue
            coldest = min(self.named, key=lambda n: (self.traffic(n, now), n), default=None)
            if coldest is None or heat <= self.hysteresis * self.traffic(coldest, now):
                return  # the rest are colder still
            self.named.discard(coldest)
            self.frozen[coldest] = now
            self._name(name)

    def _name(self, name: str) -> None:
        self.named.add(name)
        self.frozen.pop(name, None)
