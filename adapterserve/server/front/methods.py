"""The methods a front worker forwards: every method of the services the replica's own
listener serves (AdapterServe, grpc.health.v1.Health), read from their descriptors, so a
method added to the proto is forwarded without a change here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import message_factory
from grpc_health.v1 import health_pb2

from adapterserve.proto import adapterserve_pb2

SERVICES = (adapterserve_pb2.DESCRIPTOR.services_by_name["AdapterServe"],
            health_pb2.DESCRIPTOR.services_by_name["Health"])


@dataclass(frozen=True)
class Method:
    path: str  # "/package.Service/Method", as on the wire
    service: str  # "package.Service"
    name: str
    client_streaming: bool
    server_streaming: bool
    request_type: Any  # the request message class

    @property
    def kind(self) -> str:
        """grpc's handler kind: unary_unary, unary_stream, stream_unary or stream_stream."""
        return f"{'stream' if self.client_streaming else 'unary'}_{'stream' if self.server_streaming else 'unary'}"


def _methods() -> dict[str, Method]:
    found = {}
    for service in SERVICES:
        for m in service.methods:
            path = f"/{service.full_name}/{m.name}"
            found[path] = Method(path, service.full_name, m.name, m.client_streaming, m.server_streaming,
                                 message_factory.GetMessageClass(m.input_type))
    return found


METHODS: dict[str, Method] = _methods()
