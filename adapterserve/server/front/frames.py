"""Frames between a front worker and its replica: one Unix stream socket, both ways.

A write is a batch: every frame sent during one turn of the event loop goes out in one
length-prefixed pickle, so a step's chunks for many streams cost one syscall each way.
Both ends are this package's own processes over a socketpair the replica made (nothing
else can reach it), so pickle carries them.
"""
from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import Callable
from typing import Any

HEADER = struct.Struct("!I")  # the batch's length in bytes
MAX_BATCH_BYTES = 1 << 30  # far above any batch (messages are capped at 8 MiB): a bigger length is corruption
Frame = tuple[Any, ...]


class LinkClosed(ConnectionError):
    """The other end of the link went away."""


class FrameLink:
    """A framed, batched duplex link over a connected stream socket, on the running loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._pending: list[Frame] = []
        self.closed = False

    @classmethod
    async def over(cls, sock: Any) -> FrameLink:
        """A link over `sock`, a connected Unix stream socket."""
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    def send(self, frame: Frame) -> None:
        """Queue `frame`; the batch goes out at the end of this loop turn. Dropped once closed."""
        if self.closed:
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(frame)

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch or self.closed:
            return
        payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._writer.write(HEADER.pack(len(payload)) + payload)
        except (ConnectionError, RuntimeError):  # the peer went; the reader sees EOF and says so
            self.closed = True

    async def receive(self) -> list[Frame]:
        """The next batch; LinkClosed at end of stream."""
        try:
            header = await self._reader.readexactly(HEADER.size)
            (size,) = HEADER.unpack(header)
            if size > MAX_BATCH_BYTES:
                raise LinkClosed(f"a frame batch of {size} bytes: the link is out of step")
            return pickle.loads(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.closed = True
            raise LinkClosed("the other end of the front link went away") from exc

    async def pump(self, on_batch: Callable[[list[Frame]], None]) -> None:
        """Hand every batch to `on_batch` until the other end goes (returns then)."""
        try:
            while True:
                on_batch(await self.receive())
        except LinkClosed:
            return

    def close(self) -> None:
        if self.closed:
            return
        self._flush()
        self.closed = True
        self._writer.close()
