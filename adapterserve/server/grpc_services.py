"""The gRPC services as Serve registers them, with message parsing that cannot fail
before our code runs.

grpc parses each request message before any handler sees it; bytes that are no valid
message (corrupt, truncated, a string that is not UTF-8) would end the call with
UNKNOWN. Registered through these functions, such a request reaches the ingress as an
Undecodable, which it refuses with INVALID_ARGUMENT naming the message type.

grpc's server also sheds calls on its own before any handler runs: past 1,000 calls
accepted but not yet handed to the application (a burst on an asyncio server), it
cancels a growing share of new ones (CANCELLED; all of them past 3,000).
`hold_pending_calls()`, called in the ingress replica before Serve starts its gRPC
server there, raises those limits, so a burst reaches the ingress's admission, which
sheds what it cannot take with RESOURCE_EXHAUSTED and retry advice.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2_grpc

from adapterserve.errors import RequestError
from adapterserve.proto import adapterserve_pb2_grpc

PENDING_CALLS = 16384  # grpc's soft limit of calls waiting for the application (default 1,000)
PENDING_CALL_OPTIONS = [("grpc.server.max_pending_requests", PENDING_CALLS),
                        ("grpc.server.max_pending_requests_hard_limit", 2 * PENDING_CALLS)]
# import paths, as a Serve config's grpc_servicer_functions names them
SERVICER_FUNCTIONS = [
    "adapterserve.server.grpc_services.add_adapterserve",
    "adapterserve.server.grpc_services.add_health",
]


class CallContext(Protocol):
    """What the ingress uses of a gRPC call's context. Serve's RayServegRPCContext (calls through
    HAProxy and Serve's replica port) and grpc.aio's ServicerContext (the replica's own listener,
    replica_grpc.py) both have it, so the same handlers serve both."""

    def invocation_metadata(self) -> Sequence[tuple[str, str]]: ...
    def set_code(self, code: grpc.StatusCode) -> None: ...
    def set_details(self, details: str) -> None: ...
    def trailing_metadata(self) -> Sequence[tuple[str, str]]: ...
    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, str]]) -> None: ...


@dataclass(frozen=True)
class Undecodable:
    """A request whose bytes did not parse as the method's message."""

    method: str  # "/package.Service/Method"
    error: str

    def refuse(self) -> RequestError:
        return RequestError(f"the request is not a valid {_message_name(self.method)} message: {self.error}")


def refuse_undecodable(request: Any) -> None:
    """RequestError (INVALID_ARGUMENT) if the request's bytes did not parse."""
    if isinstance(request, Undecodable):
        raise request.refuse()


def hold_pending_calls() -> None:
    """Raise grpc's pending-call limits for the gRPC servers Serve starts in this process later
    (Serve builds their options from its DEFAULT_GRPC_SERVER_OPTIONS list)."""
    from ray.serve._private import constants

    options = constants.DEFAULT_GRPC_SERVER_OPTIONS
    wanted = dict(PENDING_CALL_OPTIONS)
    options[:] = [o for o in options if o[0] not in wanted] + PENDING_CALL_OPTIONS  # in place: grpc_util holds it too


def add_adapterserve(servicer: Any, server: Any) -> None:
    adapterserve_pb2_grpc.add_AdapterServeServicer_to_server(servicer, _SafeParsing(server))


def add_health(servicer: Any, server: Any) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(servicer, _SafeParsing(server))


class _SafeParsing:
    """Stands in for the server while a generated add_*_to_server registers its handlers."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        for handler in handlers:
            handler._method_handlers = {m: _safe(m, h) for m, h in handler._method_handlers.items()}
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        add = getattr(self._server, "add_registered_method_handlers", None)
        if add is not None:  # grpcio before 1.63 has only generic handlers
            add(service, {name: _safe(f"/{service}/{name}", h) for name, h in handlers.items()})


def _safe(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    if parse is None:
        return handler
    return handler._replace(request_deserializer=safe_parser(method, parse))


def safe_parser(method: str, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`parse`, returning an Undecodable for bytes that are no valid message of `method`."""

    def parse_or_mark(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Undecodable(method, str(exc))

    return parse_or_mark


def _message_name(method: str) -> str:
    """The method's request message type, e.g. adapterserve.v1.GenerateRequest."""
    service, name = method.strip("/").split("/")
    try:
        return descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name).input_type.full_name
    except KeyError:
        return f"request of {method}"
