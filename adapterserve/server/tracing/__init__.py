"""Traces of a call's hops (OpenTelemetry, sent over OTLP), and the trace id every response
carries back (docs/observability.md, "Traces").

    tracing = open_tracing(config, "ingress")      # once per process (a Serve replica)
    call = tracing.grpc_call("Generate", grpc_context.invocation_metadata())
    ...                                            # the hooks of calls.CallTrace, then
    call.tag_grpc(grpc_context); call.finish(code)

Off unless an OTLP endpoint is configured (config.py): then `Tracing` hands out calls that
know their ids and record nothing, and no OpenTelemetry module is imported. On, traced.py's
OtlpTracing records spans. Either way a call continues its caller's W3C trace (traceparent)
and its response names the trace (x-trace-id, traceresponse).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from adapterserve.server.tracing.calls import NO_REPLICA_TRACE, RESPONSE_KEYS, CallTrace, ReplicaTrace
from adapterserve.server.tracing.config import check_exporter, otlp_settings
from adapterserve.server.tracing.w3c import Incoming

__all__ = ["RESPONSE_KEYS", "CallTrace", "ReplicaTrace", "Tracing", "open_tracing"]


class Tracing:
    """Traces off: each call gets its ids (for the response) and records nothing."""

    on = False

    def grpc_call(self, method: str, metadata: Iterable[tuple[str, str]]) -> CallTrace:
        """A gRPC call of `method` (e.g. "Generate"), with its invocation metadata."""
        return CallTrace.untraced(Incoming.of(metadata))

    def http_call(self, method: str, route: str, headers: Iterable[tuple[str, str]]) -> CallTrace:
        """An HTTP call (`method` e.g. "POST", `route` its path template), with its header pairs."""
        return CallTrace.untraced(Incoming.of(headers))

    def replica_call(self, task: str, traceparent: str | None) -> ReplicaTrace:
        """The engine replica's part of a call whose ingress passed `traceparent` (None: untraced)."""
        return NO_REPLICA_TRACE

    def close(self) -> None:
        """Send the spans still waiting (at shutdown)."""


def open_tracing(config: Mapping[str, Any], component: str) -> Tracing:
    """This process's tracing from the server config's `tracing` section and the OTEL_*
    environment; `component` ("ingress", "model", "encoder") is named on its spans."""
    settings = otlp_settings(config["tracing"])
    if settings is None:
        return Tracing()
    check_exporter(settings)
    from adapterserve.server.tracing.traced import OtlpTracing

    return OtlpTracing(settings, component)
