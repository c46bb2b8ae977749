"""The scale benchmark's clients: closed-loop streams over gRPC, split over worker processes
(a single Python client would be the bottleneck at several replicas' throughput).

Each worker keeps its share of the streams busy: a stream that ends starts the next request
of the worker's list. Times are time.monotonic() (one clock for every process of the host).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Done:
    index: int  # the request's place in the list
    start: float
    first: float  # when its first chunk came
    end: float
    tokens: int


Job = tuple[int, str | None, list[int], int]  # index, adapter name (None: base), prompt ids, max_tokens


async def _one(client, job: Job) -> Done:
    index, adapter, prompt, max_tokens = job
    start, first, tokens = time.monotonic(), None, 0
    async for chunk in client.stream(prompt, adapter=adapter, max_tokens=max_tokens, temperature=0.0,
                                     ignore_eos=True):
        if first is None:
            first = time.monotonic()
        tokens += len(chunk.token_ids)
    return Done(index, start, first if first is not None else time.monotonic(), time.monotonic(), tokens)


async def _streams(target: str, jobs: list[Job], concurrency: int, ready=None) -> list[Done]:
    """`jobs` through `concurrency` streams; with `ready` (a barrier), once every worker is up."""
    from adapterserve.clients.client import AsyncClient

    queue = list(reversed(jobs))
    done: list[Done] = []
    async with AsyncClient(target, timeout=1800) as client:
        if ready is not None:
            await asyncio.to_thread(ready.wait)  # the workers start together: no skew in the wall time

        async def stream() -> None:
            while queue:
                done.append(await _one(client, queue.pop()))

        await asyncio.gather(*[stream() for _ in range(concurrency)])
    return done


def _worker(args: tuple) -> list[Done]:
    return asyncio.run(_streams(*args))


def run_load(target: str, jobs: list[Job], concurrency: int, workers: int) -> list[Done]:
    """Every job through `concurrency` streams in all, over `workers` processes; sorted by index."""
    workers = max(1, min(workers, concurrency))
    if workers == 1:
        return sorted(_worker((target, jobs, concurrency)), key=lambda d: d.index)
    context = multiprocessing.get_context("spawn")  # no fork of a Ray driver
    with context.Manager() as manager, context.Pool(workers) as pool:
        ready = manager.Barrier(workers)
        shares = [(target, jobs[w::workers], concurrency // workers + (w < concurrency % workers), ready)
                  for w in range(workers)]
        found = [d for part in pool.map(_worker, shares) for d in part]
    return sorted(found, key=lambda d: d.index)
