"""A stream's outputs waiting for their reader, who may pause to let more arrive.

A reader that relays each chunk at a fixed cost (a server) can wait a little after each
one, so that the tokens arriving meanwhile leave as one chunk (merge_chunks). `settle`
is that wait, and it ends early when the stream's end arrives: a finishing chunk or an
error is never held back.
"""
from __future__ import annotations

import asyncio
from typing import Any


class OutputQueue(asyncio.Queue):
    """An asyncio.Queue of a stream's outputs (RequestOutput, or an exception to raise)."""

    def __init__(self) -> None:
        super().__init__()
        self._ends_waiting = 0  # outputs waiting that end a choice, or errors
        self._settling: asyncio.Future | None = None

    def _put(self, item: Any) -> None:  # asyncio.Queue's hook, under put and put_nowait
        super()._put(item)
        if _ends(item):
            self._ends_waiting += 1
            if self._settling is not None and not self._settling.done():
                self._settling.set_result(None)

    def _get(self) -> Any:  # under get and get_nowait
        item = super()._get()
        if _ends(item):
            self._ends_waiting -= 1
        return item

    async def settle(self, pause_s: float) -> None:
        """Wait `pause_s` seconds, or less: until an output that ends a choice (or an error)
        is put, at once if one is waiting."""
        if pause_s <= 0 or self._ends_waiting:
            return
        loop = asyncio.get_running_loop()
        self._settling = loop.create_future()
        timer = loop.call_later(pause_s, _wake, self._settling)
        try:
            await self._settling
        finally:
            timer.cancel()
            self._settling = None


def _ends(item: Any) -> bool:
    return isinstance(item, BaseException) or item.finished or item.error is not None


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
