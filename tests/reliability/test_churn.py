"""Adapters deleted and replaced under running streams, and clients vanishing mid-stream,
while innocent streams run (the live test server).

A stream whose adapter version is deleted or replaced goes on to its last token with the
tokens of its run alone; new requests see the change at once (NOT_FOUND, or the new
version's tokens). Clients that go away mid-stream (gRPC cancel, an SSE connection
closed) free what they held. Every innocent stream ends token-identical to its run alone.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import requests

from adapterserve.clients.client import Client
from adapterserve.clients.types import ClientError
from tests.helpers.live_server import ALICE, NUM_KV_BLOCKS
from tests.reliability.innocents import INNOCENTS, stream

LONG = dict(max_tokens=120, temperature=0.0, ignore_eos=True)
PROMPT = "The river runs past the old mill"


def _tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _delete_mid_stream(client: Client, lora_dirs) -> None:
    doomed = client.upload(lora_dirs["poem"], "churn-doomed")
    alone = client.generate(PROMPT, adapter=doomed.ref, **LONG).token_ids
    running = client.stream(PROMPT, adapter="churn-doomed", **LONG)
    first = next(running)
    assert client.delete_adapter("churn-doomed") == [doomed.ref]
    with pytest.raises(ClientError) as refused:
        client.generate(PROMPT, adapter="churn-doomed", max_tokens=2)
    assert refused.value.code is grpc.StatusCode.NOT_FOUND
    with pytest.raises(ClientError) as refused:  # name@N too, though the ingress resolved it just before
        client.generate(PROMPT, adapter=doomed.ref, max_tokens=2)
    assert refused.value.code is grpc.StatusCode.NOT_FOUND
    assert _tokens([first, *running]) == alone


def _replace_mid_stream(client: Client, lora_dirs) -> None:
    old = client.upload(lora_dirs["poem"], "churn-moving")
    old_alone = client.generate(PROMPT, adapter=old.ref, **LONG).token_ids
    running = client.stream(PROMPT, adapter="churn-moving", **LONG)
    first = next(running)
    new = client.upload(lora_dirs["sql"], "churn-moving")  # the next version, other weights
    assert new.version == old.version + 1
    new_tokens = client.generate(PROMPT, adapter="churn-moving", **LONG).token_ids
    assert new_tokens != old_alone and new_tokens == client.generate(PROMPT, adapter=new.ref, **LONG).token_ids
    assert _tokens([first, *running]) == old_alone


def _vanish_mid_stream(server, client: Client) -> None:
    for _ in range(4):  # gRPC: cancel after the first chunk
        call = client.stream(PROMPT, adapter="chat", **LONG)
        next(call)
        call.close()
    for _ in range(4):  # SSE: drop the connection after the first event
        body = {"model": "chat", "prompt": PROMPT, "stream": True, **LONG}
        with requests.post(f"{server.http}/v1/completions", json=body, stream=True, timeout=60,
                           headers={"Authorization": f"Bearer {ALICE}"}) as reply:
            assert reply.status_code == 200, reply.text
            next(reply.iter_lines())


def _wait_idle(client: Client, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        info = client.server_info()
        if info.free_kv_blocks == NUM_KV_BLOCKS and info.running_requests == 0:
            return
        assert time.monotonic() < deadline, f"still held: {info.running_requests} requests, " \
                                            f"{NUM_KV_BLOCKS - info.free_kv_blocks} KV blocks"
        time.sleep(0.2)


def test_churn_and_vanishing_clients_leave_innocent_streams_untouched(server, uploaded, lora_dirs):
    alone = {i: stream(server, i) for i in INNOCENTS}
    during = {i: [] for i in INNOCENTS}
    over = threading.Event()

    def keep_streaming(innocent):
        while not over.is_set():
            during[innocent].append(stream(server, innocent))

    with Client(server.grpc, api_key=ALICE, timeout=300) as client, ThreadPoolExecutor(len(INNOCENTS)) as pool:
        innocents = [pool.submit(keep_streaming, i) for i in INNOCENTS]
        try:
            _delete_mid_stream(client, lora_dirs)
            _replace_mid_stream(client, lora_dirs)
            _vanish_mid_stream(server, client)
        finally:
            over.set()
            for done in innocents:
                done.result()
        _wait_idle(client)
    for innocent, runs in during.items():
        assert runs and all(run == alone[innocent] for run in runs), innocent
