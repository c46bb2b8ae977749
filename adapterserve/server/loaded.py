"""An adapter registered with a replica's engine, counted by the requests using it.

The replica evicts registrations (server/registrations.py: Serve's multiplexer
dropping an adapter, or the byte budget making room for another). Requests still
streaming with the adapter keep it: the engine unloads it when the last of them
releases it. Each registration gets a fresh engine id, so a re-load after eviction
never collides with a copy that is still draining.
"""
from __future__ import annotations

import threading
from collections.abc import Callable


class LoadedAdapter:
    def __init__(self, engine_id: str, unload: Callable[[LoadedAdapter], None]) -> None:
        self.engine_id = engine_id
        self._unload = unload
        self._lock = threading.Lock()
        self._users = 0
        self._evicted = False
        self._unloaded = False

    def acquire(self) -> bool:
        """Count one more request; False if the adapter is already unloaded (load it again)."""
        with self._lock:
            if self._unloaded:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            unload = self._evicted and self._users == 0 and not self._unloaded
            self._unloaded |= unload
        if unload:
            self._unload(self)

    def evict(self) -> None:
        """Unload now if idle, else when the last request releases it."""
        with self._lock:
            self._evicted = True
            unload = self._users == 0 and not self._unloaded
            self._unloaded |= unload
        if unload:
            self._unload(self)

    def unload_if_idle(self) -> bool:
        """Unload now if no request uses it (True); else change nothing (False)."""
        with self._lock:
            unload = self._users == 0 and not self._unloaded
            self._unloaded |= unload
        if unload:
            self._unload(self)
        return unload

    def __del__(self) -> None:  # what Ray Serve's multiplexer calls on eviction
        self.evict()

    @property
    def users(self) -> int:
        return self._users
