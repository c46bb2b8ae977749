"""Calls that hold a place at the server without doing anything: UploadAdapter streams that
never send a message, held until cancelled. For admission and quota tests."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from adapterserve.proto import adapterserve_pb2 as pb


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll a server-side fact that no event reports to the client."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def hold_uploads(stub, count: int, metadata) -> list:
    """count UploadAdapter calls that send nothing; each holds its place until cancelled."""
    never = asyncio.Event()

    async def nothing():
        await never.wait()
        yield pb.UploadAdapterRequest()  # never sent: the call is cancelled first

    return [stub.UploadAdapter(nothing(), metadata=metadata, timeout=300) for _ in range(count)]


async def held_while(stub, count: int, metadata, placed: Callable[[], bool], what: str) -> list:
    """hold_uploads, returned once ``placed()`` says the server counts them all."""
    held = hold_uploads(stub, count, metadata)
    await asyncio.to_thread(wait_until, placed, what)
    return held
