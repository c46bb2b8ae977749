"""EngineSupervisor: a replica's engine, watched, and restarted in place when it fails.

The replica talks to its engine through this class (the async API of EngineProcess).
`check()`, which the replica's health check calls, asks the engine for its load with a
deadline. An engine that is gone, broken (Engine.broken), stalled (work waiting and no
progress for `stall_timeout_s`) or that does not answer is ended at once: its requests
fail with EngineDied (UNAVAILABLE, retryable). A new engine process then starts in its
place, and every adapter registered with the old one is registered again; requests
that arrive meanwhile wait for it. A process that exits is noticed at once, without
waiting for the next check.

The replica must be replaced instead (`failed` says why; its health check then fails)
when a restart fails or takes longer than `start_timeout_s`, when the engine failed
more than MAX_RESTARTS times in RESTART_WINDOW_S, or when the engine runs in the
replica's own process (engine_process: false) and cannot be restarted alone.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from functools import partial

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.engine.async_front import Prompt
from adapterserve.engine.request import ClassifyOutput, EmbedOutput, RequestOutput, RequestTimes
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.errors import EngineDied
from adapterserve.server.engine_process.facts import EngineFacts, EngineLoad
from adapterserve.server.engine_process.local import AdapterIds, LocalEngine
from adapterserve.server.engine_process.proxy import EngineProcess
from adapterserve.server.engine_process.report import EngineReport

logger = logging.getLogger("adapterserve.server")

Engine = EngineProcess | LocalEngine
Starter = Callable[[Callable[[EngineDied], None]], Engine]  # given on_exit, returns a started engine
PROBE_TIMEOUT_S = 5.0  # an engine's event loop answers a load request within this, or it is wedged
MAX_RESTARTS, RESTART_WINDOW_S = 3, 600.0


class EngineSupervisor:
    def __init__(self, start: Starter, *, restartable: bool, stall_timeout_s: float, start_timeout_s: float) -> None:
        """Start the first engine (blocking; its error if it cannot start). `restartable`: `start`
        makes a process of its own, which can be ended and started again."""
        self._start, self.restartable = start, restartable
        self.stall_timeout_s, self.start_timeout_s = stall_timeout_s, start_timeout_s
        self._loop = asyncio.get_running_loop()
        self._generation = 0  # of the current engine; exits of older ones are ignored
        self.engine: Engine = start(partial(self._exited, 0))
        self.facts: EngineFacts = self.engine.facts
        self.problem: str | None = None  # why the engine does not serve now
        self.fatal: str | None = None  # why it will not serve again in this replica
        self.restarts = 0
        self._restarted_at: deque[float] = deque()  # time.monotonic() of recent restarts
        self._restart: asyncio.Task | None = None
        self._serving = asyncio.Event()
        self._serving.set()
        self._adapters: dict[str, tuple[Adapter, bool]] = {}  # engine id -> (adapter, pinned): replayed on restart
        self._adapters_lock = threading.Lock()  # discard_adapter runs in Serve's eviction threads
        self._closing = False

    # health

    async def check(self) -> str | None:
        """Probe the engine: None if it serves, else why not. A fault ends it and starts a restart."""
        if self.fatal is not None or self.restarting:
            return self.fatal or self.problem
        problem = await self._probe(self.engine)
        if problem is None:
            self.problem = None
        else:
            self._fault(problem)
        return problem

    @property
    def restarting(self) -> bool:
        return self._restart is not None and not self._restart.done()

    @property
    def failed(self) -> str | None:
        """Why this replica must be replaced (its engine will not serve again here), or None."""
        if self.fatal is not None:
            return self.fatal
        if not self.restartable:
            return self.problem
        if self.restarting and time.monotonic() - self._restarted_at[-1] > self.start_timeout_s:
            return f"{self.problem}; the new engine did not start within {self.start_timeout_s:g} s"
        return None

    async def _probe(self, engine: Engine) -> str | None:
        if not engine.alive:
            return "the engine process is gone"
        try:
            load = await asyncio.wait_for(engine.load(), PROBE_TIMEOUT_S)
        except TimeoutError:
            return f"the engine did not answer a health probe within {PROBE_TIMEOUT_S:g} s (its loop is wedged)"
        except EngineDied as exc:
            return str(exc)
        if load.broken is not None:
            return f"the engine is broken ({load.broken})"
        if load.stalled_s > self.stall_timeout_s:
            return (f"the engine's work made no progress for {load.stalled_s:.0f} s "
                    f"(stall_timeout_s {self.stall_timeout_s:g})")
        return None

    def _exited(self, generation: int, error: EngineDied) -> None:
        """on_exit of an engine process (its reader thread): handled on the replica's loop."""
        try:
            self._loop.call_soon_threadsafe(self._gone, generation, error)
        except RuntimeError:  # the loop is closed: the replica is gone too
            pass

    def _gone(self, generation: int, error: EngineDied) -> None:
        if generation == self._generation and not self._closing:
            self._fault(str(error))

    def _fault(self, why: str) -> None:
        """The engine cannot serve: restart it, unless that is not possible or not wise."""
        self.problem = why
        if not self.restartable or self.restarting or self.fatal is not None or self._closing:
            return
        now = time.monotonic()
        while self._restarted_at and now - self._restarted_at[0] > RESTART_WINDOW_S:
            self._restarted_at.popleft()
        if len(self._restarted_at) >= MAX_RESTARTS:
            self.fatal = (f"{why}; the engine failed {MAX_RESTARTS + 1} times in {RESTART_WINDOW_S:g} s, "
                          "so this replica must be replaced")
            logger.error("%s", self.fatal)
            return
        logger.warning("restarting the engine: %s", why)
        self._restarted_at.append(now)
        self._serving.clear()
        self._restart = self._loop.create_task(self._restart_engine(why))

    async def _restart_engine(self, why: str) -> None:
        old, generation = self.engine, self._generation + 1
        try:
            if old.alive:
                await asyncio.to_thread(old.kill, why)
            new = await asyncio.to_thread(self._start, partial(self._exited, generation))
            try:
                await self._register_all(new)
            except BaseException:
                await asyncio.to_thread(new.close)
                raise
        except Exception as exc:
            self.fatal = f"{why}; starting a new engine failed ({type(exc).__name__}: {exc})"
            logger.exception("%s", self.fatal)
        else:
            if self._closing:
                new.close()
                return
            self.engine, self._generation, self.problem = new, generation, None
            self.restarts += 1
            logger.warning("the engine was restarted (%d adapters registered again)", len(self._adapters))
        finally:
            self._serving.set()

    async def _register_all(self, engine: Engine) -> None:
        with self._adapters_lock:
            registered = dict(self._adapters)
        for adapter_id, (adapter, pinned) in registered.items():
            await engine.add_adapter(adapter_id, adapter, pinned)
        with self._adapters_lock:
            dropped = [adapter_id for adapter_id in registered if adapter_id not in self._adapters]
        for adapter_id in dropped:  # discarded while the new engine started
            engine.discard_adapter(adapter_id)

    async def _ready(self) -> Engine:
        """The engine, once it serves (waiting for a restart in progress)."""
        if not self.engine.alive:  # gone, and its exit maybe not handled yet
            self._fault("the engine process is gone")
        if not self._serving.is_set():
            try:
                await asyncio.wait_for(self._serving.wait(), self.start_timeout_s)
            except TimeoutError:
                raise EngineDied(f"the engine is restarting ({self.problem}); retry later") from None
        if self.fatal is not None:
            raise EngineDied(f"{self.fatal}; retry")
        return self.engine

    # the engine's API

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, adapter_id: str | None = None,
               request_id: str | None = None, times: RequestTimes | None = None, cache_salt: str = "",
               pause_s: Callable[[], float] | None = None) -> AsyncGenerator[RequestOutput, None]:
        """The engine's stream: closing it early (or cancelling its task) aborts the request;
        `times`, if given, gets the request's stage times in the engine; `pause_s`: as Engine.stream's.
        An engine that serves gives its own stream (no frame of ours per chunk); else the stream
        first waits for it (a restart in progress) or raises why it will not serve."""
        args = (prompt, sampling, adapter_id, request_id, times, cache_salt, pause_s)
        if self._serving.is_set() and self.fatal is None and self.engine.alive:
            return self.engine.stream(*args)
        return self._stream_when_ready(args)

    async def _stream_when_ready(self, args: tuple) -> AsyncGenerator[RequestOutput, None]:
        engine = await self._ready()
        async with aclosing(engine.stream(*args)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def classify(self, texts: Sequence[Prompt], adapter_ids: AdapterIds) -> list[ClassifyOutput]:
        return await (await self._ready()).classify(texts, adapter_ids)

    async def embed(self, texts: Sequence[Prompt], adapter_ids: AdapterIds = None) -> list[EmbedOutput]:
        return await (await self._ready()).embed(texts, adapter_ids)

    async def add_adapter(self, adapter_id: str, adapter: Adapter, pinned: bool = False) -> None:
        """Register an adapter; it is registered again with every engine that replaces this one."""
        engine = await self._ready()
        with self._adapters_lock:
            self._adapters[adapter_id] = (adapter, pinned)
        try:
            await engine.add_adapter(adapter_id, adapter, pinned)
        except BaseException:
            with self._adapters_lock:
                self._adapters.pop(adapter_id, None)
            raise

    async def unload_adapter(self, adapter_id: str) -> None:
        with self._adapters_lock:
            self._adapters.pop(adapter_id, None)
        await (await self._ready()).unload_adapter(adapter_id)

    def discard_adapter(self, adapter_id: str) -> None:
        """Unload if loaded; callable from any thread, without waiting."""
        with self._adapters_lock:
            self._adapters.pop(adapter_id, None)
        self.engine.discard_adapter(adapter_id)

    async def load(self) -> EngineLoad:
        return await (await self._ready()).load()

    async def stats(self) -> EngineReport | None:
        """The engine's report for metrics; None while it does not serve (restarting, failed, or
        no answer within the probe's deadline): metrics never wait for an engine."""
        if self.fatal is not None or self.restarting or not self.engine.alive:
            return None
        try:
            return await asyncio.wait_for(self.engine.stats(), PROBE_TIMEOUT_S)
        except (TimeoutError, EngineDied):
            return None

    @property
    def last_load(self) -> EngineLoad:
        return self.engine.last_load

    @property
    def alive(self) -> bool:
        return self.engine.alive

    @property
    def pid(self) -> int | None:
        return self.engine.pid

    def close(self) -> None:
        """Stop the engine; no restart follows."""
        self._closing = True
        self.engine.close()
