"""The OpenTelemetry pipeline of one process: a TracerProvider of its own (the global one is
left to others: Ray Serve has its own tracing), a batch span processor and an OTLP exporter.
Imported only when traces are on.

Spans leave in batches from a background thread (OTEL_BSP_* tune it: by default every 5 s
or every 512 spans); the sampler is the SDK's (OTEL_TRACES_SAMPLER; by default the caller's
decision when a traceparent came, else every call).
"""
from __future__ import annotations

import os
import socket

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from adapterserve import __version__
from adapterserve.server.tracing.config import OtlpSettings, http_traces_url


def tracer_provider(settings: OtlpSettings, component: str) -> TracerProvider:
    """A provider whose spans name this service and process (OTEL_RESOURCE_ATTRIBUTES adds more)."""
    resource = Resource.create({
        "service.name": settings.service_name,
        "service.version": __version__,
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
        "adapterserve.component": component,
    })
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(otlp_exporter(settings)))
    return provider


def otlp_exporter(settings: OtlpSettings) -> SpanExporter:
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=settings.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=http_traces_url(settings.endpoint) if settings.endpoint else None)
