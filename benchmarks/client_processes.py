"""Clients in processes of their own, for the server benchmarks: K processes, each holding one
connection per server address, send their share of a group of streams at one agreed instant,
as K users on K machines would, so that the benchmark process's own gRPC work does not stand
in for the server's.

    with ClientProcesses(16) as clients:
        timings = await clients.group("127.0.0.1:50061", prompts, max_tokens=64)

A timing is (seconds to the first chunk, seconds to the last, gaps between chunks, tokens),
measured in the process that ran the stream from the agreed start. `traced_group` sends the
same way but names each call's trace (server_hops.py) and returns its server_hops.Sent.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any

START_AHEAD_S = 0.005  # the agreed instant: this far after the group is handed out
Timing = tuple[float, float, list[float], int]


def _serve_requests(conn: Any) -> None:
    async def run() -> None:
        from adapterserve.clients.client import AsyncClient

        from benchmarks.server_hops import stub_of, traced_call

        loop, clients, stubs = asyncio.get_running_loop(), {}, {}
        while (message := await loop.run_in_executor(None, conn.recv)) is not None:
            address, prompts, max_tokens, start_at, traced, adapter = message
            if traced and address not in stubs:
                stubs[address] = stub_of(address)
            elif not traced and address not in clients:
                clients[address] = AsyncClient(address, timeout=600)
            while time.perf_counter() < start_at:  # CLOCK_MONOTONIC: one clock for every process here
                await asyncio.sleep(0)
            if traced:
                calls = (traced_call(stubs[address], p, max_tokens, adapter) for p in prompts)
            else:
                client = clients[address]
                calls = (timed(client.stream(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True), start_at)
                         for p in prompts)
            conn.send(await asyncio.gather(*calls))

    asyncio.run(run())


async def timed(stream, start: float) -> Timing:
    """(first, total, gaps, tokens) of a stream of chunks, in seconds from `start`."""
    last, first, gaps, tokens = start, None, [], 0
    async for chunk in stream:
        now = time.perf_counter()
        if first is None:
            first = now - start
        else:
            gaps.append(now - last)
        tokens += len(chunk.token_ids)
        last = now
    return first, last - start, gaps, tokens


class ClientProcesses:
    def __init__(self, count: int) -> None:
        ctx = mp.get_context("spawn")
        self._conns, self._processes = [], []
        for _ in range(count):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=_serve_requests, args=(theirs,), daemon=True)
            process.start()
            self._conns.append(ours)
            self._processes.append(process)

    async def group(self, address: str, prompts: list[list[int]], max_tokens: int) -> list[Timing]:
        """Each prompt streamed from process i % count, all starting at one instant; in prompt order."""
        return await self._sent(address, prompts, max_tokens, False, None)

    async def traced_group(self, address: str, prompts: list[list[int]], max_tokens: int,
                           adapter: str | None = None) -> list:
        """group(), each call under a trace of its own: server_hops.Sent per prompt, in prompt order."""
        return await self._sent(address, prompts, max_tokens, True, adapter)

    async def _sent(self, address: str, prompts: list[list[int]], max_tokens: int, traced: bool,
                    adapter: str | None) -> list:
        shares = [prompts[i :: len(self._conns)] for i in range(len(self._conns))]
        start_at = time.perf_counter() + START_AHEAD_S
        used = [(conn, share) for conn, share in zip(self._conns, shares) if share]
        for conn, share in used:
            conn.send((address, share, max_tokens, start_at, traced, adapter))
        loop = asyncio.get_running_loop()
        replies = await asyncio.gather(*(loop.run_in_executor(None, conn.recv) for conn, _ in used))
        results: list = [None] * len(prompts)
        for i, reply in enumerate(replies):
            results[i :: len(self._conns)] = reply
        return results

    def close(self) -> None:
        for conn in self._conns:
            conn.send(None)
        for process in self._processes:
            process.join(30)
            if process.is_alive():
                process.kill()

    def __enter__(self) -> ClientProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
