"""The engine's asyncio front: streams, async classify/embed, and the step loop that
serves them.

One loop task per engine runs `step` in a worker thread while any request is
unfinished and hands each step's outputs to their waiters. When a step has nothing
to do (every waiting request needs an adapter that is still loading, say) the loop
sleeps until a request arrives or a short, growing pause passes: it never spins.
A request that fails alone (its error in the output) raises in its own stream; an
engine that breaks fails every waiter with EngineBroken and the loop ends.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

from adapterserve.engine.output_queue import OutputQueue
from adapterserve.engine.request import ClassifyOutput, EmbedOutput, Request, RequestOutput, RequestTimes
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.errors import EngineBroken, RequestError

Prompt = str | Sequence[int]
_IDLE_PAUSE_S = (0.001, 0.05)  # first and longest pause of a step loop with nothing to run


class AsyncFront:
    """Mixed into Engine: needs add_request, abort, step, has_unfinished and _in_flight."""

    def _init_async_front(self) -> None:
        self._streams: dict[str, Callable[[RequestOutput | BaseException], None]] = {}  # request id -> its put
        self._pooling: dict[str, tuple[object, asyncio.Future]] = {}  # request id -> (request, future)
        self._loop_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    async def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None, adapter_id: str | None = None,
        request_id: str | None = None, times: RequestTimes | None = None, cache_salt: str = "",
        pause_s: Callable[[], float] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield new tokens and text as steps produce them; the last chunk has finish_reason.
        With sampling.n > 1 each chunk is one choice's (its `index`), and each choice ends with
        its own finish_reason; the stream ends after the last. Steps that finished while the
        consumer was busy arrive merged in one chunk per choice, so a slow consumer (a server
        relaying each chunk) pays per chunk, not per token.
        Closing the iterator early (or cancelling its task) aborts the request. A request
        that fails raises its error here. `times`, if given, gets the request's stage times
        (before each chunk that reaches a stage is yielded). `cache_salt`: as for add_request.
        `pause_s`: after each chunk the consumer took, wait up to pause_s() seconds for more
        tokens to merge into the next (output_queue.py: a finishing chunk ends the wait)."""
        queue = OutputQueue()
        if times is not None:
            times.added_ns = time.time_ns()
        request = self.add_request(prompt, sampling, adapter_id, request_id, times=times, cache_salt=cache_salt)
        self._streams[request.request_id] = queue.put_nowait
        self._ensure_loop()
        try:
            unfinished = request.sampling.n
            while unfinished:
                for chunk in merge_chunks([await queue.get()], queue):
                    unfinished -= chunk.finished
                    if times is not None:
                        _stamp(times, chunk, unfinished == 0)
                    yield chunk
                if unfinished and pause_s is not None:
                    await queue.settle(pause_s())
        finally:
            self._streams.pop(request.request_id, None)
            if not request.done:
                self.abort(request.request_id)

    def push_stream(
        self, prompt: Prompt, sampling: SamplingParams | None, adapter_id: str | None, request_id: str | None,
        times: RequestTimes | None, cache_salt: str, to: Callable[[RequestOutput | BaseException], None],
    ) -> Request:
        """stream() without a task to consume it: each step's output for this request (one per
        choice that advanced), or the error that ends it, is passed to `to` on the event loop
        as the step ends. `times` is stamped as stream() stamps it. Call end_push(request) once
        its last choice finished or an error came, or to abort it."""
        if times is not None:
            times.added_ns = time.time_ns()
        request = self.add_request(prompt, sampling, adapter_id, request_id, times=times, cache_salt=cache_salt)
        self._streams[request.request_id] = to if times is None else _Stamped(to, times, request.sampling.n)
        self._ensure_loop()
        return request

    def end_push(self, request: Request) -> None:
        """No more outputs of a pushed stream; the request is aborted unless it is done."""
        self._streams.pop(request.request_id, None)
        if not request.done:
            self.abort(request.request_id)

    async def classify_async(self, texts: Sequence[Prompt], adapter_ids: Sequence[str] | str) -> list[ClassifyOutput]:
        """classify, batched by the running step loop with streams and other requests."""
        return await self._pool_async(texts, adapter_ids, "classify")

    async def embed_async(self, texts: Sequence[Prompt],
                          adapter_ids: Sequence[str | None] | str | None = None) -> list[EmbedOutput]:
        return await self._pool_async(texts, adapter_ids, "embed")

    async def _pool_async(self, texts, adapter_ids, task: str) -> list:
        if isinstance(texts, str):
            raise RequestError(f"{task} takes a list of texts; use [text] for one")
        ids = per_prompt(adapter_ids, len(texts), "adapter_ids")
        loop = asyncio.get_running_loop()
        requests = []
        try:
            for text, adapter_id in zip(texts, ids):
                requests.append(self.add_request(text, SamplingParams(max_tokens=1), adapter_id, task=task))
            futures = [loop.create_future() for _ in requests]
            self._pooling.update({r.request_id: (r, f) for r, f in zip(requests, futures)})
            self._ensure_loop()
            return list(await asyncio.gather(*futures))
        finally:
            for r in requests:
                self._pooling.pop(r.request_id, None)
                if not r.finished:
                    self.abort(r.request_id)

    # the loop

    def _ensure_loop(self) -> None:
        if self._wake is not None:
            self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def _run_loop(self) -> None:
        pause = _IDLE_PAUSE_S[0]
        while self.has_unfinished():
            try:
                outputs = await asyncio.to_thread(self.step)
            except EngineBroken as exc:
                self._fail_waiters(exc)
                return
            self._deliver(outputs)
            if outputs or self._in_flight is not None:
                pause = _IDLE_PAUSE_S[0]
                await asyncio.sleep(0)
            else:  # nothing could run: wait for a new request, or try again a little later
                await self._idle(pause)
                pause = min(2 * pause, _IDLE_PAUSE_S[1])

    async def _idle(self, pause: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), pause)
        except asyncio.TimeoutError:
            pass

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            put = self._streams.get(out.request_id)
            if put is not None:
                put(out)
        for request, future in list(self._pooling.values()):
            if request.finished and not future.done():
                if request.error is not None:
                    future.set_exception(request.error)
                else:
                    future.set_result(request.result)

    def _fail_waiters(self, exc: BaseException) -> None:
        for put in list(self._streams.values()):  # a pushed stream's `to` may end it
            put(exc)
        for _, future in self._pooling.values():
            if not future.done():
                future.set_exception(exc)


