"""`adapterserve serve` once its flags are read: start, serve until SIGTERM or SIGINT, drain, stop.

The first signal drains: every Ingress replica refuses new calls (UNAVAILABLE, health
NOT_SERVING) while running requests finish, for at most the grace period; then Serve and
Ray stop and every process the server started is ended, so its ports are free when the
command exits (status 0). A second signal stops at once (status 1): every process of the
server is killed without waiting. A signal that reaches Ray's own processes too (sent to the
whole process group, or a service manager stopping every process of its unit) leaves nothing
to drain: the server says so, ends what is left and exits at once (status 0).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from adapterserve.server import launch

STOPPED_AT_ONCE = 1  # exit status after a second signal
RAY_CHECK_S = 0.2  # how often a drain looks whether Ray's own processes are still there
RAY_EXIT_WAIT_S = 15.0  # how long a failed drain waits for a GCS that answers while it exits


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
        left = _drain(config, grace_s)
        if left is None:
            _stop_with_ray_gone()
        if left:
            _say(f"grace period over: {left} requests still running are cut")
        launch.shutdown(graceful=left == 0)  # requests left now are cut either way: no second wait
    except BaseException:
        launch.shutdown(graceful=False)
        raise
    _say("stopped")
    return 0


def _drain(config: Mapping[str, Any], grace_s: float) -> int | None:
    """launch.drain's count of requests left, or None when the Ray this server started loses its
    GCS or raylet meanwhile: the signal reached them too (a signal to the whole process group, a
    service manager stopping every process of its unit), and a drain would wait on a dead
    cluster. The drain runs in a thread of its own so that this is seen while it waits."""
    outcome: list = []

    def draining() -> None:
        try:
            outcome.append(launch.drain(config, grace_s))
        except BaseException as exc:  # handed to the caller
            outcome.append(exc)

    worker = threading.Thread(target=draining, name="adapterserve-drain", daemon=True)
    worker.start()
    while worker.is_alive() and not launch.ray_lost():
        worker.join(RAY_CHECK_S)
    if launch.ray_lost():  # its answer, if any, came from a cluster going down
        return None
    if isinstance(outcome[0], BaseException):
        if ray_going_down(RAY_EXIT_WAIT_S):
            return None
        raise outcome[0]
    return outcome[0]


def ray_going_down(wait_s: float) -> bool:
    """Whether the Ray this server started loses its GCS or raylet within `wait_s`. A GCS that
    got the signal cancels its calls (Serve's KV store, say) before its process exits: a drain
    that fails then failed on a cluster going down, not on a fault of its own."""
    deadline = time.monotonic() + wait_s
    while not launch.ray_lost():
        if time.monotonic() >= deadline:
            return False
        time.sleep(RAY_CHECK_S)
    return True


def _stop_with_ray_gone() -> None:
    """Ray's own processes are ending: nothing is left to drain or to shut down politely. End
    what is left of it and exit now (Ray's exit hook would wait on the dead cluster)."""
    _say("Ray's own processes got the stop signal too (sent to the whole process group or service unit): "
         "running requests are cut; stopped")
    launch.kill()
    os._exit(0)


def _stop_at_once() -> None:
    _say("second signal: stopping at once")
    launch.kill()
    os._exit(STOPPED_AT_ONCE)


def _say(line: str) -> None:
    print(f"adapterserve: {line}", file=sys.stderr, flush=True)
