"""What one replica observed since its last report: counter increments and histogram
observations, keyed by series, label values and adapter. Cheap to record into (a dict
update under a lock); the reporter takes the deltas about once a second.

Adapters are recorded by name with their visibility, never by label: the hub decides
which names the `adapter` label shows (labels.py), the same for every replica.

    recorder.inc(series.REQUESTS, ("Generate", "OK"), adapter=("sql", False))
    recorder.observe(series.TTFT, 0.031, adapter=BASE_TAG)
    counters, histograms = recorder.take()
"""
from __future__ import annotations

import threading
from collections import defaultdict

from adapterserve.engine.stats import Histogram, HistogramValue
from adapterserve.server.metrics.series import BASE, NO_ADAPTER, Series

AdapterTag = tuple[str, bool]  # (adapter name, or BASE / NO_ADAPTER; whether every tenant may use it)
Key = tuple[str, tuple[str, ...], "AdapterTag | None"]  # series name, label values but the adapter's, adapter
BASE_TAG: AdapterTag = (BASE, True)
NO_ADAPTER_TAG: AdapterTag = (NO_ADAPTER, True)


class Recorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # adapter evictions are recorded from Serve's threads
        self._counters: defaultdict[Key, float] = defaultdict(float)
        self._histograms: dict[Key, Histogram] = {}

    def inc(self, series: Series, values: tuple[str, ...] = (), adapter: AdapterTag | None = None,
            amount: float = 1.0) -> None:
        if amount > 0:
            with self._lock:
                self._counters[(series.name, values, adapter)] += amount

    def observe(self, series: Series, value: float, values: tuple[str, ...] = (),
                adapter: AdapterTag | None = None) -> None:
        with self._lock:
            self._histogram(series, (series.name, values, adapter)).observe(value)

    def add(self, series: Series, observed: HistogramValue, values: tuple[str, ...] = ()) -> None:
        """Observations counted elsewhere (an engine's, since its previous report)."""
        if observed.count:
            with self._lock:
                self._histogram(series, (series.name, values, None)).add(observed)

    def take(self) -> tuple[dict[Key, float], dict[Key, HistogramValue]]:
        """Everything recorded since the previous take."""
        with self._lock:
            counters, histograms = dict(self._counters), self._histograms
            self._counters, self._histograms = defaultdict(float), {}
        return counters, {key: h.value() for key, h in histograms.items()}

    def _histogram(self, series: Series, key: Key) -> Histogram:
        found = self._histograms.get(key)
        if found is None:
            found = self._histograms[key] = Histogram(series.bounds)
        return found
