"""The adapters a replica has registered with its engine, their host copies bounded in bytes.

One registration per content hash. Serve's multiplexer decides which adapters a replica
advertises (routing, at most max_adapters_per_replica: `Advertised`); this registry
decides which the engine holds (`registered_adapter_bytes`). A registration that would
take the engine's host copies over the budget first unregisters idle registrations,
least recently used first; one that a request uses is never unregistered (an evicted
one goes when its last request releases it), nor is a pinned one. An adapter
unregistered here is read again (the host cache, else the store) and registered under a
fresh engine id on its next request. While every registered byte is in use, a new
registration waits up to ROOM_WAIT_S for a request to finish, then is refused
(CapacityError: RESOURCE_EXHAUSTED).
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from adapterserve.adapters_store.cache import HostAdapterCache, host_copy_bytes
from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.errors import CapacityError
from adapterserve.server.loaded import LoadedAdapter
from adapterserve.server.metrics.replica_metrics import ReplicaMetrics

ROOM_WAIT_S = 30.0  # a registration waits this long for requests to free registered bytes
_ROOM_POLL_S = 0.01


class RegisteringEngine(Protocol):
    async def add_adapter(self, adapter_id: str, adapter: Any, pinned: bool = False) -> None: ...

    def discard_adapter(self, adapter_id: str) -> None: ...


@dataclass
class _Held:
    loaded: LoadedAdapter
    size: int  # bytes of its host copy in the engine
    pinned: bool


class EngineRegistry:
    def __init__(self, engine: RegisteringEngine, cache: HostAdapterCache, metrics: ReplicaMetrics,
                 capacity_bytes: int, room_wait_s: float = ROOM_WAIT_S) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"registered_adapter_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes, self.room_wait_s = capacity_bytes, room_wait_s
        self._engine, self._cache, self._metrics = engine, cache, metrics
        self._held: OrderedDict[str, _Held] = OrderedDict()  # content hash -> registration, least recent first
        self._reserved = 0  # bytes of registrations under way
        self._lock = threading.RLock()  # unloads come from Serve's eviction threads
        self._registering: dict[str, tuple[asyncio.Lock, int]] = {}  # content hash -> (lock, callers)
        self._ids = itertools.count()

    @property
    def bytes(self) -> int:
        """Bytes of the host copies registered (and being registered) with the engine now."""
        with self._lock:
            return self._reserved + sum(h.size for h in self._held.values())

    def registered(self) -> list[str]:
        """Content hashes registered now."""
        with self._lock:
            return list(self._held)

    def pinned(self) -> list[str]:
        with self._lock:
            return [key for key, held in self._held.items() if held.pinned]

    def __contains__(self, content_hash: str) -> bool:
        with self._lock:
            return content_hash in self._held

    async def acquire(self, version: AdapterVersion) -> LoadedAdapter:
        """The version's registration, counted as in use by the caller (release it when done);
        registered now if it is not."""
        key = version.content_hash
        async with self._registering_lock(key):
            loaded = self._reuse(key)
            self._metrics.lookup("engine", loaded is not None)
            return loaded or await self._register(version, pinned=False)

    async def pin(self, version: AdapterVersion) -> None:
        """Register the version for good (placed in a slot now, never evicted); refused at once
        when its bytes do not fit beside the other pinned adapters."""
        async with self._registering_lock(version.content_hash):
            if self._reuse(version.content_hash, pin=True) is None:
                await self._register(version, pinned=True)

    def drop(self, content_hash: str) -> None:
        """Serve's multiplexer dropped the adapter: unregister it now, or when its last request ends."""
        with self._lock:
            held = self._held.get(content_hash)
        if held is not None and not held.pinned:
            held.loaded.evict()

    def _reuse(self, key: str, pin: bool = False) -> LoadedAdapter | None:
        with self._lock:
            held = self._held.get(key)
            if held is None or (pin and not held.pinned):
                return None
            if not pin and not held.loaded.acquire():
                return None  # unloaded meanwhile: register it again
            self._held.move_to_end(key)
            return held.loaded

    async def _register(self, version: AdapterVersion, pinned: bool) -> LoadedAdapter:
        started = time.monotonic()
        self._metrics.lookup("host", version in self._cache)
        adapter = await asyncio.to_thread(self._cache.get_or_load, version)
        size = host_copy_bytes(adapter)
        await self._make_room(version, size, pinned)
        engine_id = f"{version.ref}#pinned" if pinned else f"{version.ref}#{next(self._ids)}"
        try:
            await self._engine.add_adapter(engine_id, adapter, pinned=pinned)
        except BaseException:
            with self._lock:
                self._reserved -= size
            raise
        loaded = LoadedAdapter(engine_id, self._unloaded)
        loaded.acquire()  # the caller's use (a pinned one's is never released)
        with self._lock:
            self._reserved -= size
            self._held.pop(version.content_hash, None)  # one unloaded meanwhile, not yet forgotten
            self._held[version.content_hash] = _Held(loaded, size, pinned)
        self._metrics.registered(engine_id, version, time.monotonic() - started)
        return loaded

    async def _make_room(self, version: AdapterVersion, size: int, pinned: bool) -> None:
        """Reserve `size` bytes, unregistering idle adapters (least recently used first) for them."""
        if size > self.capacity_bytes:
            raise CapacityError(
                f"adapter {version.ref} takes {size} bytes of host memory in the engine, more than "
                f"registered_adapter_bytes ({self.capacity_bytes}); raise registered_adapter_bytes"
            )
        deadline = time.monotonic() + (0.0 if pinned else self.room_wait_s)
        while not await asyncio.to_thread(self._reserve, size):  # unloads may wait for the engine's lock
            if time.monotonic() >= deadline:
                raise CapacityError(
                    f"adapter {version.ref} ({size} bytes) does not fit in registered_adapter_bytes "
                    f"({self.capacity_bytes}): the adapters registered now are pinned or in use by running "
                    "requests; retry in a moment, or raise registered_adapter_bytes"
                )
            await asyncio.sleep(_ROOM_POLL_S)

    def _reserve(self, size: int) -> bool:
        with self._lock:
            for held in list(self._held.values()):
                if self.bytes + size <= self.capacity_bytes:
                    break
                if not held.pinned:
                    held.loaded.unload_if_idle()  # calls _unloaded, which forgets it
            if self.bytes + size > self.capacity_bytes:
                return False
            self._reserved += size
            return True

    def _unloaded(self, loaded: LoadedAdapter) -> None:
        """A registration's last use ended after its eviction (any thread): unregister it."""
        with self._lock:
            for key, held in list(self._held.items()):
                if held.loaded is loaded:
                    del self._held[key]
        self._engine.discard_adapter(loaded.engine_id)
        self._metrics.unregistered(loaded.engine_id)

    def _registering_lock(self, key: str) -> _KeyLock:
        return _KeyLock(self._registering, key)


class _KeyLock:
    """An asyncio lock per key, kept only while some caller holds or waits for it."""

    def __init__(self, locks: dict[str, tuple[asyncio.Lock, int]], key: str) -> None:
        self._locks, self._key = locks, key

    async def __aenter__(self) -> None:
        lock, callers = self._locks.get(self._key, (None, 0))
        lock = lock or asyncio.Lock()
        self._locks[self._key] = (lock, callers + 1)
        try:
            await lock.acquire()
        except BaseException:  # cancelled while waiting
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._locks[self._key][0].release()
        self._leave()

    def _leave(self) -> None:
        lock, callers = self._locks[self._key]
        if callers == 1:
            del self._locks[self._key]
        else:
            self._locks[self._key] = (lock, callers - 1)


class Advertised:
    """What Serve's multiplexer holds for an adapter this replica serves (it routes requests
    naming the adapter here); dropping it drops the adapter's registration."""

    def __init__(self, content_hash: str, registry: EngineRegistry) -> None:
        self._content_hash, self._registry = content_hash, registry
        self._dropped = False

    def __del__(self) -> None:  # Serve calls it on eviction (in a worker thread), and again at collection
        if not self._dropped:
            self._dropped = True
            self._registry.drop(self._content_hash)
