"""The replica's end of a front worker's link: each forwarded call runs the Ingress's own
handler (or the listener's health handler) on the replica's loop, with a BridgedContext,
and its replies and end go back to the worker as frames.

Frames from the worker: ("call", id, path, metadata, peer, request bytes or None for a
client stream), ("msg", id, bytes) and ("half", id) for a client stream's messages and its
end, ("cancel", id) when the caller went away. To the worker: ("msg", id, bytes),
("end", id, code, details, trailing metadata), and ("ack", id) for each client-stream
message the handler took (the worker sends worker.CLIENT_WINDOW ahead, no more).
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from adapterserve.server.front.context import Aborted, BridgedContext
from adapterserve.server.front.frames import Frame, FrameLink
from adapterserve.server.front.methods import METHODS, Method
from adapterserve.server.grpc_services import safe_parser
from adapterserve.server.replica_grpc import ListenerHealth

FAILED = "the server failed on this call; see the replica's log"
logger = logging.getLogger("adapterserve.server")
# each method's request parser, an Undecodable for bytes that do not parse (as on the replica's own loop)
PARSERS = {path: safe_parser(path, m.request_type.FromString) for path, m in METHODS.items()}


def handlers(servicer: Any) -> dict[str, Callable]:
    """Method path -> the handler that serves it on the replica's own listener."""
    health = ListenerHealth(servicer)
    return {path: getattr(health if m.service == "grpc.health.v1.Health" else servicer, m.name, _unimplemented)
            for path, m in METHODS.items()}


async def _unimplemented(request: Any, context: BridgedContext) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this method is not served here")


class _ClientStream:
    """A forwarded client stream's messages, parsed as the handler takes them."""

    def __init__(self, method: Method, call_id: int, link: FrameLink) -> None:
        self._parse = PARSERS[method.path]
        self._id, self._link = call_id, link
        self._messages: deque[bytes | None] = deque()  # None: the stream ended
        self._arrived = asyncio.Event()

    def put(self, payload: bytes | None) -> None:
        self._messages.append(payload)
        self._arrived.set()

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            while not self._messages:
                self._arrived.clear()
                await self._arrived.wait()
            payload = self._messages.popleft()
            if payload is None:
                return
            self._link.send(("ack", self._id))
            yield self._parse(payload)


class FrontBridge:
    """Runs one worker's forwarded calls."""

    def __init__(self, handlers_by_path: dict[str, Callable], link: FrameLink) -> None:
        self._handlers, self._link = handlers_by_path, link
        self._tasks: dict[int, asyncio.Task] = {}
        self._streams: dict[int, _ClientStream] = {}

    def on_batch(self, frames: list[Frame]) -> None:
        for frame in frames:
            kind, call_id = frame[0], frame[1]
            if kind == "call":
                self._start(call_id, *frame[2:])
            elif kind == "msg" or kind == "half":
                if (stream := self._streams.get(call_id)) is not None:
                    stream.put(frame[2] if kind == "msg" else None)
            elif kind == "cancel":
                if (task := self._tasks.get(call_id)) is not None:
                    task.cancel()

    def lost(self) -> None:
        """The worker went: its callers are gone, so are their calls."""
        for task in list(self._tasks.values()):
            task.cancel()

    def _start(self, call_id: int, path: str, metadata: tuple, peer: str, payload: bytes | None) -> None:
        method = METHODS[path]  # the worker forwards only these
        context = BridgedContext(metadata, peer)
        if payload is None:
            request = self._streams[call_id] = _ClientStream(method, call_id, self._link)
        else:
            request = PARSERS[path](payload)
        task = asyncio.get_running_loop().create_task(self._run(call_id, method, request, context))
        self._tasks[call_id] = task

    async def _run(self, call_id: int, method: Method, request: Any, context: BridgedContext) -> None:
        handler, send = self._handlers[method.path], self._link.send
        try:
            if method.server_streaming:
                async for reply in handler(request, context):
                    send(("msg", call_id, reply.SerializeToString()))
            else:
                send(("msg", call_id, (await handler(request, context)).SerializeToString()))
        except Aborted:
            pass
        except asyncio.CancelledError:  # the caller went away: the worker expects nothing more
            return
        except Exception:
            logger.exception("a call forwarded by a front worker failed (%s)", method.path)
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(FAILED)
        finally:
            self._tasks.pop(call_id, None)
            self._streams.pop(call_id, None)
        send(("end", call_id, *context.end()))
