"""The engine process: one engine and its own asyncio loop, driven over a pipe.

A reader thread hands each command to the loop. A stream is pushed: the engine's step
loop hands each step's outputs straight to the outbox (Engine.push_stream), with no task
per stream between them; a call is a task awaiting LocalEngine. What reaches the outbox
in one loop turn (after an engine step: every stream's new tokens) leaves in one
message, so relaying costs one message per step, not one per token. The process
ends on "close", when the pipe closes, or when its parent is gone.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from adapterserve.engine.request import RequestOutput, RequestTimes
from adapterserve.server.engine_process import wire
from adapterserve.server.engine_process.local import LocalEngine

_MOST_AT_ONCE = 64  # messages the reader hands over in one callback: a flood still reaches the loop
_EXIT_GRACE_S = 10.0  # after the parent went away, how long the loop may take to stop


def main(conn: Connection, model_dir: str, engine_kwargs: dict[str, Any], parent_pid: int,
         coalesce: bool = True) -> None:
    """The process's target: build the engine, report its facts (or the failure), serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the parent to handle
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # warm-up progress
    try:
        engine = LocalEngine.from_pretrained(model_dir, engine_kwargs)
    except Exception as exc:
        traceback.print_exc()
        wire.send(conn, ("failed", wire.portable(exc)))
        return
    gc.collect()  # startup's garbage goes; what is left (the engine, warmed up) stays out of later
    gc.freeze()  # collections' scans, as Serve does in its replicas (this process is not one)
    wire.send(conn, ("ready", engine.facts))
    asyncio.run(EngineServer(engine, conn, parent_pid, coalesce).serve())
    engine.close()  # a tensor-parallel engine's workers stop with it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing left to clean up but the interpreter, whose teardown (torch) takes a second


class EngineServer:
    def __init__(self, engine: LocalEngine, conn: Connection, parent_pid: int, coalesce: bool = True) -> None:
        self.engine, self.conn, self.parent_pid = engine, conn, parent_pid
        self.coalesce = coalesce  # take every message waiting in the pipe in one loop callback
        self.tasks: dict[int, asyncio.Task] = {}  # calls running
        self.streams: dict[int, _PushedStream] = {}  # streams running
        self.outbox: list[tuple[int, bool, Any]] = []

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        threading.Thread(target=self._read, name="engine-commands", daemon=True).start()
        await self.stopping.wait()
        for call_id in list(self.streams):
            self._end_stream(call_id)  # aborts the engine requests
        for task in list(self.tasks.values()):
            task.cancel()  # aborts the engine requests
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    # commands

    def _read(self) -> None:
        """Reader thread: the commands to the loop, those waiting together in one callback (so
        that a burst is added before the step loop plans its next step); on EOF (or an orphaned
        child) stop it."""
        try:
            while os.getppid() == self.parent_pid:
                if self.conn.poll(1.0):
                    messages = _received(self.conn)
                    while self.coalesce and len(messages) < _MOST_AT_ONCE and self.conn.poll(0):
                        messages += _received(self.conn)
                    self.loop.call_soon_threadsafe(self._handle_all, messages)
        except (EOFError, OSError):
            pass
        except Exception:  # a command that does not unpickle: stop rather than leave its caller waiting
            traceback.print_exc()
        try:
            self.loop.call_soon_threadsafe(self.stopping.set)
        except RuntimeError:  # the loop already ended
            return
        time.sleep(_EXIT_GRACE_S)
        os._exit(0)  # the loop did not stop (a step that never ends): nobody is left to serve

    def _handle_all(self, messages: list[tuple]) -> None:
        for message in messages:
            self._handle(message)

    def _handle(self, message: tuple) -> None:
        op, *args = message
        if op == "stream":
            self._stream(*args)
        elif op == "call":
            self._start(args[0], self._call(*args))
        elif op == "abort" and args[0] in self.tasks:
            self.tasks[args[0]].cancel()
        elif op == "abort":
            self._end_stream(args[0])
        elif op == "close":
            self.stopping.set()

    def _start(self, call_id: int, work) -> None:
        task = self.loop.create_task(work)
        self.tasks[call_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(call_id, None))

    def _stream(self, call_id: int, prompt, sampling, adapter_id, request_id, timed: bool,
                cache_salt: str = "") -> None:
        stream = _PushedStream(self, call_id, RequestTimes() if timed else None)
        try:
            stream.request = self.engine.push_stream(prompt, sampling, adapter_id, request_id, stream.times,
                                                     cache_salt, stream.put)
        except Exception as exc:  # refused (a bad request, an unknown adapter)
            stream.fail(exc)
            return
        self.streams[call_id] = stream

    def _end_stream(self, call_id: int) -> None:
        """No more outputs of that stream; its request is aborted unless done (frees its KV blocks)."""
        stream = self.streams.pop(call_id, None)
        if stream is not None:
            self.engine.end_push(stream.request)

    async def _call(self, call_id: int, method: str, args: tuple) -> None:
        try:
            if method not in wire.CALLS:
                raise RuntimeError(f"the engine process has no call {method!r}")
            result = await getattr(self.engine, method)(*args)
        except Exception as exc:
            self._post(call_id, False, wire.portable(exc))
        else:
            self._post(call_id, True, result)

    # replies

    def _post(self, call_id: int, ok: bool, value: Any) -> None:
        if not self.outbox:
            self.loop.call_soon(self._flush)  # after every task this loop turn woke
        self.outbox.append((call_id, ok, value))

    def _flush(self) -> None:
        entries, self.outbox = self.outbox, []
        try:
            self._send(entries)
        except Exception as exc:  # a value that does not pickle: its callers must not wait forever
            traceback.print_exc()
            error = RuntimeError(f"the engine process could not send a result: {type(exc).__name__}: {exc}")
            self._send([(call_id, False, error) for call_id, _, _ in entries])

    def _send(self, entries: list[tuple[int, bool, Any]]) -> None:
        try:
            wire.send(self.conn, (entries, self.engine.last_load))
        except OSError:  # the parent is gone
            self.stopping.set()


def _received(conn: Connection) -> list[tuple]:
    """The next message, a "streams" batch taken apart into its starts."""
    op, *args = message = wire.recv(conn)
    return [wire.decode(start) for start in args[0]] if op == "streams" else [message]


class _PushedStream:
    """One stream's outputs as they leave the engine's steps, posted as the parent reads them
    (wire.py): the first as wire.head, later ones as (token_ids, text, finish_reason,
    index); a timed stream's RequestTimes before each finishing chunk and before an error."""

    def __init__(self, server: EngineServer, call_id: int, times: RequestTimes | None) -> None:
        self.server, self.call_id, self.times = server, call_id, times
        self.request = None  # the engine's, once added
        self.first = True
        self.finished = 0  # choices finished

    def put(self, out: RequestOutput | BaseException) -> None:
        if isinstance(out, BaseException) or out.error is not None:
            self.fail(out if isinstance(out, BaseException) else out.error)
            self.server._end_stream(self.call_id)
            return
        if self.times is not None and out.finished:  # in the same message as the last chunk, before it
            self.server._post(self.call_id, True, self.times)
        later = (out.token_ids, out.text, out.finish_reason, out.index)
        self.server._post(self.call_id, True, wire.head(out) if self.first else later)
        self.first = False
        self.finished += out.finished
        if self.finished == self.request.sampling.n:
            self.server._end_stream(self.call_id)

    def fail(self, exc: BaseException) -> None:
        if self.times is not None:  # how far it got
            self.server._post(self.call_id, True, self.times)
        self.server._post(self.call_id, False, wire.portable(exc))
