"""Starting the server on Ray: what `adapterserve serve` runs (and the tests, in-process)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from adapterserve.server.app import build_app
from adapterserve.server.serve_env import SERVE_ENV, local_serve_env
from adapterserve.server.settings import merge_config

# The gRPC servicers Serve registers on the Ingress replicas' ports and its fallback proxy
# (import paths, as a Serve config names them).
GRPC_SERVICER_FUNCTIONS = [
    "adapterserve.server.proto.adapterserve_pb2_grpc.add_AdapterServeServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


@dataclass(frozen=True)
class Endpoints:
    grpc: str  # host:port for clients
    http: str  # base URL of the OpenAI-compatible routes


def start(
    config: Mapping[str, Any] | None = None,
    *,
    host: str = "127.0.0.1",
    grpc_port: int = 50051,
    http_port: int = 8000,
    ray_address: str | None = None,
) -> Endpoints:
    """Start (or join) Ray and Serve and deploy the application; returns once it is ready.

    Without `ray_address` a local Ray is started unless this process already has one."""
    if not ray.is_initialized():
        env = local_serve_env() if ray_address is None else SERVE_ENV
        for key, value in env.items():  # read by the Serve actors this Ray starts (serve_env.py)
            os.environ.setdefault(key, value)
        ray.init(address=ray_address, include_dashboard=False, configure_logging=False)
    serve.start(
        http_options={"host": host, "port": http_port},
        grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS},
    )
    name = merge_config(config)["app_name"]
    serve.run(build_app(config), name=name, route_prefix="/", blocking=False)
    return Endpoints(grpc=f"{host}:{grpc_port}", http=f"http://{host}:{http_port}")


def stop(config: Mapping[str, Any] | None = None) -> None:
    """Remove the application (Ray and Serve's proxies keep running)."""
    serve.delete(merge_config(config)["app_name"])
