"""The metrics hub's arithmetic without Ray: batches of several replicas summed, batches sent
twice applied once, stopped replicas' counts kept, the adapter label's top N (names given,
frozen, dropped) with every counter only growing, the public view, an engine restart, and
the reporter sending again what did not arrive. Scrapes are read with prometheus_client's
parser."""
from __future__ import annotations

import asyncio
import random

import pytest

from adapterserve.engine.stats import Histogram
from adapterserve.server.engine_process.report import EngineReport
from adapterserve.server.metrics import series as s
from adapterserve.server.metrics.aggregate import Aggregate
from adapterserve.server.metrics.batch import MetricsBatch
from adapterserve.server.metrics.exposition import render
from adapterserve.server.metrics.labels import AdapterLabels
from adapterserve.server.metrics.recorder import BASE_TAG, Recorder
from adapterserve.server.metrics.replica_metrics import ReplicaMetrics
from adapterserve.server.metrics.reporter import Reporter
from adapterserve.server.metrics.settings import check_metrics
from adapterserve.server.settings import DEFAULTS
from tests.helpers.scrape import Scrape, parse


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _hub(limit: int = 2, clock: Clock | None = None, refresh_s: float = 60.0, keep_s: float = 600.0) -> Aggregate:
    clock = clock or Clock()
    return Aggregate(AdapterLabels(limit, refresh_s, keep_s=keep_s, clock=clock), stale_s=5.0, clock=clock)


def _batch(reporter: str, seq: int, recorder: Recorder, gauges: dict | None = None, role: str = "ingress"):
    counters, histograms = recorder.take()
    return MetricsBatch(reporter, role, seq, counters, histograms, gauges or {})


def _calls(adapter: tuple[str, bool], n: int = 1, code: str = "OK") -> Recorder:
    recorder = Recorder()
    for _ in range(n):
        recorder.inc(s.REQUESTS, ("Generate", code), adapter)
        recorder.observe(s.TTFT, 0.02, adapter=adapter)
    return recorder


def _scrape(hub: Aggregate, view: str = "full") -> Scrape:
    return parse(render(hub, view).decode())


def test_two_replicas_are_summed_and_a_batch_sent_twice_counts_once():
    hub = _hub()
    first = _batch("ingress-a", 0, _calls(("sql", True), 3))
    assert hub.apply(first)
    assert hub.apply(_batch("ingress-b", 0, _calls(("sql", True), 2)))
    assert not hub.apply(first), "the same number again: already applied"
    found = _scrape(hub)
    assert found.total("adapterserve_requests_total", adapter="sql") == 5
    assert found.total("adapterserve_time_to_first_token_seconds_count", adapter="sql") == 5
    assert found.total("adapterserve_time_to_first_token_seconds_bucket", adapter="sql", le="0.025") == 5


def test_a_stopped_replica_keeps_its_counts_and_its_gauges_go():
    clock = Clock()
    hub = _hub(clock=clock)
    gauges = {(s.RUNNING.name, ("m",), None): 3.0, (s.KV_BLOCKS.name, ("m",), None): 64.0,
              (s.KV_USED.name, ("m",), None): 16.0}
    hub.apply(_batch("engine-a", 0, _calls(BASE_TAG, 4), gauges, role="model"))
    hub.apply(_batch("engine-b", 0, Recorder(), gauges, role="model"))
    found = _scrape(hub)
    assert found.total("adapterserve_running_requests", backbone="m") == 6
    assert found.total("adapterserve_kv_cache_usage_ratio", backbone="m") == 0.25
    assert found.total("adapterserve_metrics_reporters", role="model") == 2
    clock.now += 6.0  # engine-a stops; engine-b goes on
    hub.apply(_batch("engine-b", 1, Recorder(), gauges, role="model"))
    found = _scrape(hub)
    assert found.total("adapterserve_running_requests", backbone="m") == 3
    assert found.total("adapterserve_metrics_reporters", role="model") == 1
    assert found.total("adapterserve_requests_total", adapter="_base") == 4, "its counts stay in the totals"


def test_the_first_n_adapters_keep_their_names_and_the_rest_count_as_other():
    hub = _hub(limit=2)
    for seq, name in enumerate(["a", "b", "c", "d", "a"]):
        hub.apply(_batch("i", seq, _calls((name, True))))
    found = _scrape(hub)
    assert found.label_values("adapterserve_requests_total", "adapter") == {"a", "b", "_other"}
    assert found.total("adapterserve_requests_total", adapter="a") == 2
    assert found.total("adapterserve_requests_total", adapter="_other") == 2


def test_a_hotter_adapter_takes_the_coldest_name_its_old_series_freeze_then_end():
    clock = Clock()
    hub = _hub(limit=1, clock=clock)
    hub.apply(_batch("i", 0, _calls(("old", True), 2)))
    hub.apply(_batch("i", 1, _calls(("new", True), 10)))  # no name yet: under _other
    clock.now += 61.0  # the table is revised: new has over 1.5x old's traffic
    hub.apply(_batch("i", 2, _calls(("old", True), 1)))
    hub.apply(_batch("i", 3, _calls(("new", True), 1)))
    found = _scrape(hub)
    assert found.total("adapterserve_requests_total", adapter="new") == 1, "counts from its naming on"
    assert found.total("adapterserve_requests_total", adapter="old") == 2, "frozen: no longer grows"
    assert found.total("adapterserve_requests_total", adapter="_other") == 11
    clock.now += 601.0  # kept long enough for every scraper: then dropped
    hub.apply(_batch("i", 4, Recorder()))
    found = _scrape(hub)
    assert found.label_values("adapterserve_requests_total", "adapter") == {"new", "_other"}


