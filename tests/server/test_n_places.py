"""A generation of n choices holds n places: at the ingress (max_in_flight) and in its tenant's
concurrent_requests; a refusal leaves every count as it was, and the release gives back all."""
import pytest

from adapterserve.adapters_store.tenants import Caller, Quotas
from adapterserve.errors import Overloaded, QuotaExceeded, RequestError
from adapterserve.server.admission import Admission
from adapterserve.server.quotas import TenantGate


def _caller(concurrent: int | None) -> Caller:
    return Caller("busy", frozenset({"use"}), Quotas(concurrent_requests=concurrent))


def test_a_place_widens_to_n_and_gives_all_back():
    admission, gate = Admission(max_in_flight=8, max_health_watches=1), TenantGate()
    place = admission.take(gate.enter(_caller(4), "Generate"))
    place.widen(3)
    assert admission.in_flight == 3 and gate.usage("busy")[0] == 3
    handed = place.hand_over()
    handed.release()
    assert admission.in_flight == 0 and gate.usage("busy")[0] == 0


def test_n_over_the_tenants_quota_is_a_bad_request_and_over_what_is_free_now_waits():
    admission, gate = Admission(max_in_flight=8, max_health_watches=1), TenantGate()
    other = admission.take(gate.enter(_caller(3), "Generate"))
    place = admission.take(gate.enter(_caller(3), "Generate"))
    with pytest.raises(RequestError, match=r"'n' is 4, but tenant busy may run 3 requests at once"):
        place.widen(4)
    with pytest.raises(QuotaExceeded, match="concurrent_requests 3 reached"):
        place.widen(3)  # fits the quota, but the other call holds one of its places
    assert admission.in_flight == 2 and gate.usage("busy")[0] == 2
    other.release()
    place.widen(3)
    assert admission.in_flight == 3 and gate.usage("busy")[0] == 3
    place.release()
    assert admission.in_flight == 0 and gate.usage("busy")[0] == 0


def test_n_over_the_ingress_limit():
    admission = Admission(max_in_flight=4, max_health_watches=1)
    busy = admission.take()
    place = admission.take()
    with pytest.raises(RequestError, match=r"'n' is 5, but this ingress replica holds at most 4"):
        place.widen(5)
    with pytest.raises(Overloaded):
        place.widen(4)
    assert admission.in_flight == 2
    busy.release()
    place.widen(4)
    assert admission.in_flight == 4


def test_an_open_server_counts_no_tenant():
    admission, gate = Admission(max_in_flight=8, max_health_watches=1), TenantGate()
    place = admission.take(gate.enter(Caller(None, frozenset({"use"}), Quotas()), "Generate"))
    place.widen(5)
    assert admission.in_flight == 5
    place.release()
    assert admission.in_flight == 0
