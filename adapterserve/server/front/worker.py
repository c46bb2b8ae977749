"""A front worker: a process of its own that serves the replica's gRPC port beside the other
workers (SO_REUSEPORT: the kernel spreads connections over them) and forwards every call to
the replica over its link (bridge.py), so the HTTP/2, the message bytes and the streams'
writes of many calls run on several cores while the replica runs only its handlers.

    python -m adapterserve.server.front.worker --fd N --address HOST:PORT

Imports gRPC and the protos only (no torch, no Ray). Exits when the replica says stop (after
its calls finish, within the grace the replica gives) or when the link goes (its calls end
UNAVAILABLE: the replica behind them is gone).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from adapterserve.server.front.frames import Frame, FrameLink
from adapterserve.server.front.methods import METHODS, Method
from adapterserve.server.front.options import worker_options

CLIENT_WINDOW = 4  # client-stream messages sent ahead of the replica's acks (bridge.py acks each)
GONE = "the replica behind this port went away; retry (another replica takes its place)"


class _End:
    __slots__ = ("code", "details", "trailing")

    def __init__(self, code: int, details: str, trailing: tuple) -> None:
        self.code, self.details, self.trailing = code, details, trailing


_CODES = {code.value[0]: code for code in grpc.StatusCode}
LOST = _End(grpc.StatusCode.UNAVAILABLE.value[0], GONE, ())


class _Call:
    """One forwarded call's replies as they come back, and (a client stream) its send credit."""

    __slots__ = ("items", "waiter", "credit", "credited")

    def __init__(self) -> None:
        self.items: deque[bytes | _End] = deque()
        self.waiter: asyncio.Future | None = None
        self.credit = CLIENT_WINDOW
        self.credited = asyncio.Event()

    def put(self, item: bytes | _End) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def ack(self) -> None:
        self.credit += 1
        self.credited.set()

    async def next(self) -> bytes | _End:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.items.popleft()

    async def spend_credit(self) -> None:
        while self.credit <= 0:
            self.credited.clear()
            await self.credited.wait()
        self.credit -= 1


class Forwarder:
    """The worker's side of the link: opens a call per gRPC call, routes the replies back."""

    def __init__(self, link: FrameLink) -> None:
        self._link = link
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self.stop_grace: asyncio.Future = asyncio.get_running_loop().create_future()

    def on_batch(self, frames: list[Frame]) -> None:
        calls = self._calls
        for frame in frames:
            kind = frame[0]
            if kind == "stop":
                if not self.stop_grace.done():
                    self.stop_grace.set_result(frame[1])
            elif (call := calls.get(frame[1])) is not None:
                if kind == "msg":
                    call.put(frame[2])
                elif kind == "end":
                    call.put(_End(*frame[2:]))
                elif kind == "ack":
                    call.ack()

    def lost(self) -> None:
        """The link went: every call ends UNAVAILABLE, and the worker stops."""
        for call in self._calls.values():
            call.put(LOST)
        if not self.stop_grace.done():
            self.stop_grace.set_result(0.0)

    def handler(self, method: Method) -> grpc.RpcMethodHandler:
        """grpc's handler for `method`: requests and replies stay bytes (no (de)serializers).
        grpc.aio tells a streaming handler by its being an async generator function, so each
        method gets bound methods of its own."""
        bound = _Bound(self, method)
        make: Callable = getattr(grpc, f"{method.kind}_rpc_method_handler")
        return make(bound.replies if method.server_streaming else bound.reply)

    async def replies(self, method: Method, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Forward the call; yield its replies; end it with the replica's status."""
        call_id, call = next(self._ids), _Call()
        self._calls[call_id] = call
        metadata = tuple((key, value) for key, value in context.invocation_metadata() or ())
        streaming_in = method.client_streaming
        self._link.send(("call", call_id, method.path, metadata, context.peer(), None if streaming_in else request))
        if self._link.closed:
            call.put(LOST)
        sending = asyncio.ensure_future(self._send_stream(call_id, call, request)) if streaming_in else None
        ended = False
        try:
            while True:
                item = await call.next()
                if type(item) is _End:
                    ended = True
                    await _finish(context, item)
                    return
                yield item
        finally:
            self._calls.pop(call_id, None)
            if sending is not None:
                sending.cancel()
            if not ended:  # the caller went away: the replica drops the call
                self._link.send(("cancel", call_id))

    async def _send_stream(self, call_id: int, call: _Call, requests: AsyncIterator[bytes]) -> None:
        async for payload in requests:
            await call.spend_credit()
            self._link.send(("msg", call_id, payload))
        self._link.send(("half", call_id))


class _Bound:
    """One method's handlers, as bound methods (see Forwarder.handler)."""

    def __init__(self, forwarder: Forwarder, method: Method) -> None:
        self._forwarder, self._method = forwarder, method

    async def replies(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for reply in self._forwarder.replies(self._method, request, context):
            yield reply

    async def reply(self, request: Any, context: grpc.aio.ServicerContext) -> bytes:
        reply = b""
        async for reply in self._forwarder.replies(self._method, request, context):
            pass
        return reply


async def _finish(context: grpc.aio.ServicerContext, end: _End) -> None:
    if end.code != 0:
        await context.abort(_CODES.get(end.code, grpc.StatusCode.UNKNOWN), end.details, tuple(end.trailing))
    if end.trailing:
        context.set_trailing_metadata(end.trailing)


def build_server(forwarder: Forwarder) -> grpc.aio.Server:
    server = grpc.aio.server(options=worker_options())
    by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
    for method in METHODS.values():
        by_service.setdefault(method.service, {})[method.name] = forwarder.handler(method)
    for service, handlers in by_service.items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        if hasattr(server, "add_registered_method_handlers"):  # grpcio 1.63+: looked up without the generic path
            server.add_registered_method_handlers(service, handlers)
    return server


async def serve(fd: int, address: str) -> int:
    """Serve `address` until told to stop or the link goes; the exit code."""
    link = await FrameLink.over(socket.socket(fileno=fd))
    forwarder = Forwarder(link)
    server = build_server(forwarder)
    try:
        server.add_insecure_port(address)
    except RuntimeError as exc:
        link.send(("failed", f"{address} cannot be bound: {exc}"))
        await asyncio.sleep(0)
        link.close()
        return 2
    await server.start()
    link.send(("ready", os.getpid()))
    pumping = asyncio.ensure_future(link.pump(forwarder.on_batch))
    pumping.add_done_callback(lambda _: forwarder.lost())
    grace = await forwarder.stop_grace
    await server.stop(grace)
    link.close()
    pumping.cancel()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="the link's socket, inherited from the replica")
    parser.add_argument("--address", required=True, help="host:port to serve (shared with the other workers)")
    args = parser.parse_args(argv)
    try:
        import uvloop  # as Ray's replicas run: a faster loop for grpc.aio's callbacks
    except ImportError:
        return asyncio.run(serve(args.fd, args.address))
    return uvloop.run(serve(args.fd, args.address))


if __name__ == "__main__":
    sys.exit(main())
