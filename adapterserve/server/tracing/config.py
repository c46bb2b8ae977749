"""Whether this process sends traces, and where: the `tracing` settings, then the standard
OpenTelemetry environment. Reading them imports no OpenTelemetry.

Traces are on when an OTLP endpoint is set: `tracing.otlp_endpoint`, else
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT. OTEL_SDK_DISABLED=true or
OTEL_TRACES_EXPORTER=none turns them off whatever the settings say. The exporter reads the
rest of OTEL_EXPORTER_OTLP_* itself (headers, timeout, compression, certificates).
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_SERVICE_NAME = "adapterserve"
_ALIASES = {"http": "http/protobuf"}
_EXPORTERS = {  # protocol -> (the module that exports, the package that has it)
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc", "opentelemetry-exporter-otlp-proto-grpc"),
    "http/protobuf": ("opentelemetry.exporter.otlp.proto.http", "opentelemetry-exporter-otlp-proto-http"),
}


@dataclass(frozen=True)
class OtlpSettings:
    endpoint: str | None  # the collector's URL; None: the exporter reads OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT
    protocol: str  # one of PROTOCOLS
    service_name: str


def otlp_settings(tracing: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> OtlpSettings | None:
    """Where this process sends traces; None when traces are off. ValueError on a bad value."""
    check_tracing(tracing)
    if _env(environ, "OTEL_SDK_DISABLED").lower() == "true" or _env(environ, "OTEL_TRACES_EXPORTER").lower() == "none":
        return None
    endpoint = tracing["otlp_endpoint"]
    if not endpoint and not (_env(environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                             or _env(environ, "OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    protocol = tracing["otlp_protocol"] or _protocol_from_env(environ)
    service = tracing["service_name"] or _env(environ, "OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
    return OtlpSettings(endpoint, _ALIASES.get(protocol, protocol), service)


def check_tracing(tracing: Mapping[str, Any]) -> None:
    """ValueError naming the `tracing` key that holds a bad value."""
    endpoint, protocol, service = tracing["otlp_endpoint"], tracing["otlp_protocol"], tracing["service_name"]
    if endpoint is not None:
        url = urlsplit(endpoint) if isinstance(endpoint, str) else None
        if url is None or url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"tracing.otlp_endpoint must be the collector's URL, e.g. http://collector:4317 "
                             f"(gRPC) or http://collector:4318 (HTTP), got {endpoint!r}")
    if protocol is not None and _ALIASES.get(protocol, protocol) not in PROTOCOLS:
        raise ValueError(f"tracing.otlp_protocol must be one of {', '.join(PROTOCOLS)} (or null: "
                         f"$OTEL_EXPORTER_OTLP_PROTOCOL, else grpc), got {protocol!r}")
    if service is not None and (not isinstance(service, str) or not service.strip()):
        raise ValueError(f"tracing.service_name must be a non-empty string or null, got {service!r}")


def check_settings(tracing: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> None:
    """At start: ValueError on a bad value, or when traces are on and their exporter is missing."""
    settings = otlp_settings(tracing, environ)
    if settings is not None:
        check_exporter(settings)


def check_exporter(settings: OtlpSettings) -> None:
    """ValueError, saying what to install, unless the exporter for settings.protocol is installed."""
    module, package = _EXPORTERS[settings.protocol]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        raise ValueError(f"traces are on (an OTLP endpoint is set) but {package} is not installed: "
                         "pip install 'adapterserve[otel]', or unset the endpoint")


def http_traces_url(endpoint: str) -> str:
    """OTLP/HTTP's URL for traces: the endpoint as given when it has a path, else + /v1/traces."""
    return endpoint if urlsplit(endpoint).path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


def _protocol_from_env(environ: Mapping[str, str]) -> str:
    for key in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if value := _env(environ, key):
            if _ALIASES.get(value, value) not in PROTOCOLS:
                raise ValueError(f"${key} is {value!r}; adapterserve sends traces over {' or '.join(PROTOCOLS)}")
            return value
    return "grpc"


def _env(environ: Mapping[str, str], key: str) -> str:
    return environ.get(key, "").strip()
