"""The hub's totals: every replica's batches summed into one set of series per view.

Counters and histograms arrive as deltas and are added up here, so a replica that goes
away leaves its counts in the totals (no counter goes down when a replica stops), and a
batch sent again after a failure is applied once (by its number). Gauges arrive as values
and are summed over the replicas heard from in the last `stale_s` (a stopped replica
runs nothing).

Two views are kept side by side, each increment filed in both:
    full    every series; adapters named by labels.py (the metrics port)
    public  what any client may know: private adapters count as `_other`, no tenant series
            (GET /metrics on the HTTP port, by default)
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from adapterserve.engine.stats import Histogram, HistogramValue
from adapterserve.server.metrics import series as s
from adapterserve.server.metrics.batch import GatewayState, MetricsBatch
from adapterserve.server.metrics.labels import AdapterLabels
from adapterserve.server.metrics.recorder import AdapterTag, Key

VIEWS = ("full", "public")
SeriesKey = tuple[str, tuple[str, ...]]  # series name, every label value (the adapter label's included)
FORGET_S = 3600.0  # a reporter not heard from this long is forgotten (its counts stay in the totals)


@dataclass
class Store:
    counters: defaultdict[SeriesKey, float] = field(default_factory=lambda: defaultdict(float))
    histograms: dict[SeriesKey, Histogram] = field(default_factory=dict)

    def add(self, key: SeriesKey, amount: float) -> None:
        self.counters[key] += amount

    def add_histogram(self, key: SeriesKey, observed: HistogramValue) -> None:
        if key not in self.histograms:
            self.histograms[key] = Histogram(observed.bounds)
        self.histograms[key].add(observed)

    def drop_adapter(self, name: str) -> None:
        """Forget every series labelled with adapter `name`."""
        for table in (self.counters, self.histograms):
            for key in [k for k in table if s.CATALOG[k[0]].has_adapter and k[1][-1] == name]:
                del table[key]


@dataclass(frozen=True)
class Reporter:
    role: str
    seen: float  # clock() when its latest batch came
    gauges: dict[Key, float]
    gateway: GatewayState | None


class Aggregate:
    def __init__(self, labels: AdapterLabels, stale_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.labels, self.stale_s, self._clock = labels, stale_s, clock
        self.stores = {view: Store() for view in VIEWS}
        self._applied: dict[str, int] = {}  # reporter -> the number of its latest batch applied
        self._reporters: dict[str, Reporter] = {}
        # reporter -> series name -> its total (histograms: observations, as NAME_count), every label summed
        self._counts: defaultdict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))

    def apply(self, batch: MetricsBatch) -> bool:
        """Add a batch's deltas (False, and only its gauges taken, if it was applied before)."""
        self.tidy()  # the table is revised before these increments are filed
        now = self._clock()
        self._reporters[batch.reporter] = Reporter(batch.role, now, dict(batch.gauges), batch.gateway)
        if batch.seq <= self._applied.get(batch.reporter, -1):
            return False
        self._applied[batch.reporter] = batch.seq
        for (name, _, adapter), amount in batch.counters.items():
            if name == s.REQUESTS.name and adapter is not None and adapter[0] not in (s.BASE, s.NO_ADAPTER):
                self.labels.count(adapter[0], amount)
        counts = self._counts[batch.reporter]
        for key, amount in batch.counters.items():
            counts[key[0]] += amount
            for store, series_key in self._filed(key):
                store.add(series_key, amount)
        for key, observed in batch.histograms.items():
            counts[f"{key[0]}_count"] += observed.count
            for store, series_key in self._filed(key):
                store.add_histogram(series_key, observed)
        return True

    def tidy(self) -> None:
        """Drop the series of adapters frozen long enough, and reporters long gone."""
        for name in self.labels.refresh():
            for store in self.stores.values():
                store.drop_adapter(name)
        now = self._clock()
        for reporter in [r for r, seen in self._reporters.items() if now - seen.seen > FORGET_S]:
            del self._reporters[reporter]
            self._applied.pop(reporter, None)
            self._counts.pop(reporter, None)

    def live(self) -> list[Reporter]:
        """Reporters heard from in the last stale_s."""
        now = self._clock()
        return [r for r in self._reporters.values() if now - r.seen <= self.stale_s]

    def gauges(self) -> dict[SeriesKey, float]:
        """Every gauge summed over live reporters (KV usage derived from the sums)."""
        totals: defaultdict[SeriesKey, float] = defaultdict(float)
        roles: defaultdict[str, int] = defaultdict(int)
        for reporter in self.live():
            roles[reporter.role] += 1
            for (name, values, _), value in reporter.gauges.items():
                totals[(name, values)] += value
        for (name, values), blocks in list(totals.items()):
            if name == s.KV_BLOCKS.name:
                used = totals.get((s.KV_USED.name, values), 0.0)
                totals[(s.KV_USAGE.name, values)] = used / blocks if blocks else 0.0
        for role, count in roles.items():
            totals[(s.REPORTERS.name, (role,))] = count
        return dict(totals)

    def by_reporter(self, role: str) -> dict[str, dict[str, float]]:
        """Each live reporter of `role` (one per replica): its counters' totals (histograms'
        observation counts as NAME_count) and its gauges, every label summed, by series name."""
        found, now = {}, self._clock()
        for reporter_id, reporter in self._reporters.items():
            if reporter.role == role and now - reporter.seen <= self.stale_s:
                values = defaultdict(float, self._counts[reporter_id])
                for (name, _, _), value in reporter.gauges.items():
                    values[name] += value
                found[reporter_id] = dict(values)
        return found

    def gateway_states(self) -> list[GatewayState]:
        return [r.gateway for r in self.live() if r.gateway is not None]

    def _filed(self, key: Key) -> list[tuple[Store, SeriesKey]]:
        """Where an increment goes in each view (a series unknown here, from a newer replica, nowhere)."""
        name, values, adapter = key
        series = s.CATALOG.get(name)
        if series is None or series.kind == "gauge":
            return []
        if not series.has_adapter:
            keys = [(self.stores["full"], (name, values))]
            return keys if series.full_only else [*keys, (self.stores["public"], (name, values))]
        full, public = self._adapter_labels(adapter)
        return [(self.stores["full"], (name, (*values, full))), (self.stores["public"], (name, (*values, public)))]

    def _adapter_labels(self, adapter: AdapterTag | None) -> tuple[str, str]:
        """The adapter label in the full view and in the public one."""
        if adapter is None:
            return s.NO_ADAPTER, s.NO_ADAPTER
        name, public = adapter
        if name in (s.BASE, s.NO_ADAPTER):
            return name, name
        label = self.labels.label(name)
        return label, label if public else s.OTHER
