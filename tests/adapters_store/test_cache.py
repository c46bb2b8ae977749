"""Host-memory adapter cache: LRU by bytes, one load per content hash, pinning."""
from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapterserve.adapters_store.cache import HostAdapterCache, tensor_nbytes
from adapterserve.adapters_store.formats.types import LoraAdapter, LoraModule
from adapterserve.adapters_store.local import LocalStore
from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.errors import CapacityError


def _version(name: str, content: str | None = None) -> AdapterVersion:
    return AdapterVersion(
        name=name,
        version=1,
        content_hash=content or f"hash-of-{name}",
        tenant=None,
        public=False,
        created_at=datetime.now(timezone.utc),
        size_bytes=0,
        files=(),
    )


class FakeSource:
    """fetch + loader for the cache: a version named 'x40' loads as a 40-byte tensor."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.loads: list[str] = []
        self.delay_s, self.fail = delay_s, fail
        self._lock = threading.Lock()

    def fetch(self, v: AdapterVersion) -> Path:
        return Path("/fetched") / v.name

    def load(self, path: Path) -> torch.Tensor:
        with self._lock:
            self.loads.append(path.name)
        time.sleep(self.delay_s)
        if self.fail:
            raise OSError(f"cannot read {path}")
        return torch.zeros(int(path.name.lstrip("abcdefghijklmnopqrstuvwxyz")), dtype=torch.uint8)

    def cache(self, capacity: int) -> HostAdapterCache:
        return HostAdapterCache(capacity, self.load, fetch=self.fetch)


def test_hits_and_misses_are_counted_and_loads_happen_once():
    src = FakeSource()
    cache = src.cache(100)
    a = cache.get_or_load(_version("a40"))
    assert cache.get_or_load(_version("a40")) is a
    assert src.loads == ["a40"]
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.bytes) == (1, 1, 1, 40)


def test_least_recently_used_bytes_are_evicted_first():
    src = FakeSource()
    cache = src.cache(100)
    a, b = _version("a40"), _version("b40")
    cache.get_or_load(a)
    cache.get_or_load(b)
    cache.get_or_load(a)  # a is now the most recent
    cache.get_or_load(_version("c30"))
    assert a in cache and b not in cache
    cache.get_or_load(_version("d60"))  # needs room for 60: evicts a (40) only
    assert [v.name for v in map(_version, ["a40", "c30", "d60"]) if v in cache] == ["c30", "d60"]
    assert cache.stats().bytes == 90 and cache.stats().evictions == 2


def test_concurrent_callers_share_one_load():
    src = FakeSource(delay_s=0.2)
    cache = src.cache(100)
    results, barrier = [], threading.Barrier(8)

    def call():
        barrier.wait()
        results.append(cache.get_or_load(_version("a40")))

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert src.loads == ["a40"]
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert cache.stats().misses == 1 and cache.stats().hits == 7


def test_a_failed_load_reaches_every_waiter_and_is_not_cached():
    src = FakeSource(delay_s=0.2, fail=True)
    cache = src.cache(100)
    errors, barrier = [], threading.Barrier(4)

    def call():
        barrier.wait()
        try:
            cache.get_or_load(_version("a40"))
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4 and src.loads == ["a40"]
    src.fail, src.delay_s = False, 0.0
    assert cache.get_or_load(_version("a40")).numel() == 40  # retried, not a cached failure


def test_pinned_entries_are_not_evicted():
    src = FakeSource()
    cache = src.cache(100)
    a = _version("a60")
    cache.get_or_load(a, pin=True)
    with pytest.raises(CapacityError, match="pinned"):
        cache.get_or_load(_version("b60"))
    assert a in cache and _version("b60") not in cache
    cache.get_or_load(_version("c40"))
    cache.unpin(a)
    cache.get_or_load(_version("b60"))  # now a can go
    assert a not in cache
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin(_version("b60"))
    with pytest.raises(KeyError):
        cache.pin(a)


def test_pin_and_unpin_are_counted():
    src = FakeSource()
    cache = src.cache(100)
    a = _version("a60")
    cache.get_or_load(a)
    cache.pin(a)
    cache.pin(a)
    cache.unpin(a)
    assert not cache.discard(a)  # still pinned once
    cache.unpin(a)
    assert cache.discard(a) and a not in cache


def test_an_adapter_larger_than_the_cache_is_refused():
    cache = FakeSource().cache(100)
    with pytest.raises(CapacityError, match="more than the whole host cache"):
        cache.get_or_load(_version("a101"))
    assert cache.stats().entries == 0


def test_versions_with_equal_content_share_an_entry():
    src = FakeSource()
    cache = src.cache(100)
    cache.get_or_load(_version("a40", content="same"))
    cache.get_or_load(_version("b40", content="same"))
    assert src.loads == ["a40"]


def test_default_size_counts_each_tensor_once():
    a, b = torch.zeros(4, 8), torch.zeros(8, 4, dtype=torch.float16)
    adapter = LoraAdapter({(0, "q_proj"): LoraModule(a, b, 2.0), (1, "q_proj"): LoraModule(a, b, 2.0)})
    assert tensor_nbytes(adapter) == 4 * 8 * 4 + 8 * 4 * 2
    assert tensor_nbytes({"x": [a, (a,)], "y": None}) == 128


def test_with_a_real_store_and_loader(tmp_path, adapter_dir):
    store = LocalStore(tmp_path / "store")
    v = store.publish("a", adapter_dir(0), tenant=None)
    cache = HostAdapterCache(1 << 20, lambda p: load_file(p / "adapter_model.safetensors"), fetch=store.fetch)
    tensors = cache.get_or_load(v)
    assert set(tensors) == {
        "base_model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.layers.0.self_attn.q_proj.lora_B.weight",
    }
    assert cache.stats().bytes == 2 * 16 * 4
