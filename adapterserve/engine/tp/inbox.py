"""A worker's inbox of the adapters' parts rank 0 shared (engine/tp/adapter_post.py), by key,
each staged for loading as it arrives.

Parts arrive on their own connection, read by a thread of their own, ahead of their
placement. Staging a part (the pools' `prepare`: its pinned, packed host copy) happens on
that thread too, so a placement in the command loop, which every rank's next step waits
for, only copies. As on rank 0 (AdapterHost), only the most recent parts keep their staged
copies (max_staged_adapters, max_staged_bytes); an older one is staged again when placed.
Should the thread end (rank 0 gone, or an error it did not expect), a placement of a part not
yet in fails at once, naming why, instead of waiting with every rank's step behind it.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.engine.staging import trim_staged
from adapterserve.engine.tp.adapter_post import host_identity, receive, send_at_once
from adapterserve.engine.tp.group import COLLECTIVE_TIMEOUT_S

log = logging.getLogger("adapterserve.engine")


class AdapterInbox:
    """Its hello names this host, so rank 0 knows whether it can hand parts over as files.
    ``prepare``, once set (WorkerState), stages each part as it arrives, before it can be taken."""

    def __init__(self, conn: Connection, rank: int, max_staged: int = 32, max_staged_bytes: int = 4 << 30) -> None:
        conn.send((rank, "adapters", host_identity()))
        send_at_once(conn)
        self._conn = conn
        self._adapters: dict[int, Adapter] = {}
        self._staged: OrderedDict[int, Adapter] = OrderedDict()  # keys whose parts hold staged copies, oldest first
        self._forgotten: set[int] = set()  # forgotten before their part was in (it is dropped on arrival)
        self.max_staged, self.max_staged_bytes = max_staged, max_staged_bytes
        self.prepare: Callable[[Adapter], None] | None = None
        self._ended: str | None = None  # why the inbox's thread ended; None while it runs
        self._arrived = threading.Condition()
        threading.Thread(target=self._receive, name="tp-adapters", daemon=True).start()

    def take(self, key: int) -> Adapter:
        """The adapter of `key`, waiting for it to arrive (it was sent before its placement).
        Its staged copies are then the placement's (it clears them once copied). RuntimeError
        at once if the inbox's thread has ended without it."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: key in self._adapters or self._ended is not None,
                                          timeout=COLLECTIVE_TIMEOUT_S):
                raise RuntimeError(f"adapter {key} to place did not arrive within {COLLECTIVE_TIMEOUT_S:.0f} s")
            if key not in self._adapters:
                raise RuntimeError(f"adapter {key} to place cannot arrive: this worker's adapter inbox stopped "
                                   f"({self._ended})")
            self._staged.pop(key, None)
            return self._adapters[key]

    def forget(self, key: int) -> None:
        """Drop a part; one still being staged (rank 0 had its reply, this thread has not stored
        it yet) is dropped as it comes in."""
        with self._arrived:
            adapter = self._adapters.pop(key, None)
            if adapter is None:
                self._forgotten.add(key)
            elif self._staged.pop(key, None) is not None:
                adapter.staged.clear()

    def staged_keys(self) -> list[int]:
        """Keys of the parts holding staged copies, oldest first."""
        with self._arrived:
            return list(self._staged)

    def _receive(self) -> None:
        """The thread: parts until rank 0 is gone or an error; why it ended is kept for ``take``."""
        try:
            self._receive_parts()
            reason = "rank 0 closed the adapters connection"
        except Exception as exc:  # any error ends the inbox: its placements then fail at once
            log.exception("tensor-parallel worker: the adapter inbox stopped")
            reason = f"{type(exc).__name__}: {exc}"
        with self._arrived:
            self._ended = reason
            self._arrived.notify_all()

    def _receive_parts(self) -> None:
        while True:
            try:
                key, adapter = receive(self._conn)
            except (EOFError, OSError):  # rank 0 is gone: the command loop ends too
                return
            staged = self._stage(adapter)
            with self._arrived:
                if key in self._forgotten:
                    self._forgotten.discard(key)
                    adapter.staged.clear()
                    continue
                self._adapters[key] = adapter
                if staged:
                    self._staged[key] = adapter
                    trim_staged(self._staged, self.max_staged, self.max_staged_bytes)
                self._arrived.notify_all()

    def _stage(self, adapter: Adapter) -> bool:
        """Whether the part was staged; one that cannot be is left to its placement, which
        stages it in the command loop and reports why it failed to rank 0."""
        prepare = self.prepare
        if prepare is None:
            return False
        try:
            prepare(adapter)
        except Exception:  # noqa: BLE001 - reported by the placement, where rank 0 hears of it
            adapter.staged.clear()
            return False
        return True
