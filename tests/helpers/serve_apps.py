"""Deleting a test's extra Serve application: the session's server takes gRPC calls without an
application name again only once its proxy's routes hold one application, a moment after
serve.delete returns (gRPC calls of the next test would fail with NOT_FOUND meanwhile)."""
from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROUTES_WAIT_S = 60.0
NO_APPLICATION = "Application metadata not set"  # Serve's answer while it routes several applications


def delete_app(name: str, grpc_address: str, wait_s: float = ROUTES_WAIT_S) -> None:
    """serve.delete(name), then, where one application is left, wait until a health check on
    grpc_address (the session server's gRPC port) is routed again; the last error if it is not
    within wait_s."""
    from ray import serve

    serve.delete(name)
    if len(serve.status().applications) > 1:  # calls need an application name while others remain
        return
    deadline = time.monotonic() + wait_s
    with grpc.insecure_channel(grpc_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                return
            except grpc.RpcError as exc:
                routed = not (exc.code() is grpc.StatusCode.NOT_FOUND and NO_APPLICATION in (exc.details() or ""))
                if routed:
                    return
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)
