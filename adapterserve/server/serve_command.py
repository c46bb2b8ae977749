"""`adapterserve serve` once its flags are read: start, serve until SIGTERM or SIGINT, drain, stop.

The first signal drains: every Ingress replica refuses new calls (UNAVAILABLE, health
NOT_SERVING) while running requests finish, for at most the grace period; then Serve and
Ray stop and every process the server started is ended, so its ports are free when the
command exits (status 0). A second signal stops at once (status 1): every process of the
server is killed without waiting.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from adapterserve.server import launch

STOPPED_AT_ONCE = 1  # exit status after a second signal


class StopSignals:
    """SIGTERM and SIGINT: the first sets `requested`, the second calls `at_once` (in the handler)."""

    def __init__(self, at_once: Callable[[], None]) -> None:
        self.requested = threading.Event()
        self._at_once = at_once
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested.is_set():
            self._at_once()
        self.requested.set()


def run(config: Mapping[str, Any], grace_s: float, announce: Callable[[launch.Endpoints], None],
        **endpoints: Any) -> int:
    """Serve `config` on `endpoints` (launch.start's keywords) until a signal; returns the exit status."""
    signals = StopSignals(_stop_at_once)
    try:
        announce(launch.start(config, **endpoints))
        signals.requested.wait()
        _say(f"draining: running requests get up to {grace_s:g} s to finish; new ones are refused "
             "(signal again to stop at once)")
        left = launch.drain(config, grace_s)
        if left:
            _say(f"grace period over: {left} requests still running are cut")
        launch.shutdown(graceful=left == 0)  # requests left now are cut either way: no second wait
    except BaseException:
        launch.shutdown(graceful=False)
        raise
    _say("stopped")
    return 0


def _stop_at_once() -> None:
    _say("second signal: stopping at once")
    launch.kill()
    os._exit(STOPPED_AT_ONCE)


def _say(line: str) -> None:
    print(f"adapterserve: {line}", file=sys.stderr, flush=True)
