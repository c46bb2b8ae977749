"""An engine replica's metrics: its adapter lookups, loads and engine restarts, and what its
engine reports (load now, counts so far) turned into gauges and deltas for the hub.

An engine's counts start again from zero when it is replaced (a restart); its report's
`engine_id` says so, and the first report of a new engine counts in full.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.engine.stats import HistogramValue, StatsSnapshot
from adapterserve.server.engine_process.report import EngineReport
from adapterserve.server.metrics import series as s
from adapterserve.server.metrics.batch import GatewayState
from adapterserve.server.metrics.recorder import AdapterTag, Key
from adapterserve.server.metrics.reporter import Reporter

_HISTOGRAMS = {"step_seconds": s.STEP_SECONDS, "batch_requests": s.BATCH_REQUESTS,
               "batch_tokens": s.BATCH_TOKENS, "queue_seconds": s.QUEUE_SECONDS}
_COUNTERS = {"slot_loads": s.SLOT_LOADS, "slot_evictions": s.SLOT_EVICTIONS, "preemptions": s.PREEMPTIONS}
_STAT_COUNTERS = {"prefix_queries": s.PREFIX_CACHE_QUERIES, "prefix_hits": s.PREFIX_CACHE_HITS}


class ReplicaMetrics:
    def __init__(self, hub: Any | None, role: str, backbone: str, interval_s: float,
                 engine_report: Callable[[], Awaitable[EngineReport | None]]) -> None:
        self.reporter = Reporter(hub, role, interval_s, self._gauges)
        self.recorder = self.reporter.recorder
        self._role, self._backbone = role, (backbone,)
        self._engine_report = engine_report
        self._adapters: dict[str, AdapterTag] = {}  # engine adapter id -> (name@N, public)
        self._last: EngineReport | None = None
        self._restarts = 0

    def start(self) -> None:
        self.reporter.start()

    def close(self) -> None:
        self.reporter.close()

    def lookup(self, tier: str, hit: bool) -> None:
        self.recorder.inc(s.CACHE_LOOKUPS, (*self._backbone, tier, "hit" if hit else "miss"))

    def registered(self, engine_id: str, version: AdapterVersion, seconds: float) -> None:
        """An adapter was read and registered with the engine in `seconds`."""
        self._adapters[engine_id] = (version.ref, version.public)
        self.recorder.inc(s.ADAPTER_LOADS, self._backbone)
        self.recorder.observe(s.ADAPTER_LOAD_SECONDS, seconds, self._backbone)

    def unregistered(self, engine_id: str) -> None:
        self._adapters.pop(engine_id, None)
        self.recorder.inc(s.ADAPTER_UNLOADS, self._backbone)

    def engine_restarts(self, total: int) -> None:
        """Count the restarts since the last call (`total`: all of this replica's)."""
        if total > self._restarts:
            self.recorder.inc(s.RESTARTS, self._backbone, amount=total - self._restarts)
            self._restarts = total

    async def _gauges(self) -> tuple[dict[Key, float], GatewayState | None]:
        report = await self._engine_report()
        if report is None:  # the engine is restarting: nothing to say about it now
            return {}, None
        self._count(report)
        return self._gauge_values(report), self._gateway(report) if self._role == "model" else None

    def _count(self, report: EngineReport) -> None:
        """The report's counts since the previous report (of the same engine)."""
        last = self._last if self._last is not None and self._last.engine_id == report.engine_id else None
        self._last = report
        for field, series in _COUNTERS.items():
            before = getattr(last, field) if last is not None else 0
            self.recorder.inc(series, self._backbone, amount=getattr(report, field) - before)
        if report.stats is not None:
            earlier = last.stats if last is not None else None
            for field, series in _HISTOGRAMS.items():
                self.recorder.add(series, _since(report.stats, earlier, field), self._backbone)
            for field, series in _STAT_COUNTERS.items():
                before = getattr(earlier, field) if earlier is not None else 0
                self.recorder.inc(series, self._backbone, amount=getattr(report.stats, field) - before)

    def _gauge_values(self, report: EngineReport) -> dict[Key, float]:
        values = {s.RUNNING: report.running, s.WAITING: report.waiting, s.SLOTS: report.slots,
                  s.SLOTS_USED: report.slots_used, s.SLOTS_PINNED: report.slots_pinned}
        if report.kv_blocks:
            values.update({s.KV_BLOCKS: report.kv_blocks, s.KV_USED: report.kv_blocks_used})
        return {(series.name, self._backbone, None): float(value) for series, value in values.items()}

    def _gateway(self, report: EngineReport) -> GatewayState:
        return GatewayState(self._backbone[0], report.waiting, report.running, report.kv_blocks,
                            report.kv_blocks_used, report.block_size, report.slots,
                            self._names(report.resident_adapters), self._names(report.waiting_adapters))

    def _names(self, engine_ids: tuple[str, ...]) -> tuple[AdapterTag, ...]:
        """Each adapter as `name@N` and as `name` (the two forms a request's model may take)."""
        found = [self._adapters[i] for i in engine_ids if i in self._adapters]
        return tuple({form: public for ref, public in found for form in (ref, ref.partition("@")[0])}.items())


def _since(now: StatsSnapshot, earlier: StatsSnapshot | None, field: str) -> HistogramValue:
    value = getattr(now, field)
    return value.minus(getattr(earlier, field)) if earlier is not None else value
