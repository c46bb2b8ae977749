"""An evicted adapter stays registered until its last request releases it."""
from __future__ import annotations

from adapterserve.server.loaded import LoadedAdapter


def _adapter():
    unloaded = []
    return LoadedAdapter("a#0", unloaded.append), unloaded


def test_idle_adapter_unloads_on_eviction():
    adapter, unloaded = _adapter()
    adapter.evict()
    assert unloaded == [adapter]
    assert not adapter.acquire(), "an unloaded adapter must be loaded again"


def test_eviction_waits_for_the_last_user():
    adapter, unloaded = _adapter()
    assert adapter.acquire() and adapter.acquire()
    adapter.evict()
    adapter.release()
    assert unloaded == []
    adapter.release()
    assert unloaded == [adapter]
    adapter.evict()
    adapter.__del__()
    assert unloaded == [adapter], "unloads exactly once"


def test_release_without_eviction_keeps_it():
    adapter, unloaded = _adapter()
    assert adapter.acquire()
    adapter.release()
    assert unloaded == [] and adapter.acquire()


def test_unload_if_idle_leaves_a_used_adapter():
    adapter, unloaded = _adapter()
    assert adapter.acquire()
    assert not adapter.unload_if_idle() and unloaded == []
    adapter.release()
    assert unloaded == [], "not evicted: the release keeps it"
    assert adapter.unload_if_idle() and unloaded == [adapter]
    assert not adapter.unload_if_idle() and not adapter.acquire()
