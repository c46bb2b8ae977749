"""A direct-mode application (server/direct.py) on the session's Serve: the live server's
settings, one generation replica run by the Ingress replica itself, optionally with the
replica's own gRPC listener (setting `replica_grpc`). Delete it when done: gRPC clients of the
session's server need Serve to hold one application.

    with direct_app(server, "direct", replica_grpc={"port": free_port()}) as app:
        app.replica_port, app.own, app.http   # host:port, host:port or None, base URL
"""
from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests.helpers.serve_apps import delete_app

TARGET_WAIT_S = 300.0


@dataclass(frozen=True)
class DirectApp:
    name: str
    replica_port: str  # host:port of the Ingress replica's port in Serve (where HAProxy forwards)
    own: str | None  # host:port of the replica's own listener, if set
    http: str  # base URL of the app's HTTP routes


@contextmanager
def direct_app(server: Any, name: str, **overrides: Any) -> Iterator[DirectApp]:
    from ray import serve

    from adapterserve.server.app import build_app

    config = copy.deepcopy(server.config)
    config.update(app_name=name, direct="auto", **overrides)  # one generation replica: direct
    config["replica"] = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1}}
    config["encoder_replica"] = {"ray_actor_options": {"num_cpus": 0.1}}
    config["metrics"] = {"http_route": "off", "push_interval_s": 0.25, "port": None}
    serve.run(build_app(config), name=name, route_prefix=f"/{name}", blocking=False)
    try:
        own = config.get("replica_grpc", {}).get("port")
        yield DirectApp(name, replica_target(name), f"127.0.0.1:{own}" if own else None, f"{server.http}/{name}")
    finally:
        delete_app(name, server.grpc)


def replica_target(app: str) -> str:
    """host:port of the app's Ingress replica, once HAProxy is told of it (within TARGET_WAIT_S)."""
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    deadline = time.monotonic() + TARGET_WAIT_S
    while True:
        groups = ray.get(controller.get_target_groups.remote(from_proxy_manager=True))
        found = [g for g in groups if g.app_name == app and g.protocol == RequestProtocol.GRPC and g.targets]
        if found:
            return f"127.0.0.1:{found[0].targets[0].port}"
        assert time.monotonic() < deadline, f"the {app} application's Ingress never became a target"
        time.sleep(0.5)
