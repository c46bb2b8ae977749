"""Host-memory tier between the adapter store and the GPU slots.

Maps a content hash to whatever `loader(path)` made of the fetched files (for
example a LoraAdapter of CPU tensors). Least-recently-used entries are evicted
when the loaded bytes would exceed `capacity_bytes`; pinned entries (being
copied to a GPU slot, say) are never evicted. Concurrent callers asking for
the same hash share one fetch and one load. Versions with equal content share
an entry.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.errors import CapacityError

T = TypeVar("T")


def tensor_nbytes(obj: Any) -> int:
    """Bytes of the distinct tensors reachable from `obj` (through containers, dataclasses, attributes)."""
    torch = sys.modules.get("torch")  # not imported yet: no tensor exists (this module leaves it unimported)
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if torch is not None and isinstance(x, torch.Tensor):
            total += x.nbytes
        elif isinstance(x, dict):
            stack += x.values()
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack += x
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack += [getattr(x, f.name) for f in dataclasses.fields(x)]
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            stack += vars(x).values()
    return total


def host_copy_bytes(adapter: Any) -> int:
    """Bytes of an adapter's host copy, without the loading copies an engine stages on it
    (its `staged` field, bounded by the engine's max_staged_bytes)."""
    if dataclasses.is_dataclass(adapter) and getattr(adapter, "staged", None):
        adapter = dataclasses.replace(adapter, staged={})
    return tensor_nbytes(adapter)


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    capacity_bytes: int


@dataclass
class _Entry(Generic[T]):
    value: T
    size: int
    pins: int = 0


class HostAdapterCache(Generic[T]):
    """LRU-by-bytes cache of loaded adapters, keyed by content hash; thread-safe."""

    def __init__(
        self,
        capacity_bytes: int,
        loader: Callable[[Path], T],
        *,
        fetch: Callable[[AdapterVersion], Path],
        size_of: Callable[[T], int] = tensor_nbytes,
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"host cache capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._loader, self._fetch, self._size_of = loader, fetch, size_of
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()  # oldest use first
        self._loading: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._bytes = self.hits = self.misses = self.evictions = 0

    def get_or_load(self, version: AdapterVersion, *, pin: bool = False) -> T:
        """The loaded adapter, fetching and loading it once if absent; `pin=True` also pins it."""
        key = version.content_hash
        with self._lock:
            if entry := self._entries.get(key):
                self.hits += 1
                self._entries.move_to_end(key)
                entry.pins += pin
                return entry.value
            waiting = self._loading.get(key)
            if waiting is None:
                self.misses += 1
                self._loading[key] = future = Future()
        if waiting is not None:
            waiting.result()  # raises the loader's error for every caller
            return self.get_or_load(version, pin=pin)
        return self._load(version, future, pin)

    def pin(self, version: AdapterVersion) -> None:
        """Keep a cached adapter from eviction until the matching `unpin`."""
        with self._lock:
            self._entry(version).pins += 1

    def unpin(self, version: AdapterVersion) -> None:
        with self._lock:
            entry = self._entry(version)
            if entry.pins == 0:
                raise ValueError(f"{version.ref} is not pinned in the host cache")
            entry.pins -= 1
            self._evict_to(self.capacity_bytes)

    def discard(self, version: AdapterVersion) -> bool:
        """Drop an unpinned entry (say, after its version was deleted); True if dropped."""
        with self._lock:
            entry = self._entries.get(version.content_hash)
            if entry is None or entry.pins:
                return False
            self._remove(version.content_hash)
            return True

    def __contains__(self, version: AdapterVersion) -> bool:
        with self._lock:
            return version.content_hash in self._entries

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                self.hits, self.misses, self.evictions, len(self._entries), self._bytes, self.capacity_bytes
            )

    def _load(self, version: AdapterVersion, future: Future, pin: bool) -> T:
        key = version.content_hash
        try:
            value = self._loader(self._fetch(version))
            size = self._size_of(value)
            with self._lock:
                del self._loading[key]
                self._insert(version, value, size, pin)
        except BaseException as e:
            with self._lock:
                self._loading.pop(key, None)
            future.set_exception(e)
            raise
        future.set_result(None)
        return value

    def _insert(self, version: AdapterVersion, value: T, size: int, pin: bool) -> None:
        if size > self.capacity_bytes:
            raise CapacityError(
                f"adapter {version.ref} takes {size} bytes in host memory, more than the whole host cache "
                f"({self.capacity_bytes} bytes); raise the host cache size"
            )
        self._evict_to(self.capacity_bytes - size)
        if self._bytes + size > self.capacity_bytes:
            raise CapacityError(
                f"host cache is full of pinned adapters; {version.ref} ({size} bytes) does not fit "
                "until some are unpinned"
            )
        self._entries[version.content_hash] = _Entry(value, size, int(pin))
        self._bytes += size

    def _evict_to(self, limit: int) -> None:
        """Evict unpinned entries, least recently used first, until at most `limit` bytes remain."""
        for key in [k for k, e in self._entries.items() if not e.pins]:
            if self._bytes <= limit:
                return
            self._remove(key)
            self.evictions += 1

    def _remove(self, key: str) -> None:
        self._bytes -= self._entries.pop(key).size

    def _entry(self, version: AdapterVersion) -> _Entry[T]:
        entry = self._entries.get(version.content_hash)
        if entry is None:
            raise KeyError(f"{version.ref} is not in the host cache; load it with get_or_load first")
        return entry
