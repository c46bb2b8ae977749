"""Unknown adapters, bad requests, API keys and tenants, through real gRPC and HTTP."""
from __future__ import annotations

import grpc
import pytest
import requests

from adapterserve.clients.client import Client
from adapterserve.clients.types import ClientError
from tests.helpers.live_server import BOB, run_cli


def _code(call) -> grpc.StatusCode:
    with pytest.raises(ClientError) as info:
        call()
    return info.value.code


def test_unknown_adapter_is_not_found(alice, uploaded):
    with pytest.raises(ClientError) as info:
        alice.generate("hello", adapter="no-such-adapter", max_tokens=2)
    assert info.value.code is grpc.StatusCode.NOT_FOUND
    assert "no adapter named 'no-such-adapter'" in info.value.details
    assert _code(lambda: alice.generate("hello", adapter="sql@9", max_tokens=2)) is grpc.StatusCode.NOT_FOUND
    assert _code(lambda: alice.get_adapter("nothing")) is grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(adapter="Bad Name!"),
])
def test_invalid_requests_are_invalid_argument(alice, kwargs):
    kwargs = {"max_tokens": 2, **kwargs}
    assert _code(lambda: alice.generate("hello", **kwargs)) is grpc.StatusCode.INVALID_ARGUMENT


def test_invalid_prompts_are_invalid_argument(alice, server):
    vocab = alice.server_info().vocab_size
    assert _code(lambda: alice.generate([vocab + 5], max_tokens=2)) is grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: alice.generate("", max_tokens=2)) is grpc.StatusCode.INVALID_ARGUMENT
    too_long = [5] * 2000
    assert _code(lambda: alice.generate(too_long, max_tokens=2)) is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("key", [None, "", "not-a-key"])
def test_missing_or_wrong_key_is_unauthenticated(server, key, monkeypatch):
    monkeypatch.delenv("ADAPTERSERVE_API_KEY", raising=False)
    with Client(server.grpc, api_key=key) as client:
        assert _code(lambda: client.generate("hello", max_tokens=2)) is grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: client.list_adapters()) is grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: client.server_info()) is grpc.StatusCode.UNAUTHENTICATED


def test_wrong_key_on_http_is_401(server):
    reply = requests.post(f"{server.http}/v1/completions", json={"model": "x", "prompt": "hi"},
                          headers={"Authorization": "Bearer nope"}, timeout=60)
    assert reply.status_code == 401
    assert reply.json()["error"]["type"] == "authentication_error"  # OpenAI's name for a 401


def test_other_tenants_adapters_are_refused(bob, uploaded):
    assert not any(a.name in uploaded for a in bob.list_adapters())
    for ref in ("sql", "sql@1"):
        code = _code(lambda ref=ref: bob.generate("hello", adapter=ref, max_tokens=2))
        assert code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND)
    assert _code(lambda: bob.delete_adapter("sql@1")) is grpc.StatusCode.NOT_FOUND  # as if it did not exist
    assert _code(lambda: bob.get_adapter("chat")) in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND)


def test_other_tenant_cannot_take_a_name(bob, uploaded, lora_dirs):
    assert _code(lambda: bob.upload(lora_dirs["sql"], "sql")) is grpc.StatusCode.PERMISSION_DENIED


def test_public_adapters_are_shared_but_owned(alice, bob, lora_dirs, uploaded):
    shared = alice.upload(lora_dirs["poem"], "shared-poem", public=True)
    assert bob.get_adapter("shared-poem").ref == shared.ref
    mine = alice.generate("hello", adapter="shared-poem", max_tokens=4, temperature=0.0)
    theirs = bob.generate("hello", adapter=shared.ref, max_tokens=4, temperature=0.0)
    assert theirs.token_ids == mine.token_ids
    assert _code(lambda: bob.delete_adapter("shared-poem")) is grpc.StatusCode.PERMISSION_DENIED


def test_cli_reports_server_errors(server, uploaded):
    status, out, err = run_cli("generate", "--server", server.grpc, "--api-key", BOB, "--adapter", "sql", "hi")
    assert status == 1
    assert err.startswith("error: PERMISSION_DENIED") or err.startswith("error: NOT_FOUND")
    status, _, err = run_cli("list", "--server", server.grpc, "--api-key", "wrong")
    assert (status, err.split(":")[1].strip()) == (1, "UNAUTHENTICATED")


def test_health_and_info(server, alice, uploaded):
    assert alice.health() == "SERVING"
    info = alice.server_info()
    assert (info.model_type, info.num_layers, info.hidden_size) == ("llama", 2, 64)
    assert "lora" in info.adapter_kinds and "prefix_tuning" in info.adapter_kinds and info.max_lora_rank == 16
    assert info.linear_shapes["down_proj"] == (160, 64)
    with Client(server.grpc, api_key="") as anonymous:  # probes carry no key
        assert anonymous.health() == "SERVING"


def test_health_of_an_unknown_service_is_not_found(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.grpc) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        ok = stub.Check(health_pb2.HealthCheckRequest(service="adapterserve.v1.AdapterServe"), timeout=60)
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="other.Service"), timeout=60)
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
