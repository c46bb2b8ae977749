"""A handle to an engine replica in this process: what the ingress calls in direct mode
(server/direct.py), with the part of Serve's DeploymentHandle interface it uses.

    handle = LocalHandle("EngineReplica", replica)
    chunks = handle.options(stream=True, multiplexed_model_id=h).generate.remote(request)
    async for chunk in chunks: ...        # chunks.cancel() closes the replica's stream
    facts = await handle.describe.remote()   # a task: await it, or cancel() it

There is one replica, so routing options (multiplexed_model_id) choose nothing and are
ignored. A call starts at once, as a Serve call does; a stream runs in the caller's task,
so a caller that is cancelled cancels the replica's stream with it.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol

_closing: set[asyncio.Task] = set()  # stream closes in flight (a task must be referenced until it ends)


class LocalStream:
    """The chunks of a streaming call (DeploymentResponseGenerator's part the ingress uses)."""

    def __init__(self, chunks: AsyncGenerator[Any, None]) -> None:
        self._chunks = chunks

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._chunks  # iterated as it is: no wrapper frame per chunk

    async def __anext__(self) -> Any:
        return await self._chunks.__anext__()

    def cancel(self) -> None:
        """Close the replica's stream (it aborts its request) unless it ended or runs now."""
        if self._chunks.ag_running:
            return  # being iterated: its caller's cancellation reaches it there
        closing = asyncio.get_running_loop().create_task(self._chunks.aclose())
        _closing.add(closing)
        closing.add_done_callback(_closing.discard)


class LocalReplica(Protocol):
    """What the ingress calls on an engine replica (replica.py's EngineReplica)."""

    def generate(self, request: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]: ...
    async def classify(self, request: dict[str, Any]) -> dict[str, Any]: ...
    async def embed(self, request: dict[str, Any]) -> dict[str, Any]: ...
    async def describe(self) -> dict[str, Any]: ...
    async def health(self) -> str | None: ...


class LocalMethod:
    def __init__(self, method: Callable[..., Any], stream: bool) -> None:
        self._method, self._stream = method, stream

    def remote(self, *args: Any) -> asyncio.Task | LocalStream:
        """The call, started: a LocalStream when the handle streams, else a task (await or cancel it)."""
        if self._stream:
            return LocalStream(self._method(*args))
        return asyncio.get_running_loop().create_task(self._method(*args))


class LocalHandle:
    """Calls `replica`'s methods as `handle.<method>.remote(...)`; its deployment_name names it
    in health reports."""

    def __init__(self, deployment_name: str, replica: LocalReplica, stream: bool = False) -> None:
        self.deployment_name = deployment_name
        self._replica, self._stream = replica, stream

    def options(self, *, stream: bool | None = None, multiplexed_model_id: str = "") -> LocalHandle:
        """The same replica, streaming or not; multiplexed_model_id: accepted, nothing to route."""
        return LocalHandle(self.deployment_name, self._replica, self._stream if stream is None else stream)

    @property
    def generate(self) -> LocalMethod:
        return LocalMethod(self._replica.generate, self._stream)

    @property
    def classify(self) -> LocalMethod:
        return LocalMethod(self._replica.classify, self._stream)

    @property
    def embed(self) -> LocalMethod:
        return LocalMethod(self._replica.embed, self._stream)

    @property
    def describe(self) -> LocalMethod:
        return LocalMethod(self._replica.describe, self._stream)

    @property
    def health(self) -> LocalMethod:
        return LocalMethod(self._replica.health, self._stream)
