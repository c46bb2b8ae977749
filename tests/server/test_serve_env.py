"""How Serve runs: HAProxy forwards clients straight to the Ingress replicas (no Python
proxy hop), deployments call each other over Serve's gRPC transport, and a second local
Ray finds ports of its own."""
from __future__ import annotations

import socket

import pytest
import ray
from ray.serve.handle import DeploymentHandle

from adapterserve.clients.client import Client
from adapterserve.server import serve_env
from adapterserve.server.backends import own_handle
from adapterserve.server.settings import DEFAULTS
from tests.helpers.live_server import ALICE


def test_fixed_ports_are_rays_defaults_where_free_else_free_ones(monkeypatch):
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("", 0))
        held.listen()
        probe.bind(("", 0))
        free = probe.getsockname()[1]
        probe.close()
        taken = held.getsockname()[1]
        monkeypatch.setattr(serve_env, "FIXED_PORTS", {"TAKEN_PORT": taken, "FREE_PORT": free})
        monkeypatch.setattr(serve_env, "haproxy_ingress", lambda: True)
        env = serve_env.local_serve_env()
    assert env["FREE_PORT"] == str(free)
    assert env["TAKEN_PORT"] != str(taken) and int(env["TAKEN_PORT"]) > 0
    assert serve_env.SERVE_ENV.items() <= env.items()


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


def test_serve_proxy_takes_the_calls_without_haproxy(monkeypatch):
    monkeypatch.setattr(serve_env, "haproxy_ingress", lambda: False)
    assert serve_env.local_serve_env() == serve_env.WITHOUT_HAPROXY
    monkeypatch.undo()
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # turned off by whoever starts the server
    assert serve_env.local_serve_env() == serve_env.WITHOUT_HAPROXY
