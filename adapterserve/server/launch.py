"""Starting the server on Ray: what `adapterserve serve` runs (and the tests, in-process)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from adapterserve.server.app import build_app
from adapterserve.server.settings import merge_config

# Serve's gRPC proxy registers these servicers (import paths, as a Serve config names them).
GRPC_SERVICER_FUNCTIONS = [
    "adapterserve.server.proto.adapterserve_pb2_grpc.add_AdapterServeServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


@dataclass(frozen=True)
class Endpoints:
    grpc: str  # host:port for clients
    http: str  # base URL of the OpenAI-compatible routes


# Ray Serve's throughput mode (Ray 2.60): calls between deployments over gRPC, user code on
# the replica's own event loop (BENCHMARKS.md has what it saves). Direct ingress (replicas
# listening on ports of their own, drained 30 s at shutdown) stays off: clients and the
# Kubernetes services reach Serve's proxy.
SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}


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
        for key, value in SERVE_ENV.items():  # read by the Serve actors this Ray starts
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
