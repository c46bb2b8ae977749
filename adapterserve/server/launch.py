"""Starting and stopping the server on Ray: what `adapterserve serve` runs (and the tests, in-process).

    endpoints = launch.start(config, grpc_port=50051, http_port=8000)  # local Ray, own ports
    ...
    launch.drain(config, grace_s=30)  # no new requests; running ones finish
    launch.shutdown()                  # Serve, Ray and every process they started gone
"""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from adapterserve.server import drain as draining
from adapterserve.server import ports
from adapterserve.server.app import build_app
from adapterserve.server.grpc_services import SERVICER_FUNCTIONS
from adapterserve.server.local_ray import LocalRay
from adapterserve.server.serve_env import SERVE_ENV
from adapterserve.server.settings import merge_config

# The gRPC servicers Serve registers on the Ingress replicas' ports and its fallback proxy
# (import paths, as a Serve config names them); their request parsing never fails before ours.
GRPC_SERVICER_FUNCTIONS = SERVICER_FUNCTIONS
_local: LocalRay | None = None  # the Ray start() started in this process, if any


@dataclass(frozen=True)
class Endpoints:
    grpc: str  # host:port for clients
    http: str  # base URL of the OpenAI-compatible routes
    metrics: str | None = None  # URL of the metrics port's scrape, when there is one
    replica_grpc: str | None = None  # host:port of the direct replica's own gRPC listener, when there is one


def start(
    config: Mapping[str, Any] | None = None,
    *,
    host: str = "127.0.0.1",
    grpc_port: int = 50051,
    http_port: int = 8000,
    ray_address: str | None = None,
) -> Endpoints:
    """Start (or join) Ray and Serve and deploy the application; returns once it is ready.

    Without `ray_address` a local Ray is started unless this process already has one: then
    the ports are checked first (ports.PortInUse names a taken one) and the Ray gets ports and
    files of its own (local_ray.py)."""
    global _local
    app = build_app(config)  # bad settings are refused before anything starts
    merged = merge_config(config)
    metrics, listener = merged["metrics"], merged["replica_grpc"]
    if _local is not None and not ray.is_initialized():  # its Ray was shut down without shutdown()
        stale, _local = _local, None
        stale.kill()
    if not ray.is_initialized():
        with _keeping_sigterm_handler():
            if ray_address is None:
                if metrics["port"] is not None:  # the hub binds it: checked here, before anything starts
                    ports.check_free(metrics["host"], {"--metrics-port": metrics["port"]})
                if listener["port"] is not None:  # the direct replica binds it (replica_grpc.py)
                    ports.check_free(listener["host"], {"--replica-grpc-port": listener["port"]})
                _local = LocalRay.start(host, {"--grpc-port": grpc_port, "--http-port": http_port})
            else:
                for key, value in SERVE_ENV.items():  # for the Serve actors, if this driver starts Serve
                    os.environ.setdefault(key, value)
                ray.init(address=ray_address, include_dashboard=False, configure_logging=False)
    serve.start(
        http_options={"host": host, "port": http_port},
        grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS},
    )
    serve.run(app, name=merged["app_name"], route_prefix="/", blocking=False)
    scrape = f"http://{metrics['host']}:{metrics['port']}/metrics" if metrics["port"] is not None else None
    own = f"{listener['host']}:{listener['port']}" if listener["port"] is not None else None
    return Endpoints(grpc=f"{host}:{grpc_port}", http=f"http://{host}:{http_port}", metrics=scrape, replica_grpc=own)


def drain(config: Mapping[str, Any] | None, grace_s: float) -> int:
    """Stop taking requests and wait up to `grace_s` for running ones to finish; returns how
    many were still running then."""
    return draining.drain(merge_config(config)["app_name"], grace_s)


def stop(config: Mapping[str, Any] | None = None) -> None:
    """Remove the application (Ray and Serve's proxies keep running)."""
    serve.delete(merge_config(config)["app_name"])


def shutdown(*, graceful: bool = True) -> None:
    """Stop Serve (letting replicas finish their requests, unless not `graceful`) and Ray. A Ray
    start() started stops with every process it runs, nothing left holding a port; a joined
    Ray keeps running."""
    global _local
    local, _local = _local, None
    try:
        if graceful and ray.is_initialized():
            serve.shutdown()
    finally:
        if local is not None:
            local.stop()


def ray_lost() -> bool:
    """Whether the Ray start() started has lost its GCS or raylet; False for a joined Ray."""
    return _local is not None and _local.lost()


def kill() -> None:
    """End the Ray start() started at once, with every process it runs, without asking Ray
    (for a process about to exit: its Ray connection is left dead)."""
    if _local is not None:
        _local.kill(at_once=True)


@contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """ray.init sets a SIGTERM handler of its own (exit at once): keep the caller's instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler)
