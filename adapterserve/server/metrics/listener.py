"""The metrics port (`metrics.port`, `--metrics-port`): a listener of its own, in the metrics
hub, answering `GET /metrics` with every series (the full view) and nothing else.

It names private adapters and tenants: keep it where only operators reach it. It reads one
request head per connection (HTTP/1.x, no body), answers and closes, and bounds what a
client can hold: a head must arrive within READ_TIMEOUT_S and fit HEAD_LIMIT bytes (else
408 / 431), at most MAX_CONNECTIONS are open at once (beyond: 503 at once), and an answer
not taken within WRITE_TIMEOUT_S is dropped. Another path gets 404, another method 405,
bytes that are no HTTP request 400.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

from adapterserve.server.metrics.exposition import CONTENT_TYPE

logger = logging.getLogger("adapterserve.server")
MAX_CONNECTIONS = 32
HEAD_LIMIT = 16 << 10
READ_TIMEOUT_S = WRITE_TIMEOUT_S = 5.0
RETRY_BIND_S = 2.0
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def answer(head: bytes, render: Callable[[], bytes]) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, extra headers) for one request head (the bytes before its blank line)."""
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return 400, b"not an HTTP/1 request: this port serves GET /metrics\n", {}
    method, path = parts[0], parts[1].split(b"?", 1)[0]
    if path != b"/metrics":
        return 404, b"no such path: this port serves GET /metrics\n", {}
    if method not in (b"GET", b"HEAD"):
        return 405, b"/metrics takes GET\n", {"Allow": "GET, HEAD"}
    body = render()
    return 200, b"" if method == b"HEAD" else body, {"Content-Type": CONTENT_TYPE, "Content-Length": str(len(body))}


class MetricsListener:
    def __init__(self, host: str, port: int, render: Callable[[], bytes]) -> None:
        self.host, self.port, self._render = host, port, render
        self._open = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Serve from now on (on the running event loop), binding as soon as the port is free."""
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        sock = await self._bind()
        if sock is None:
            return
        server = await asyncio.start_server(self._connection, sock=sock, limit=HEAD_LIMIT)
        logger.info("metrics: serving GET /metrics on %s:%d", self.host, self.port)
        async with server:
            await server.serve_forever()

    async def _bind(self) -> socket.socket | None:
        warned = False
        while True:
            try:
                return _bound(self.host, self.port)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    logger.error("metrics: cannot listen on %s:%d (%s); the metrics port is off", self.host,
                                 self.port, exc.strerror)
                    return None
                if not warned:  # an earlier hub still holds it, or another program: wait for it
                    logger.warning("metrics: port %d on %s is in use; retrying every %g s", self.port, self.host,
                                   RETRY_BIND_S)
                    warned = True
            await asyncio.sleep(RETRY_BIND_S)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open > MAX_CONNECTIONS:
                await _send(writer, 503, b"too many connections to the metrics port; retry\n", {"Retry-After": "1"})
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            except asyncio.LimitOverrunError:
                await _send(writer, 431, b"request head over 16 KiB\n", {})
                return
            except (TimeoutError, asyncio.IncompleteReadError):
                await _send(writer, 408, b"no complete request head\n", {})
                return
            await _send(writer, *answer(head, self._render))
        except (ConnectionError, TimeoutError):
            pass  # the client went away, or does not read its answer
        finally:
            self._open -= 1
            writer.close()


async def _send(writer: asyncio.StreamWriter, status: int, body: bytes, headers: dict[str, str]) -> None:
    head = {"Content-Type": "text/plain; charset=utf-8", "Content-Length": str(len(body)), **headers,
            "Connection": "close"}
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", *(f"{k}: {v}" for k, v in head.items()), "", ""]
    writer.write("\r\n".join(lines).encode() + body)
    await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)


def _bound(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