class _Stamped:
    """A pushed stream's `to`, stamping its times first (the first token; the end with the last choice's)."""

    def __init__(self, to: Callable[[RequestOutput | BaseException], None], times: RequestTimes, choices: int) -> None:
        self.to, self.times, self.unfinished = to, times, choices

    def __call__(self, out: RequestOutput | BaseException) -> None:
        if isinstance(out, RequestOutput) and out.error is None:
            self.unfinished -= out.finished
            _stamp(self.times, out, self.unfinished == 0)
        self.to(out)


def _stamp(times: RequestTimes, chunk: RequestOutput, last: bool) -> None:
    """The first token's time (at the first chunk) and the end's (at the last)."""
    now = time.time_ns()
    if not times.first_token_ns:
        times.first_token_ns = now
    if last:
        times.finished_ns = now


def merge_chunks(chunks: list, queue: asyncio.Queue) -> list[RequestOutput]:
    """The first chunk and every chunk already waiting, merged into one per choice (in the
    order the choices first appear); an error (an exception put in the queue, or a chunk
    that carries one) raises."""
    while not queue.empty():
        chunks.append(queue.get_nowait())
    by_choice: dict[int, list[RequestOutput]] = {}
    for c in chunks:
        if isinstance(c, BaseException):
            raise c
        if c.error is not None:
            raise c.error
        by_choice.setdefault(c.index, []).append(c)
    return [_merged(run) for run in by_choice.values()]


def _merged(chunks: list[RequestOutput]) -> RequestOutput:
    """Consecutive chunks of one choice as one."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    return RequestOutput(last.request_id, [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                         last.finish_reason, last.adapter_id, last.prompt_token_ids, cached_tokens=last.cached_tokens,
                         index=last.index)


def per_prompt(value, n: int, name: str) -> list:
    """One value per prompt: a single value repeated, or a sequence of exactly n."""
    if value is None or isinstance(value, (SamplingParams, str)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise RequestError(f"{name} has {len(value)} entries for {n} prompts")
    return value
