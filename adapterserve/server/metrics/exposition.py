"""The hub's totals in Prometheus' text format (prometheus_client writes it: names, escaping)."""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from adapterserve.engine.stats import Histogram
from adapterserve.server.metrics.aggregate import Aggregate
from adapterserve.server.metrics.gateway import gateway_families
from adapterserve.server.metrics.series import CATALOG, Series

CONTENT_TYPE = CONTENT_TYPE_LATEST


def render(aggregate: Aggregate, view: str) -> bytes:
    """Every series of `view` ("full" or "public"), then the gateway's gauges."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(families(aggregate, view)))
    return generate_latest(registry)


def families(aggregate: Aggregate, view: str) -> list[Metric]:
    aggregate.tidy()
    store, gauges = aggregate.stores[view], aggregate.gauges()
    values: defaultdict[str, list[tuple[tuple[str, ...], object]]] = defaultdict(list)
    for table in (store.counters, store.histograms, gauges):
        for (name, labels), value in table.items():
            values[name].append((labels, value))
    found = [_family(series, sorted(values[series.name], key=lambda sample: sample[0])) for series in CATALOG.values()
             if not (series.full_only and view != "full")]
    public_only = view != "full"
    return found + gateway_families(aggregate.gateway_states(), public_only, time.time())


def _family(series: Series, samples: list[tuple[tuple[str, ...], object]]) -> Metric:
    labels = list(series.labels)
    if series.kind == "counter":
        family = CounterMetricFamily(series.name, series.help, labels=labels)
        for values, amount in samples:
            family.add_metric(list(values), amount)
    elif series.kind == "gauge":
        family = GaugeMetricFamily(series.name, series.help, labels=labels)
        for values, amount in samples:
            family.add_metric(list(values), amount)
    else:
        family = HistogramMetricFamily(series.name, series.help, labels=labels)
        for values, histogram in samples:
            buckets, total = _cumulative(histogram)
            family.add_metric(list(values), buckets, total)
    return family


def _cumulative(histogram: Histogram) -> tuple[list[tuple[str, float]], float]:
    value = histogram.value()
    bounds = [floatToGoString(b) for b in value.bounds] + ["+Inf"]
    running, buckets = 0, []
    for bound, count in zip(bounds, value.counts):
        running += count
        buckets.append((bound, running))
    return buckets, value.sum


class _Collector:
    def __init__(self, found: list[Metric]) -> None:
        self._found = found

    def collect(self) -> Iterator[Metric]:
        return iter(self._found)