def test_every_counter_only_grows_while_names_rotate():
    """Random traffic over many revisions of a small table: between two scrapes no series
    goes down, the growing names stay within N, and nothing is lost or counted twice: the
    series of all adapters add up to the calls made (frozen series are kept here)."""
    rng = random.Random(7)
    clock = Clock()
    hub = _hub(limit=3, clock=clock, refresh_s=10.0, keep_s=1e9)
    names = [f"a{i}" for i in range(12)]
    made, earlier = 0, None
    for seq in range(400):
        weights = [rng.random() ** 3 for _ in names]  # the hot set shifts
        recorder = Recorder()
        for name in rng.choices(names, weights, k=rng.randint(1, 6)):
            recorder.inc(s.REQUESTS, ("Generate", "OK"), (name, rng.random() < 0.5))
            made += 1
        hub.apply(_batch("i", seq, recorder))
        clock.now += rng.uniform(0.5, 8.0)
        current = {view: _scrape(hub, view) for view in ("full", "public")}
        for view, found in current.items():
            if earlier is not None:
                for key, value in earlier[view].samples.items():
                    if key[0].startswith("adapterserve_requests"):
                        assert found.samples.get(key, 0.0) >= value, key
            assert found.total("adapterserve_requests_total") == made
        assert len(hub.labels.named) <= 3
        earlier = current
    assert len(hub.labels.frozen) > 3, "the table did rotate"


def test_the_public_view_shows_public_adapters_only_and_no_tenant():
    hub = _hub(limit=4)
    recorder = _calls(("private-one", False), 2)
    recorder.inc(s.REQUESTS, ("Generate", "OK"), ("shared", True))
    recorder.inc(s.TENANT_REQUESTS, ("alice", "OK"))
    hub.apply(_batch("i", 0, recorder))
    public, full = _scrape(hub, "public"), _scrape(hub)
    assert public.label_values("adapterserve_requests_total", "adapter") == {"shared", "_other"}
    assert public.total("adapterserve_requests_total", adapter="_other") == 2
    assert full.total("adapterserve_requests_total", adapter="private-one") == 2
    assert full.total("adapterserve_tenant_requests_total", tenant="alice") == 1
    assert not [n for n in public.names() if "tenant" in n]


def test_every_sample_is_documented_and_typed():
    hub = _hub()
    hub.apply(_batch("i", 0, _calls(("x", True), 2)))
    found = _scrape(hub)
    assert found.names() <= s.exported_names()
    assert found.types["adapterserve_requests"] == "counter"
    assert found.types["adapterserve_time_to_first_token_seconds"] == "histogram"


def _report(engine_id: str, loads: int, steps: int, running: int = 1) -> EngineReport:
    from adapterserve.engine.stats import EngineStats

    stats = EngineStats()
    for _ in range(steps):
        stats.step_seconds.observe(0.01)
    return EngineReport(engine_id, running, 0, 64, 8, 16, 4, 2, 0, loads, 0, 0, ("sql@1#0",), (), stats.snapshot())


def test_an_engine_restart_counts_from_zero_and_no_total_goes_down():
    reports = iter([_report("e1", 3, 5), _report("e1", 4, 9), _report("e2", 1, 2)])

    async def engine_report():
        return next(reports)

    metrics = ReplicaMetrics(None, "model", "m", 1.0, engine_report)
    hub = _hub()
    totals = []
    for seq in range(3):
        gauges, gateway = asyncio.run(metrics._gauges())
        counters, histograms = metrics.recorder.take()
        hub.apply(MetricsBatch("engine", "model", seq, counters, histograms, gauges, gateway))
        found = _scrape(hub)
        totals.append((found.total("adapterserve_adapter_slot_loads_total"),
                       found.total("adapterserve_engine_step_seconds_count")))
    assert totals == [(3, 5), (4, 9), (5, 11)]


class _Transport:
    """Serve's handle to the hub, as far as the reporter uses it, failing the first sends."""

    def __init__(self, hub: Aggregate, failures: int) -> None:
        self.hub, self.failures = hub, failures
        self.report = self

    def remote(self, batch: MetricsBatch):
        async def send():
            self.hub.apply(batch)  # arrived...
            if self.failures:
                self.failures -= 1
                raise ConnectionError("the answer was lost")  # ...but the sender cannot know
        return send()


def test_a_batch_whose_answer_was_lost_is_sent_again_and_counted_once():
    hub = _hub()
    reporter = Reporter(_Transport(hub, failures=2), "ingress", 1.0)

    async def run() -> list[bool]:
        sent = []
        for _ in range(4):
            reporter.recorder.inc(s.REQUESTS, ("Generate", "OK"), BASE_TAG)
            sent.append(await reporter.push())
        return sent

    assert asyncio.run(run()) == [False, False, True, True]
    assert _scrape(hub).total("adapterserve_requests_total") == 4


def test_histogram_values_subtract_and_add_back():
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 9.0):
        h.observe(v)
    earlier = h.value()
    h.observe(2.0)
    since = h.value().minus(earlier)
    assert (since.counts, since.count, since.sum) == ((0, 1, 0), 1, 2.0)
    assert earlier.counts == (2, 1, 1)


@pytest.mark.parametrize("key, value, says", [
    ("http_route", "private", "metrics.http_route"),
    ("port", 0, "metrics.port"),
    ("port", "9100", "metrics.port"),
    ("adapter_labels", -1, "metrics.adapter_labels"),
    ("adapter_labels", True, "metrics.adapter_labels"),
    ("push_interval_s", 0, "metrics.push_interval_s"),
    ("label_refresh_s", float("nan"), "metrics.label_refresh_s"),
    ("host", "", "metrics.host"),
])
def test_bad_metrics_settings_are_refused_naming_the_key(key, value, says):
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        check_metrics({**DEFAULTS["metrics"], key: value})
