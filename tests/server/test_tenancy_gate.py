"""The ingress's per-tenant gate: concurrent_requests held and given back with the admission
place (streams included), tokens_per_minute over a sliding 60 s window (a settable clock),
each replica's share of a quota, and the refusal counted by tenant and quota."""
from __future__ import annotations

import pytest

from adapterserve.adapters_store.tenants import OPEN_CALLER, Caller, Quotas
from adapterserve.errors import Overloaded, QuotaExceeded
from adapterserve.server.admission import Admission
from adapterserve.server.metrics import series
from adapterserve.server.metrics.calls import CallMetrics
from adapterserve.server.quotas import TenantGate, TokenWindow, count_refusal
from adapterserve.server.settings import DEFAULTS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _caller(**quotas) -> Caller:
    return Caller("acme", frozenset({"use"}), Quotas(**quotas))


def test_concurrent_requests_are_refused_past_the_quota_and_given_back_with_the_place():
    gate, admission = TenantGate(), Admission(max_in_flight=10, max_health_watches=1)
    caller = _caller(concurrent_requests=2)
    places = [admission.take(gate.enter(caller, "Generate")) for _ in range(2)]
    with pytest.raises(QuotaExceeded) as info:
        gate.enter(caller, "ListAdapters")  # every call counts, not only generation
    assert str(info.value) == "tenant acme: concurrent_requests 2 reached (2 in flight); retry when one ends"
    assert (info.value.quota, info.value.retry_after_s) == ("concurrent_requests", 1.0)
    assert gate.enter(Caller("other", frozenset({"use"}), Quotas(concurrent_requests=1)), "Generate")
    stream = places[0].hand_over()  # a stream takes its place (and the tenant's) over
    places[0].release()
    assert gate.usage("acme") == (2, 0)
    stream.release()
    places[1].release()
    places[1].release()  # a second release gives nothing back twice
    assert gate.usage("acme") == (0, 0) and admission.in_flight == 0


def test_a_call_the_server_sheds_gives_its_tenant_place_back():
    gate, admission = TenantGate(), Admission(max_in_flight=0, max_health_watches=1)
    with pytest.raises(Overloaded, match="at capacity"):
        admission.take(gate.enter(_caller(concurrent_requests=1), "Generate"))
    assert gate.usage("acme") == (0, 0)


def test_open_mode_and_tenants_without_quotas_are_never_refused():
    gate = TenantGate()
    holds = [gate.enter(c, "Generate") for c in (OPEN_CALLER, _caller()) for _ in range(50)]
    gate.count_tokens(None, 10**9)
    assert len(holds) == 100 and gate.usage(None) == (0, 0)


def test_tokens_per_minute_is_a_sliding_window_with_retry_advice():
    clock = Clock()
    gate, caller = TenantGate(clock=clock), _caller(tokens_per_minute=100)
    gate.count_tokens("acme", 30)
    clock.now += 20
    gate.count_tokens("acme", 75)
    assert gate.usage("acme")[1] == 105
    gate.enter(caller, "ListAdapters").release()  # no token call: not refused
    with pytest.raises(QuotaExceeded) as info:
        gate.enter(caller, "completions")
    assert str(info.value) == "tenant acme: tokens_per_minute 100 reached (105 in the last 60 s); retry after 40 s"
    assert info.value.retry_after_s == 40.0  # when the first 30 leave the window
    clock.now += 40
    assert gate.usage("acme")[1] == 75
    gate.enter(caller, "Generate").release()


@pytest.mark.parametrize("replicas, share", [(1, 10), (2, 5), (3, 4), (20, 1)])
def test_each_ingress_replica_enforces_its_share(replicas, share):
    gate = TenantGate(replicas)
    caller = _caller(concurrent_requests=10)
    for _ in range(share):
        gate.enter(caller, "Generate")
    with pytest.raises(QuotaExceeded) as info:
        gate.enter(caller, "Generate")
    where = "" if replicas == 1 else f" at this ingress replica, whose share is {share}"
    assert str(info.value) == (f"tenant acme: concurrent_requests 10 reached ({share} in flight{where}); "
                               "retry when one ends")


def test_the_window_forgets_tokens_older_than_a_minute():
    clock = Clock()
    window = TokenWindow(clock)
    for _ in range(120):
        window.add(1)
        clock.now += 1
    assert window.total() == 59 and len(window._buckets) == 59  # seconds 1061..1119 of (1060, 1120]
    assert window.seconds_until_below(59) == 1.0 and window.seconds_until_below(1) == 59.0


def test_refusals_are_counted_by_tenant_and_quota():
    metrics = CallMetrics(None, DEFAULTS["metrics"])
    count_refusal(metrics, "acme", QuotaExceeded("x", "tokens_per_minute", 3.0))
    count_refusal(metrics, "acme", Overloaded("the server's own shedding"))
    count_refusal(metrics, None, QuotaExceeded("x", "adapters"))
    counters = metrics.reporter.recorder._counters
    assert {k: v for k, v in counters.items() if k[0] == series.TENANT_QUOTA_REFUSALS.name} == {
        (series.TENANT_QUOTA_REFUSALS.name, ("acme", "tokens_per_minute"), None): 1.0}
