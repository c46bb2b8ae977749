"""Adapter-affinity routing's choices (routing.py) and its settings (routing_settings.py);
the served behaviour on two replicas is test_routing_served.py's."""
from __future__ import annotations

import pytest

from adapterserve.server.routing import RecentRoutes, home, rank_replicas
from adapterserve.server.routing_settings import Routing, routing_of
from adapterserve.server.settings import merge_config

REPLICAS = ["a", "b", "c"]


def _ranks(holders: set[str], depths: dict[str, int | None], spill: int = 4, adapter: str = "x") -> list[list[str]]:
    return rank_replicas(REPLICAS, lambda r: r, adapter, holders, lambda r: depths.get(r), spill)


def test_holders_below_the_threshold_come_first_then_any_replica_with_room():
    assert _ranks({"b"}, {"a": 0, "b": 3, "c": 1}) == [["b"], ["a", "b", "c"], ["b"], REPLICAS]


def test_a_saturated_holder_spills_to_replicas_with_room_then_holders_when_all_are_full():
    assert _ranks({"b"}, {"a": 0, "b": 4, "c": 9}) == [["a"], ["b"], REPLICAS]
    assert _ranks({"a", "b"}, {"a": 5, "b": 4, "c": 4}) == [["a", "b"], REPLICAS]


def test_an_unknown_queue_depth_counts_as_room():
    assert _ranks({"c"}, {"a": 7, "b": 7})[0] == ["c"]


def test_requests_without_an_adapter_go_to_the_least_loaded_of_all():
    assert _ranks(set(), {"a": 9, "b": 9, "c": 9}, adapter="") == [REPLICAS]


def test_an_adapter_no_replica_holds_has_one_home_with_room():
    homes = {adapter: _ranks(set(), {}, adapter=adapter)[0] for adapter in (f"adapter-{i}" for i in range(60))}
    assert all(len(first) == 1 for first in homes.values())
    assert {first[0] for first in homes.values()} == set(REPLICAS)  # spread over the replicas
    assert all(home(a, REPLICAS, lambda r: r) == first[0] for a, first in homes.items())  # the same every time
    assert home("adapter-0", ["b", "c", "a"], lambda r: r) == homes["adapter-0"][0]  # whatever the order
    full = homes["adapter-0"][0]
    assert _ranks(set(), {full: 4}, adapter="adapter-0")[0] != [full]  # a saturated home is passed over


def test_recent_routes_are_remembered_for_a_while_then_forgotten():
    now = [0.0]
    recent = RecentRoutes(memory_s=10, max_adapters=2, clock=lambda: now[0])
    recent.sent("x", "a")
    now[0] = 5
    recent.sent("x", "b")
    assert recent.replicas("x") == {"a", "b"}
    now[0] = 12
    assert recent.replicas("x") == {"b"}
    recent.forget_replica("b")
    assert recent.replicas("x") == set()


def test_recent_routes_keep_the_latest_adapters_only():
    recent = RecentRoutes(max_adapters=2)
    for adapter in ("x", "y", "z"):
        recent.sent(adapter, "a")
    assert [recent.replicas(a) for a in ("x", "y", "z")] == [set(), {"a"}, {"a"}]


def test_the_default_is_adapter_affinity_spilling_at_a_full_batch():
    assert routing_of(merge_config()["routing"], max_num_seqs=64) == Routing("adapter", 64)
    assert routing_of({"mode": "pow2", "spill_queue_depth": 3}, 64) == Routing("pow2", 3)


@pytest.mark.parametrize("routing, says", [
    ({"mode": "random", "spill_queue_depth": None}, "routing.mode must be one of adapter, pow2, got 'random'"),
    ({"mode": None, "spill_queue_depth": None}, "routing.mode must be one of adapter, pow2, got None"),
    ({"mode": "adapter", "spill_queue_depth": 0}, "routing.spill_queue_depth must be an integer >= 1"),
    ({"mode": "adapter", "spill_queue_depth": 2.5}, "got 2.5"),
    ({"mode": "adapter", "spill_queue_depth": True}, "got True"),
])
def test_bad_routing_settings_are_refused_naming_the_setting(routing, says):
    with pytest.raises(ValueError) as refused:
        routing_of(routing, 8)
    assert says in str(refused.value)


def test_an_unknown_routing_key_is_refused():
    with pytest.raises(ValueError, match="unknown config.routing key 'spill'"):
        merge_config({"routing": {"spill": 3}})


def test_the_app_is_refused_before_anything_starts(tiny_model):
    from adapterserve.server.app import build_app

    with pytest.raises(ValueError, match="routing.mode must be one of"):
        build_app({"model": str(tiny_model), "encoder": False, "routing": {"mode": "round-robin"}})


def test_the_hub_keeps_each_replicas_own_counts():
    """What benchmarks/scale.py and test_routing_served.py read (MetricsHub.by_replica)."""
    from adapterserve.server.metrics import series as s
    from adapterserve.server.metrics.aggregate import Aggregate
    from adapterserve.server.metrics.batch import MetricsBatch
    from adapterserve.server.metrics.labels import AdapterLabels
    from adapterserve.server.metrics.recorder import Recorder

    now = [0.0]
    hub = Aggregate(AdapterLabels(2, 60.0, clock=lambda: now[0]), stale_s=5.0, clock=lambda: now[0])

    def report(replica: str, seq: int, loads: int, requests: int, running: int) -> None:
        recorder = Recorder()
        recorder.inc(s.SLOT_LOADS, ("tiny",), amount=loads)
        for _ in range(requests):
            recorder.observe(s.QUEUE_SECONDS, 0.01, ("tiny",))
        counters, histograms = recorder.take()
        gauges = {(s.RUNNING.name, ("tiny",), None): float(running)}
        assert hub.apply(MetricsBatch(replica, "model", seq, counters, histograms, gauges))

    report("model-a", 0, loads=2, requests=5, running=3)
    report("model-b", 0, loads=1, requests=1, running=0)
    report("model-a", 1, loads=1, requests=2, running=1)
    hub.apply(MetricsBatch("ingress-x", "ingress", 0, {}, {}, {}))
    found = hub.by_reporter("model")
    assert {r: (v[s.SLOT_LOADS.name], v[f"{s.QUEUE_SECONDS.name}_count"], v[s.RUNNING.name])
            for r, v in found.items()} == {"model-a": (3, 7, 1), "model-b": (1, 1, 0)}
    now[0] = 10.0  # nobody reported for longer than stale_s
    assert hub.by_reporter("model") == {}
