"""EngineProcess: the engine in a child process, behind LocalEngine's async API.

The replica's process then only relays chunks; its event loop no longer shares an
interpreter lock with the engine's step thread. One reader thread receives the
child's messages (about one per engine step) and hands each stream's chunks to its
event loop with one call_soon_threadsafe per message; streams merge the chunks
that waited, as Engine.stream does. If the child dies, every waiter fails with
EngineDied at once and `on_exit` is called (from the reader thread) with that error.

The child is started with multiprocessing's "spawn", which imports the parent's
main module again: a script that starts one needs the `if __name__ == "__main__":`
guard.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import multiprocessing
import os
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.engine.async_front import Prompt, merge_chunks
from adapterserve.engine.output_queue import OutputQueue
from adapterserve.engine.request import ClassifyOutput, EmbedOutput, RequestOutput, RequestTimes
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.errors import EngineDied
from adapterserve.server.engine_process import child, wire
from adapterserve.server.engine_process.facts import EngineFacts, EngineLoad
from adapterserve.server.engine_process.local import AdapterIds
from adapterserve.server.engine_process.report import EngineReport


_LATER_FIELDS = 4  # a later chunk's: (token_ids, text, finish_reason, index)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: OutputQueue
    times: RequestTimes | None = None  # the caller's, filled from the child's (before its last chunk)
    head: RequestOutput | None = None  # the first chunk: request id, adapter, prompt ids

    def output(self, ok: bool, value: Any) -> RequestOutput | BaseException | None:
        """What the stream's reader gets of an entry (None: nothing; stage times are kept)."""
        if not ok:
            return value
        if isinstance(value, RequestTimes):
            if self.times is not None:
                vars(self.times).update(vars(value))
            return None
        if len(value) != _LATER_FIELDS:  # the first chunk
            self.head = wire.output_of_head(value)
            return self.head
        ids, text, reason, index = value
        head = self.head
        return RequestOutput(head.request_id, ids, text, reason, head.adapter_id, head.prompt_token_ids,
                             cached_tokens=head.cached_tokens, index=index)


