"""Honest health on the live server: gRPC health (Check, Watch) and GET /health cover
both engine deployments; endless unauthenticated watches are bounded and cannot starve
the ingress; kill -9 of the engine process fails its streams with UNAVAILABLE at once
and the engine restarts in place with its adapters; an engine that cannot restart
fails health, and Serve replaces its replica."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapterserve.clients.types import ClientError
from tests.helpers.live_server import ALICE, MAX_HEALTH_WATCHES

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
LONG = dict(max_tokens=400, temperature=0.0, ignore_eos=True)
PROMPT = "To make bread you need"


def _replica():
    from ray import serve

    return serve.get_deployment_handle("EngineReplica", "adapterserve")


def _live() -> dict:
    return _replica().describe.remote().result(timeout_s=120)["live"]


def _poll(attempt, what: str, timeout: float = 180.0):
    """attempt() until it returns something true; raises if the deadline passes first."""
    deadline = time.monotonic() + timeout
    while not (result := attempt()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return result


def _health(server) -> tuple[int, dict]:
    reply = requests.get(f"{server.http}/health", timeout=60)
    return reply.status_code, reply.json()


def _check(server, service: str = "") -> int:
    with grpc.insecure_channel(server.grpc) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=60).status


def _generated(client, adapter: str, max_tokens: int):
    """A completion, or None while the server answers UNAVAILABLE (its engine restarting)."""
    try:
        return client.generate(PROMPT, adapter=adapter, max_tokens=max_tokens, temperature=0.0)
    except ClientError as error:
        assert error.code is grpc.StatusCode.UNAVAILABLE, error
        return None


def _unavailable(server) -> dict | None:
    status, report = _health(server)
    return report if status == 503 else None


def _failed_restart(why: str | None) -> str | None:
    return why if why and "starting a new engine failed" in why else None


def test_health_covers_both_engine_deployments(server, uploaded):
    assert _health(server) == (200, {"status": "ok", "draining": False,
                                     "deployments": {"EngineReplica": "ok", "EncoderReplica": "ok"}})
    assert _check(server) == SERVING and _check(server, "adapterserve.v1.AdapterServe") == SERVING
    with pytest.raises(grpc.RpcError) as unknown:
        _check(server, "no.such.Service")
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND


def test_endless_health_watches_are_bounded_and_generate_still_succeeds(server, alice, uploaded):
    """Watches need no key and never end by themselves: past max_health_watches they are
    refused at once (RESOURCE_EXHAUSTED, retry advice), and an authenticated Generate is
    served while the others stay open."""
    async def scenario():
        async with grpc.aio.insecure_channel(server.grpc) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(3 * MAX_HEALTH_WATCHES)]
            firsts = await asyncio.gather(*(w.read() for w in watches), return_exceptions=True)
            refusals = [(f.code(), f.trailing_metadata()) for f in firsts if isinstance(f, grpc.aio.AioRpcError)]
            served = await asyncio.to_thread(alice.generate, PROMPT, adapter="chat", max_tokens=4)
            for watch in watches:
                watch.cancel()
            again = stub.Watch(health_pb2.HealthCheckRequest())
            first_again = await again.read()
            again.cancel()
            return firsts, refusals, served, first_again

    firsts, refusals, served, first_again = asyncio.run(scenario())
    open_watches = [f for f in firsts if isinstance(f, health_pb2.HealthCheckResponse)]
    assert len(open_watches) == MAX_HEALTH_WATCHES and all(f.status == SERVING for f in open_watches)
    assert len(refusals) == 2 * MAX_HEALTH_WATCHES
    assert all(code is grpc.StatusCode.RESOURCE_EXHAUSTED and ("retry-after-s", "5") in tuple(trailing)
               for code, trailing in refusals)
    assert len(served.token_ids) == 4
    assert first_again is not grpc.aio.EOF and first_again.status == SERVING  # cancelled watches gave their places back


def test_kill_9_of_the_engine_fails_its_streams_with_unavailable_and_the_engine_restarts(
        server, alice, uploaded, reference):
    before = _live()
    ended, last = _killed_under_two_streams(server, alice, before["engine_pid"])
    assert ended.code is grpc.StatusCode.UNAVAILABLE and "exit code -9" in ended.details
    assert last["error"]["code"] == 503 and "exit code -9" in last["error"]["message"]

    later = _poll(lambda: _generated(alice, "chat", 8), "Generate to be served again")
    assert later.token_ids == reference("chat", PROMPT, 8)[0]  # the adapter was registered again
    after = _live()
    assert after["engine_pid"] != before["engine_pid"]
    assert after["engine_restarts"] == before["engine_restarts"] + 1 and after["engine_problem"] is None
    assert _poll(lambda: _health(server)[0] == 200, "health to say ok")


def test_an_engine_that_cannot_restart_fails_health_and_serve_replaces_its_replica(
        server, alice, uploaded, tiny_model, reference):
    pid = _live()["engine_pid"]
    away = tiny_model.with_name(f"{tiny_model.name}-away")
    tiny_model.rename(away)  # the restart finds no checkpoint
    try:
        os.kill(pid, signal.SIGKILL)
        why = _poll(lambda: _failed_restart(_replica().health.remote().result(timeout_s=60)), "the restart to fail")
        report = _poll(lambda: _unavailable(server), "/health to report it")  # reports are up to 1 s old
        checked = _poll(lambda: _check(server) == NOT_SERVING, "Check to report it")
    finally:
        away.rename(tiny_model)
    assert "starting a new engine failed" in why
    assert report["status"] == "unavailable"
    assert "starting a new engine failed" in report["deployments"]["EngineReplica"]
    assert report["deployments"]["EncoderReplica"] == "ok" and checked

    later = _poll(lambda: _generated(alice, "chat", 8), "Generate on the replacement replica")
    assert later.token_ids == reference("chat", PROMPT, 8)[0]
    replacement = _live()
    assert replacement["engine_pid"] != pid and replacement["engine_restarts"] == 0
    assert _poll(lambda: _health(server)[0] == 200, "health to say ok")


def test_kill_9_of_the_replica_itself_is_unavailable_and_serve_replaces_it(server, alice, uploaded, reference):
    """Ray's errors for a replica that died under a call (its actor gone) reach clients as
    UNAVAILABLE with retry advice, over gRPC and in an SSE stream, never INTERNAL."""
    import ray

    name = next(a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"])
    actor = ray.get_actor(name["name"], namespace=name["namespace"])
    replica_pid = ray.get(actor.__ray_call__.remote(lambda replica: os.getpid()), timeout=60)
    ended, last = _killed_under_two_streams(server, alice, replica_pid)
    assert ended.code is grpc.StatusCode.UNAVAILABLE and "went away" in ended.details
    assert last["error"]["code"] == 503 and "went away" in last["error"]["message"]
    later = _poll(lambda: _generated(alice, "chat", 8), "Generate on the replacement replica")
    assert later.token_ids == reference("chat", PROMPT, 8)[0]


def _killed_under_two_streams(server, alice, pid: int) -> tuple[ClientError, dict]:
    """SIGKILL `pid` while a gRPC stream and an SSE stream run; the gRPC stream's error and
    the SSE stream's last event."""
    grpc_stream = alice.stream(PROMPT, adapter="chat", **LONG)
    next(grpc_stream)
    body = {"model": "chat", "prompt": PROMPT, "stream": True, **LONG}
    with requests.post(f"{server.http}/v1/completions", json=body, stream=True, timeout=120,
                       headers={"Authorization": f"Bearer {ALICE}"}) as sse:
        events = sse.iter_lines(decode_unicode=True)
        next(e for e in events if e.startswith("data: {"))  # it streams
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ClientError) as ended:
            list(grpc_stream)
        last = [json.loads(e[6:]) for e in events if e.startswith("data: {")][-1]
    return ended.value, last
