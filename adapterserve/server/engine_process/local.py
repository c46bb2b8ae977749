"""LocalEngine: an engine in this process behind the async API a replica uses.

EngineProcess offers the same API with the engine in a child process (which runs
a LocalEngine). Decoders batch classify/embed with streams through their step
loop; an EncoderEngine runs each call at once, off the event loop (encoder_calls.py
times them for health).
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.engine.async_front import Prompt
from adapterserve.engine.request import ClassifyOutput, EmbedOutput, Request, RequestOutput, RequestTimes
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.errors import AdapterNotFound
from adapterserve.server.engine_process.encoder_calls import EncoderCalls
from adapterserve.server.engine_process.facts import EngineFacts, EngineLoad
from adapterserve.server.engine_process.report import EngineReport, decoder_report, encoder_report

AdapterIds = Sequence[str | None] | str | None


class LocalEngine:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.facts = EngineFacts.of(engine)
        self.engine_id = uuid.uuid4().hex  # names this engine's counts in its reports
        self._encoder_calls = EncoderCalls()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, engine_kwargs: Mapping[str, Any] | None = None) -> LocalEngine:
        from adapterserve.engine.engine import Engine  # torch and the model code: only where it runs

        return cls(Engine.from_pretrained(model_dir, **dict(engine_kwargs or {})))

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, adapter_id: str | None = None,
               request_id: str | None = None, times: RequestTimes | None = None, cache_salt: str = "",
               pause_s: Callable[[], float] | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Engine.stream, as it is: closing it early (or cancelling its task) aborts the request."""
        return self.engine.stream(prompt, sampling, adapter_id, request_id, times, cache_salt, pause_s)

    def push_stream(self, prompt: Prompt, sampling: SamplingParams | None, adapter_id: str | None,
                    request_id: str | None, times: RequestTimes | None, cache_salt: str,
                    to: Callable[[RequestOutput | BaseException], None]) -> Request:
        """Engine.push_stream: each step's output goes to `to`; end it with end_push."""
        return self.engine.push_stream(prompt, sampling, adapter_id, request_id, times, cache_salt, to)

    def end_push(self, request: Request) -> None:
        self.engine.end_push(request)

    async def classify(self, texts: Sequence[Prompt], adapter_ids: AdapterIds) -> list[ClassifyOutput]:
        if self.facts.encoder:
            return await self._encoder_calls.run(self.engine.classify, texts, adapter_ids)
        return await self.engine.classify_async(texts, adapter_ids)

    async def embed(self, texts: Sequence[Prompt], adapter_ids: AdapterIds = None) -> list[EmbedOutput]:
        if self.facts.encoder:
            return await self._encoder_calls.run(self.engine.embed, texts, adapter_ids)
        return await self.engine.embed_async(texts, adapter_ids)

    async def add_adapter(self, adapter_id: str, adapter: Adapter, pinned: bool = False) -> None:
        await asyncio.to_thread(self.engine.add_adapter, adapter_id, adapter, pinned)

    async def unload_adapter(self, adapter_id: str) -> None:
        await asyncio.to_thread(self.engine.unload_adapter, adapter_id)

    def discard_adapter(self, adapter_id: str) -> None:
        """Unload if loaded; callable from any thread, outside the event loop (Serve's evictions)."""
        try:
            self.engine.unload_adapter(adapter_id)
        except AdapterNotFound:
            pass

    async def load(self) -> EngineLoad:
        return self.last_load

    async def stats(self) -> EngineReport:
        """Load and counts for metrics."""
        if self.facts.encoder:
            return encoder_report(self.engine_id, self.engine, self._encoder_calls.running)
        return decoder_report(self.engine_id, self.engine)

    @property
    def last_load(self) -> EngineLoad:
        if self.facts.encoder:
            return EngineLoad(broken=self._encoder_calls.broken, stalled_s=self._encoder_calls.busy_s())
        return EngineLoad.of(self.engine)

    @property
    def alive(self) -> bool:
        return True

    @property
    def pid(self) -> int | None:
        return None  # no process of its own

    def close(self) -> None:
        self.engine.close()  # a tensor-parallel engine's workers