class EngineProcess:
    def __init__(self, model_dir: str | Path, engine_kwargs: Mapping[str, Any] | None = None,
                 on_exit: Callable[[EngineDied], None] | None = None, coalesce: bool = True) -> None:
        """Start the child and wait until its engine is built (its error, if building fails).
        `coalesce`: the streams started in one loop turn cross in one message, and the child
        takes every message waiting in the pipe at once, so a burst reaches one engine step
        (False: a message per stream, taken one by one; kept to measure the difference)."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(target=child.main, name="adapterserve-engine", daemon=True,
                                    args=(child_conn, str(model_dir), dict(engine_kwargs or {}), os.getpid(),
                                          coalesce))
        self._process.start()
        child_conn.close()  # the child's end lives in the child only: its death is our EOF
        self.facts: EngineFacts = self._wait_ready()
        self.last_load = EngineLoad()  # as of the child's latest message
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the tables and _dead
        self._send_lock = threading.Lock()  # also guards _starts
        self._coalesce = coalesce
        self._starts: list[bytes] = []  # stream starts of this loop turn (pickled), not sent yet
        self._streams: dict[int, _Stream] = {}
        self._calls: dict[int, Future] = {}
        self._dead: EngineDied | None = None
        self._closing = False
        self._killed_because: str | None = None
        self._on_exit = on_exit
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> EngineFacts:
        try:
            while not self._conn.poll(0.5):
                if not self._process.is_alive() and not self._conn.poll(0):
                    raise EOFError
            kind, value = wire.recv(self._conn)
        except EOFError:
            self._process.join()
            kind, value = "failed", EngineDied(f"the engine process exited while starting (exit code "
                                               f"{self._process.exitcode}); see the replica's log")
        if kind == "failed":
            self._process.join()
            self._conn.close()
            raise value
        return value

    # the API

    async def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, adapter_id: str | None = None,
                     request_id: str | None = None, times: RequestTimes | None = None, cache_salt: str = "",
                     pause_s: Callable[[], float] | None = None) -> AsyncIterator[RequestOutput]:
        """Engine.stream in the child: closing it early (or cancelling its task) aborts the request.
        `times`, if given, gets the stage times the child recorded, by the last chunk; `pause_s`:
        as Engine.stream's, here (the child sends every step's outputs)."""
        call_id = next(self._ids)
        stream = _Stream(asyncio.get_running_loop(), OutputQueue(), times)
        self._register(self._streams, call_id, stream)
        unfinished = sampling.n if sampling is not None else 1  # choices still running
        try:
            self._start(("stream", call_id, prompt, sampling, adapter_id, request_id, times is not None, cache_salt))
            while unfinished:
                for chunk in merge_chunks([await stream.queue.get()], stream.queue):
                    unfinished -= chunk.finished
                    yield chunk
                if unfinished and pause_s is not None:
                    await stream.queue.settle(pause_s())
        finally:
            self._unregister(self._streams, call_id)
            if unfinished:
                self._send_quietly(("abort", call_id))

    async def classify(self, texts: Sequence[Prompt], adapter_ids: AdapterIds) -> list[ClassifyOutput]:
        return await self._call("classify", list(texts), adapter_ids)

    async def embed(self, texts: Sequence[Prompt], adapter_ids: AdapterIds = None) -> list[EmbedOutput]:
        return await self._call("embed", list(texts), adapter_ids)

    async def add_adapter(self, adapter_id: str, adapter: Adapter, pinned: bool = False) -> None:
        """Register an adapter already read (pinned: placed now, never evicted); it travels
        by value (pickled off the event loop)."""
        if isinstance(adapter, Adapter) and adapter.staged:
            adapter = dataclasses.replace(adapter, staged={})  # this process's loading copies stay here
        await self._call("add_adapter", adapter_id, adapter, pinned, encode_in_thread=True)

    async def unload_adapter(self, adapter_id: str) -> None:
        await self._call("unload_adapter", adapter_id)

    def discard_adapter(self, adapter_id: str) -> None:
        """Unload if loaded, from any thread, without waiting for the answer."""
        self._send_quietly(("call", next(self._ids), "unload_adapter", (adapter_id,)))

    async def load(self) -> EngineLoad:
        """The engine's load now (an RPC; `last_load` is the free, slightly older one)."""
        return await self._call("load")

    async def stats(self) -> EngineReport:
        """Load and counts for metrics (an RPC)."""
        return await self._call("stats")

    @property
    def alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def kill(self, reason: str) -> None:
        """End the child now (a wedged or broken engine): its waiters fail with EngineDied(reason)."""
        self._killed_because = reason
        self._process.kill()
        self._process.join()
        self._reader.join()
        self._conn.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child (requests still running fail with EngineDied); idempotent."""
        if self._closing:
            return
        self._closing = True
        self._send_quietly(("close",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._reader.join(timeout)
        self._conn.close()

    # calls

    async def _call(self, method: str, *args, encode_in_thread: bool = False) -> Any:
        call_id = next(self._ids)
        future: Future = Future()
        future.set_running_or_notify_cancel()  # only the reader thread settles it
        self._register(self._calls, call_id, future)
        try:
            message = ("call", call_id, method, args)
            self._send_bytes(await asyncio.to_thread(wire.encode, message) if encode_in_thread
                             else wire.encode(message))
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._send_quietly(("abort", call_id))
            raise
        finally:
            self._unregister(self._calls, call_id)

    def _register(self, table: dict, call_id: int, waiter: Any) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDied(str(self._dead))
            table[call_id] = waiter

    def _unregister(self, table: dict, call_id: int) -> None:
        with self._lock:
            table.pop(call_id, None)

    def _start(self, message: tuple) -> None:
        """Send a stream's start: coalesced, at the end of this loop turn with the turn's other starts."""
        if not self._coalesce:
            self._send(message)
            return
        payload = wire.encode(message)  # here, so that one that does not pickle fails its own caller
        with self._send_lock:
            if not self._starts:
                asyncio.get_running_loop().call_soon(self._send_starts)
            self._starts.append(payload)

    def _send_starts(self) -> None:
        """The loop turn's starts, unless a message sent since took them along."""
        try:
            self._send_bytes()
        except EngineDied:  # the reader thread fails the streams
            pass

    def _send(self, message: tuple) -> None:
        self._send_bytes(wire.encode(message))

    def _send_bytes(self, payload: bytes | None = None) -> None:
        """Write the starts waiting to go, then `payload` (a message), if any."""
        if self._dead is not None:
            raise EngineDied(str(self._dead))
        with self._send_lock:
            starts, self._starts = self._starts, []
            try:
                if starts:
                    self._conn.send_bytes(wire.encode(("streams", starts)))
                if payload is not None:
                    self._conn.send_bytes(payload)
            except OSError as exc:
                raise EngineDied(f"the engine process is gone ({exc})") from exc

    def _send_quietly(self, message: tuple) -> None:
        try:
            self._send(message)
        except EngineDied:
            pass

    # the reader thread

    def _read(self) -> None:
        cause = None
        try:
            while True:
                entries, self.last_load = wire.recv(self._conn)
                self._deliver(entries)
        except (EOFError, OSError):
            pass
        except Exception as exc:  # a message that does not unpickle: the pipe is out of step
            cause = exc
            self._process.kill()
        death = self._death(cause)
        self._fail_all(death)
        if self._on_exit is not None and not self._closing:
            self._on_exit(death)

    def _deliver(self, entries: list[tuple[int, bool, Any]]) -> None:
        """Each stream's chunks to its loop (one call per loop), each call's result to its future."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        with self._lock:
            for call_id, ok, value in entries:
                if (stream := self._streams.get(call_id)) is not None:
                    if (item := stream.output(ok, value)) is not None:
                        by_loop[stream.loop].append((stream.queue, item))
                elif (future := self._calls.get(call_id)) is not None:
                    _settle(future, ok, value)
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _death(self, cause: BaseException | None) -> EngineDied:
        if self._closing:
            return EngineDied("the engine process was closed")
        if self._killed_because is not None:
            return EngineDied(f"{self._killed_because}; its engine process was ended and its requests failed")
        self._process.join(2.0)
        why = f": {type(cause).__name__}: {cause}" if cause else ""
        return EngineDied(f"the engine process exited (exit code {self._process.exitcode}){why}; "
                          "its requests failed; see the replica's log")

    def _fail_all(self, error: EngineDied) -> None:
        with self._lock:
            self._dead = error
            streams, calls = list(self._streams.values()), list(self._calls.values())
        for stream in streams:
            _call_soon(stream.loop, _put_all, [(stream.queue, EngineDied(str(error)))])
        for future in calls:
            if not future.done():
                future.set_exception(EngineDied(str(error)))


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _settle(future: Future, ok: bool, value: Any) -> None:
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, arg) -> None:
    try:
        loop.call_soon_threadsafe(callback, arg)
    except RuntimeError:  # that loop is closed: nobody waits there any more
        pass
