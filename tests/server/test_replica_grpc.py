"""The replica's own gRPC listener (server/replica_grpc.py), without a server: the handlers'
context protocol holds for both contexts they meet, the listener's options, and its binding
of a port that is taken (for good, or until a predecessor leaves)."""
from __future__ import annotations

import asyncio
import inspect
import socket

import grpc
import pytest
from grpc._cython import cygrpc
from ray.serve.grpc_util import RayServegRPCContext

from adapterserve.server.grpc_services import PENDING_CALL_OPTIONS, CallContext
from adapterserve.server.ports import PortInUse
from adapterserve.server.replica_grpc import SERVER_OPTIONS, address, bound
from adapterserve.server.serve_env import H2_MAX_STREAMS, MAX_GRPC_MESSAGE_BYTES

USED = [name for name, _ in inspect.getmembers(CallContext, inspect.isfunction) if not name.startswith("_")]


@pytest.mark.parametrize("context", [RayServegRPCContext, cygrpc._ServicerContext],
                         ids=["Serve's context", "grpc.aio's context"])
def test_both_contexts_have_what_the_ingress_uses(context):
    assert len(USED) == 5
    assert [name for name in USED if not callable(getattr(context, name, None))] == []


def test_the_listener_shares_no_port_and_takes_what_serves_port_takes():
    options = dict(SERVER_OPTIONS)
    assert options["grpc.so_reuseport"] == 0  # an int: gRPC ignores the string "0"
    assert options["grpc.max_receive_message_length"] == options["grpc.max_send_message_length"] == \
        MAX_GRPC_MESSAGE_BYTES
    assert options["grpc.max_concurrent_streams"] == H2_MAX_STREAMS
    assert set(PENDING_CALL_OPTIONS) <= set(SERVER_OPTIONS)


@pytest.mark.parametrize("host, port, bound", [("127.0.0.1", 50061, "127.0.0.1:50061"), ("::1", 1, "[::1]:1"),
                                               ("::", 2, "[::]:2"), ("0.0.0.0", 65535, "0.0.0.0:65535")])
def test_the_address_grpc_binds(host, port, bound):
    assert address(host, port) == bound


def _held_port() -> socket.socket:
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def test_a_port_taken_for_good_is_refused_naming_the_setting():
    with _held_port() as held:
        port = held.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"^replica_grpc\.port {port} on 127\.0\.0\.1 cannot be bound"):
            asyncio.run(bound(lambda: grpc.aio.server(options=SERVER_OPTIONS), "127.0.0.1", port, wait_s=0.5))


def test_a_port_a_predecessor_gives_back_is_bound_once_free():
    """The replica Serve starts in place of one still draining on the port waits for it."""
    held = _held_port()
    port = held.getsockname()[1]

    async def bind_while_the_predecessor_leaves() -> None:
        asyncio.get_running_loop().call_later(1.0, held.close)
        server = await bound(lambda: grpc.aio.server(options=SERVER_OPTIONS), "127.0.0.1", port, wait_s=60.0)
        await server.start()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10):
                pass  # the new listener accepts
        finally:
            await server.stop(None)

    try:
        asyncio.run(bind_while_the_predecessor_leaves())
    finally:
        held.close()
