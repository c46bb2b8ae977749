"""Backpressure, cancellation and deletion while requests run."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from adapterserve.clients.client import AsyncClient
from adapterserve.clients.types import ClientError
from tests.helpers.live_server import ALICE, MAX_ONGOING, MAX_QUEUED, NUM_KV_BLOCKS

LONG = dict(max_tokens=150, temperature=0.0, ignore_eos=True)


def _wait_until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll a server-side fact that no event reports to the client."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_overload_is_resource_exhausted_while_admitted_requests_complete(server, uploaded, alice):
    """More long requests at once than the replica runs plus queues: the rest are refused at
    once with RESOURCE_EXHAUSTED (no hang); every admitted one completes correctly."""
    long = {**LONG, "max_tokens": 300}
    expected = alice.generate("The lighthouse keeper", adapter="chat", **long).token_ids  # also loads "chat"
    burst = 3 * (MAX_ONGOING + MAX_QUEUED)

    async def scenario():
        async with AsyncClient(server.grpc, api_key=ALICE, timeout=300) as client:  # generous: CI may be loaded
            calls = [client.generate("The lighthouse keeper", adapter="chat", **long) for _ in range(burst)]
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=300)

    results = asyncio.run(scenario())
    refused = [r for r in results if isinstance(r, ClientError)]
    completed = [r for r in results if not isinstance(r, BaseException)]
    assert all(r.code is grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused), refused
    assert len(refused) + len(completed) == burst, results
    assert refused and len(completed) >= MAX_ONGOING  # how many of each depends on arrival timing
    assert all(r.token_ids == expected and r.finish_reason == "length" for r in completed)
    assert "retry later" in refused[0].details


def test_cancelled_stream_frees_its_kv_blocks(alice, uploaded):
    # the previous test's requests may still be draining
    _wait_until(lambda: alice.server_info().free_kv_blocks == NUM_KV_BLOCKS, what="the server to be idle")
    idle = alice.server_info()
    stream = alice.stream("To make bread you need", adapter="sql", **LONG)
    for _, _chunk in zip(range(3), stream):
        pass
    busy = alice.server_info()
    assert busy.running_requests == 1 and busy.free_kv_blocks < NUM_KV_BLOCKS
    stream.close()  # cancels the gRPC call
    _wait_until(lambda: alice.server_info().free_kv_blocks == NUM_KV_BLOCKS, what="KV blocks to be freed")
    after = alice.server_info()
    assert after.running_requests == 0
    # the replica stopped it (rather than running it to its end): cancellation reached the engine
    assert after.cancelled_requests == idle.cancelled_requests + 1


def test_deleting_a_version_in_use_lets_its_requests_finish(alice, lora_dirs, uploaded):
    doomed = alice.upload(lora_dirs["poem"], "doomed")
    expected = alice.generate("A server", adapter=doomed.ref, **LONG).token_ids
    stream = alice.stream("A server", adapter=doomed.ref, **LONG)
    first = next(stream)
    assert alice.delete_adapter("doomed") == [doomed.ref]
    with pytest.raises(ClientError) as info:
        alice.generate("A server", adapter="doomed", max_tokens=2)
    assert info.value.code is grpc.StatusCode.NOT_FOUND
    rest = list(stream)
    assert rest[-1].finish_reason == "length"
    assert first.token_ids + [t for c in rest for t in c.token_ids] == expected
