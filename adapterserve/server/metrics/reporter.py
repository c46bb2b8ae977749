"""A replica's reports to the metrics hub: what its recorder holds, and its gauges, every
`interval_s`, as numbered batches (batch.py).

A batch that does not arrive (the hub restarting, a timeout) is sent again, as it was,
before anything newer; the hub applies each number once, so nothing is lost or counted
twice. Recording never waits on the hub: it is a dict update, and sending runs in a task
of its own. Without a hub (a replica built outside a Serve application) nothing is sent.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from adapterserve.server.metrics.batch import GatewayState, MetricsBatch
from adapterserve.server.metrics.recorder import Key, Recorder

logger = logging.getLogger("adapterserve.server")
SEND_TIMEOUT_S = 10.0
_WARN_EVERY_S = 60.0
Gauges = Callable[[], Awaitable[tuple[dict[Key, float], GatewayState | None]]]


class Reporter:
    def __init__(self, hub: Any | None, role: str, interval_s: float, gauges: Gauges | None = None) -> None:
        """`hub`: the MetricsHub deployment's handle (None: record only); `gauges`: returns this
        replica's gauges now and, for a generation engine, its state for the gateway."""
        self.recorder = Recorder()
        self.id = f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.role, self.interval_s = role, interval_s
        self._hub, self._gauges = hub, gauges
        self._seq = 0
        self._unsent: MetricsBatch | None = None
        self._lock: asyncio.Lock | None = None
        self._task: asyncio.Task | None = None
        self._warned = -_WARN_EVERY_S

    def start(self) -> None:
        """Report every interval from now on (idempotent; call it on the replica's event loop)."""
        if self._hub is not None and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def push(self) -> bool:
        """Send the unsent batch, or a new one, now; False if it did not arrive (kept for next time)."""
        if self._hub is None:
            return False
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            batch = self._unsent or await self._next_batch()
            self._unsent = batch
            try:
                await asyncio.wait_for(self._send(batch), SEND_TIMEOUT_S)
            except Exception as exc:  # the hub is restarting or gone: try again next time
                self._warn(exc)
                return False
            self._unsent = None
            return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.push()

    async def _next_batch(self) -> MetricsBatch:
        gauges, gateway = {}, None
        if self._gauges is not None:
            try:
                gauges, gateway = await self._gauges()
            except Exception as exc:  # gauges are skipped this time; the counts still go
                self._warn(exc)
        counters, histograms = self.recorder.take()
        batch = MetricsBatch(self.id, self.role, self._seq, counters, histograms, gauges, gateway)
        self._seq += 1
        return batch

    async def _send(self, batch: MetricsBatch) -> None:
        await self._hub.report.remote(batch)

    def _warn(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            logger.warning("metrics: a report to the metrics hub failed (%s: %s); it is sent again later",
                           type(exc).__name__, exc)
