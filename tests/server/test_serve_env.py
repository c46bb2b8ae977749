"""How Serve runs: HAProxy forwards clients straight to the Ingress replicas (no Python
proxy hop), deployments call each other over Serve's gRPC transport, a server started here
gets ports and HAProxy files of its own, and gRPC messages are capped at the edge."""
from __future__ import annotations

import grpc
import pytest
import ray
from ray.serve.handle import DeploymentHandle

from adapterserve.clients.client import Client
from adapterserve.server import ports, serve_env
from adapterserve.server.backends import own_handle
from adapterserve.server.settings import DEFAULTS
from tests.helpers.live_server import ALICE


def test_a_local_server_takes_every_port_from_a_block_of_its_own(monkeypatch, tmp_path):
    monkeypatch.setattr(serve_env, "haproxy_ingress", lambda: True)
    first, second = ports.claim_block(), ports.claim_block()
    try:
        envs = [serve_env.local_serve_env(tmp_path / "a", first), serve_env.local_serve_env(tmp_path / "b", second)]
    finally:
        ports.release(first)
        ports.release(second)
    taken = []
    for env, block in zip(envs, (first, second)):
        assert serve_env.SERVE_ENV.items() <= env.items()
        mine = {int(env[key]) for key in serve_env.SINGLE_PORTS}
        for protocol in ("HTTP", "GRPC"):
            low = int(env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT"])
            high = int(env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT"])
            assert high - low >= 16, "room for replicas and for ports resting after a replica left"
            mine |= set(range(low, high))
        assert len(mine) == ports.BLOCK_SIZE and mine == set(range(block.first, block.first + ports.BLOCK_SIZE))
        taken.append(mine)
    assert not taken[0] & taken[1]
    assert envs[0]["RAY_SERVE_HAPROXY_SOCKET_PATH"] == str(tmp_path / "a" / "admin.sock")
    assert all(str(tmp_path / "b") in envs[1][key] for key in serve_env.HAPROXY_FILES)


def test_haproxys_sockets_fit_a_socket_path(monkeypatch):
    monkeypatch.setattr(serve_env, "haproxy_ingress", lambda: True)
    block = ports.claim_block()
    try:
        env = serve_env.local_serve_env(block=block)  # in a directory of its own, made now
    finally:
        ports.release(block)
    node_dir = 1 + 56  # Serve puts them one level deeper, in a directory named after the node's id
    for key in ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"):
        assert len(env[key].encode()) + node_dir < 108, env[key]


def test_grpc_messages_are_capped_above_an_upload_chunk():
    from adapterserve.clients.upload_stream import CHUNK_BYTES
    from adapterserve.server.settings import DEFAULTS

    cap = int(serve_env.SERVE_ENV["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"])
    assert CHUNK_BYTES * 2 <= cap <= 64 << 20
    assert cap >= DEFAULTS["max_request_bytes"], "the longest prompt fits in gRPC as it does in HTTP"
    assert serve_env.WITHOUT_HAPROXY["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(cap)


def test_an_oversized_grpc_message_is_refused_and_the_server_goes_on(server, alice):
    from adapterserve.clients.types import ClientError

    cap = serve_env.MAX_GRPC_MESSAGE_BYTES
    with pytest.raises(ClientError) as refused:
        alice.generate("x" * (cap + 1), max_tokens=1)
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in refused.value.details
    assert len(alice.generate("hello", max_tokens=2, temperature=0.0).token_ids) == 2


@pytest.mark.skipif(not serve_env.haproxy_ingress(), reason="no HAProxy here: Serve's proxy takes the calls")
def test_haproxy_routes_grpc_to_the_ingress_replicas_own_ports(server, uploaded):
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller  # what HAProxy is told to route to
    groups = ray.get(controller.get_target_groups.remote(from_proxy_manager=True))
    app = server.config.get("app_name", DEFAULTS["app_name"])
    grpc_groups = [g for g in groups if g.app_name == app and g.protocol == RequestProtocol.GRPC]
    assert [g.ingress_deployment_name for g in grpc_groups] == ["Ingress"]
    target = grpc_groups[0].targets[0]
    with Client(f"127.0.0.1:{target.port}", api_key=ALICE, timeout=120) as direct:  # the replica itself
        out = direct.generate("hello", adapter="sql", max_tokens=3, temperature=0.0)
    assert out.adapter == uploaded["sql"] and len(out.token_ids) == 3


def test_the_ingress_calls_replicas_with_its_own_serve_options(server):
    app = server.config.get("app_name", DEFAULTS["app_name"])
    default = DeploymentHandle("EngineReplica", app).handle_options
    bound = DeploymentHandle("EngineReplica", app).options(_by_reference=not default._by_reference)
    own = own_handle(bound)
    assert (own.deployment_name, own.app_name) == ("EngineReplica", app)
    assert own.handle_options == default  # not the options of the driver that bound the app


def test_serve_proxy_takes_the_calls_without_haproxy(monkeypatch, tmp_path):
    monkeypatch.setattr(serve_env, "haproxy_ingress", lambda: False)
    assert serve_env.local_serve_env(tmp_path) == serve_env.WITHOUT_HAPROXY
    monkeypatch.undo()
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # turned off by whoever starts the server
    assert serve_env.local_serve_env(tmp_path) == serve_env.WITHOUT_HAPROXY
