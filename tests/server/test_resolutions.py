"""The ingress's cache of adapter resolutions (server/resolutions.py): hits within the TTL
for the same store view only, nothing kept once a name is published or deleted here, a
bounded size, and off at TTL 0. The clock is the module's time.monotonic, stepped by hand."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.server import resolutions
from adapterserve.server.resolutions import Resolutions


def _version(name: str, number: int, tenant: str | None = None) -> AdapterVersion:
    return AdapterVersion(name, number, f"{name}{number}".ljust(64, "0"), tenant, False,
                          datetime.now(timezone.utc), 10, ("adapter_config.json",))


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(resolutions.time, "monotonic", lambda: now[0])
    return now


def test_hit_within_ttl_for_the_same_view_only(clock):
    cache = Resolutions(5.0)
    mine = _version("sql", 2, tenant="acme")
    cache.put("sql", "acme", mine)
    assert cache.get("sql", "acme") is mine
    assert cache.get("sql", "globex") is None  # another tenant never gets acme's resolution
    assert cache.get("sql", None) is None  # nor does an admin view
    assert cache.get("sql@2", "acme") is None  # a ref is its own key
    clock[0] += 4.9
    assert cache.get("sql", "acme") is mine
    clock[0] += 0.2
    assert cache.get("sql", "acme") is None


def test_forget_drops_every_ref_of_the_name_in_every_view(clock):
    cache = Resolutions(60.0)
    for ref, view in (("sql", "acme"), ("sql@1", "acme"), ("sql@3", None), ("sqlx", "acme"), ("sqlx@1", None)):
        cache.put(ref, view, _version(ref.partition("@")[0], 1))
    cache.forget("sql")
    assert [cache.get(r, v) for r, v in (("sql", "acme"), ("sql@1", "acme"), ("sql@3", None))] == [None] * 3
    assert cache.get("sqlx", "acme") is not None and cache.get("sqlx@1", None) is not None


def test_ttl_zero_keeps_nothing_and_negative_is_refused(clock):
    off = Resolutions(0.0)
    off.put("sql", None, _version("sql", 1))
    assert off.get("sql", None) is None
    with pytest.raises(ValueError, match="resolve_ttl_s"):
        Resolutions(-1.0)


def test_size_is_bounded_oldest_first(clock):
    cache = Resolutions(60.0, max_entries=3)
    for n in range(1, 5):
        cache.put(f"a{n}", None, _version(f"a{n}", 1))
    assert cache.get("a1", None) is None
    assert all(cache.get(f"a{n}", None) is not None for n in (2, 3, 4))
