"""The replica's own gRPC listener (setting `replica_grpc`): in direct mode, the Ingress replica
serves the AdapterServe and grpc.health.v1 services on a port of its own, beside Serve's.

    replica_grpc: {port: 50061, host: 127.0.0.1}   # port null: no listener (the default)

A call on this port reaches the same Ingress object as one through HAProxy and Serve's replica
port (auth, quotas, admission, validation, drain, health: ingress.py), without HAProxy's hop
and without Serve's per-call wrapper in the replica. Serve does not see these calls: its
request metrics and `max_ongoing_requests` leave them out; the ingress's admission
(`max_in_flight`) holds them as it holds every call.

The port is explicit and bound without port sharing (SO_REUSEPORT off): a second server on
the same host and port fails to start, naming the port, instead of splitting its
connections with the first. Only a direct deployment of one replica (no autoscaling) may
have it: its one port is the replica's. The message size cap (serve_env.MAX_GRPC_MESSAGE_BYTES)
and the pending-call limits (grpc_services.py) are those of Serve's port, the HTTP/2 streams
per connection those HAProxy allows (serve_env.H2_MAX_STREAMS).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc

from adapterserve.server.grpc_services import (
    PENDING_CALL_OPTIONS,
    add_adapterserve,
    add_health,
)
from adapterserve.server.ports import PortInUse
from adapterserve.server.replica_grpc_settings import SETTING
from adapterserve.server.serve_env import H2_MAX_STREAMS, MAX_GRPC_MESSAGE_BYTES

BIND_RETRY_S = 0.25  # how often a taken port is tried again while start_listener may wait
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_concurrent_streams", H2_MAX_STREAMS),
    *PENDING_CALL_OPTIONS,
]


def address(host: str, port: int) -> str:
    """host:port as gRPC binds it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ListenerHealth:
    """grpc.health.v1 on the listener: the Ingress's Check and Watch (health_rpc.py); List, which
    the Ingress does not serve, UNIMPLEMENTED."""

    def __init__(self, ingress: Any) -> None:
        self.Check, self.Watch = ingress.Check, ingress.Watch

    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "List is not served here; call Check or Watch")


async def start_listener(servicer: Any, host: str, port: int, wait_s: float = 0.0) -> grpc.aio.Server:
    """A grpc.aio server on this event loop serving `servicer` (the Ingress) at host:port. A port
    still taken is tried again for up to `wait_s` (the replica this one replaces may still be
    draining its calls there); PortInUse after that."""

    def build() -> grpc.aio.Server:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        add_adapterserve(servicer, server)
        add_health(ListenerHealth(servicer), server)
        return server

    server = await bound(build, host, port, wait_s)
    await server.start()
    return server


async def bound(build: Callable[[], grpc.aio.Server], host: str, port: int, wait_s: float) -> grpc.aio.Server:
    """A server from `build` bound to host:port (not started), a fresh one per try while the
    port is taken, for up to `wait_s`; PortInUse naming the setting after that."""
    deadline = time.monotonic() + wait_s
    while True:
        server = build()
        try:
            server.add_insecure_port(address(host, port))
            return server
        except RuntimeError:
            if time.monotonic() >= deadline:
                raise PortInUse(f"{SETTING}.port {port} on {host} cannot be bound (another process, or another "
                                "adapterserve server, listens there): pick a free port") from None
        await asyncio.sleep(BIND_RETRY_S)
