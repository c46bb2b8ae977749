"""Backpressure, cancellation and deletion while requests run.

Load is shed where it is first seen with a message and retry advice: by the ingress
replica beyond max_in_flight calls, by the engine beyond max_num_seqs running plus
max_queued_requests waiting. Refused calls get RESOURCE_EXHAUSTED with trailing
metadata `retry-after-s` (HTTP: 429 with Retry-After) at once; admitted ones complete.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import grpc
import pytest
import requests

from adapterserve.clients.client import generate_request
from adapterserve.clients.types import ClientError
from adapterserve.proto import adapterserve_pb2_grpc as pb_grpc
from tests.helpers.held_calls import held_while, wait_until
from tests.helpers.live_server import ALICE, MAX_IN_FLIGHT, MAX_RUNNING, MAX_WAITING, NUM_KV_BLOCKS

LONG = dict(max_tokens=150, temperature=0.0, ignore_eos=True)
AUTH = (("authorization", f"Bearer {ALICE}"),)


async def _generate(stub, prompt: str, **sampling) -> list[int] | tuple[grpc.StatusCode, str, dict]:
    """The tokens, or (code, details, trailing metadata) of the refusal."""
    call = stub.Generate(generate_request(prompt, adapter="chat", **sampling), metadata=AUTH, timeout=300)
    tokens: list[int] = []
    try:
        async for message in call:
            tokens += message.token_ids
    except grpc.aio.AioRpcError as refused:
        return refused.code(), refused.details(), dict(refused.trailing_metadata() or ())
    return tokens


def _sse(server, prompt: str, max_tokens: int) -> tuple[int, Mapping[str, str], list[int]]:
    body = {"model": "chat", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    with requests.post(f"{server.http}/v1/completions", json=body, stream=True, timeout=300,
                       headers={"Authorization": f"Bearer {ALICE}"}) as reply:
        tokens = []
        for line in reply.iter_lines(decode_unicode=True):
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                tokens += event["choices"][0]["token_ids"]
        return reply.status_code, reply.headers, tokens  # names compared case-insensitively


def test_a_burst_is_shed_with_retry_advice_while_admitted_requests_complete(server, uploaded, alice):
    """Three times what the engine runs plus queues, at once, over gRPC and SSE: the rest are
    refused at once with RESOURCE_EXHAUSTED / 429 and retry advice (no hang, no queueing in
    Serve); every admitted one completes with the tokens it has alone."""
    long = {**LONG, "max_tokens": 100}  # 8 running fit the KV cache: no preemption
    expected = alice.generate("The lighthouse keeper", adapter="chat", **long).token_ids  # also loads "chat"
    burst = 3 * (MAX_RUNNING + MAX_WAITING)

    async def scenario():
        async with grpc.aio.insecure_channel(server.grpc) as channel:
            stub = pb_grpc.AdapterServeStub(channel)
            calls = [_generate(stub, "The lighthouse keeper", **long) for _ in range(burst - 6)]
            calls += [asyncio.to_thread(_sse, server, "The lighthouse keeper", 100) for _ in range(6)]
            return await asyncio.wait_for(asyncio.gather(*calls), timeout=300)

    results = asyncio.run(scenario())
    grpc_results, sse_results = results[:-6], results[-6:]
    refused = [r for r in grpc_results if isinstance(r, tuple)]
    completed = [r for r in grpc_results if isinstance(r, list)] + [t for status, _, t in sse_results if status == 200]
    assert refused and len(completed) >= MAX_RUNNING  # how many of each depends on arrival timing
    assert all(tokens == expected for tokens in completed)
    for code, details, trailing in refused:
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert float(trailing["retry-after-s"]) >= 1 and "retry" in details
    for status, headers, _ in sse_results:
        assert status == 200 or (status == 429 and int(headers["Retry-After"]) >= 1), (status, headers)


def test_a_burst_of_thousands_is_answered_by_admission_not_cancelled(server, uploaded, alice):
    """2,000 calls at once over 20 connections: each is served or shed with RESOURCE_EXHAUSTED
    by the ingress's admission. (grpc's own server would cancel calls past 1,000 waiting for
    the application: grpc_services.hold_pending_calls raises that limit.)"""
    expected = alice.generate("The lighthouse keeper", adapter="chat", max_tokens=4, temperature=0.0,
                              ignore_eos=True).token_ids

    async def scenario():
        channels = [grpc.aio.insecure_channel(server.grpc, options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(20)]
        try:
            stubs = [pb_grpc.AdapterServeStub(c) for c in channels]
            calls = [_generate(stubs[i % 20], "The lighthouse keeper", max_tokens=4, temperature=0.0,
                               ignore_eos=True) for i in range(2000)]
            return await asyncio.wait_for(asyncio.gather(*calls), timeout=300)
        finally:
            for channel in channels:
                await channel.close()

    results = asyncio.run(scenario())
    codes = {r[0] for r in results if isinstance(r, tuple)}
    assert codes <= {grpc.StatusCode.RESOURCE_EXHAUSTED}, [r[:2] for r in results if isinstance(r, tuple)][:3]
    served = [r for r in results if isinstance(r, list)]
    assert served and all(tokens == expected for tokens in served)


def test_calls_over_max_in_flight_are_shed_at_the_ingress(server, uploaded, alice):
    """Calls held open (uploads that send nothing) fill the ingress replica's places: the next
    call is shed there at once with retry advice; once they end, calls are taken again."""
    wait_until(lambda: _ingress_in_flight() == 0, what="the previous tests' calls to end")

    async def scenario():
        async with grpc.aio.insecure_channel(server.grpc) as channel:
            stub = pb_grpc.AdapterServeStub(channel)
            held = await held_while(stub, MAX_IN_FLIGHT, AUTH, lambda: _ingress_in_flight() == MAX_IN_FLIGHT,
                                    "every held call to take its place")
            refusal = await _generate(stub, "A server", max_tokens=2)
            assert not any(call.done() for call in held)
            for call in held:
                call.cancel()
            return refusal

    code, details, trailing = asyncio.run(scenario())
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and trailing["retry-after-s"] == "1"
    assert f"at capacity ({MAX_IN_FLIGHT} requests in flight at this ingress replica)" in details
    wait_until(lambda: _answers(alice), what="the ingress to take calls again")


def _ingress_in_flight() -> int:
    from ray import serve

    return serve.get_deployment_handle("Ingress", "adapterserve").in_flight.remote().result(timeout_s=60)


def _answers(client) -> bool:
    try:
        return bool(client.generate("A server", adapter="chat", max_tokens=2).token_ids)
    except ClientError as error:
        assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED, error
        return False


def test_cancelled_stream_frees_its_kv_blocks(alice, uploaded):
    # the previous test's requests may still be draining
    wait_until(lambda: alice.server_info().free_kv_blocks == NUM_KV_BLOCKS, what="the server to be idle")
    idle = alice.server_info()
    stream = alice.stream("To make bread you need", adapter="sql", **LONG)
    for _, _chunk in zip(range(3), stream):
        pass
    busy = alice.server_info()
    assert busy.running_requests == 1 and busy.free_kv_blocks < NUM_KV_BLOCKS
    stream.close()  # cancels the gRPC call
    wait_until(lambda: alice.server_info().free_kv_blocks == NUM_KV_BLOCKS, what="KV blocks to be freed")
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
