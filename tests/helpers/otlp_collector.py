"""A real OTLP trace receiver on loopback, for tests: gRPC (opentelemetry-proto's
TraceService) or HTTP (POST /v1/traces, protobuf), keeping every span it receives.

    with collecting("grpc") as collector:      # collector.endpoint: http://127.0.0.1:PORT
        ...                                    # a server exports there
        spans = collector.trace(trace_id, until=lambda s: "stream" in names(s))
"""
from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

WAIT_S = 30.0  # longest wait for spans (the exporters send every 5 s by default)


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 2 server, 3 client
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    resource: dict[str, Any] = field(default_factory=dict)


@dataclass
class Collector:
    endpoint: str
    spans: list[Span] = field(default_factory=list)
    requests: int = 0  # export requests received
    _lock: threading.Condition = field(default_factory=threading.Condition)

    def receive(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        received = [span for resource_spans in request.resource_spans for span in _spans(resource_spans)]
        with self._lock:
            self.requests += 1
            self.spans.extend(received)
            self._lock.notify_all()

    def trace(self, trace_id: str, until: Callable[[list[Span]], bool], wait_s: float = WAIT_S) -> list[Span]:
        """The spans of `trace_id` once `until(spans)` holds (AssertionError naming what came if
        it does not within wait_s)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                found = [s for s in self.spans if s.trace_id == trace_id]
                if until(found):
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"trace {trace_id}: spans {sorted(s.name for s in found)} after {wait_s} s")
                self._lock.wait(left)


def names(spans: list[Span]) -> set[str]:
    return {s.name for s in spans}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _spans(resource_spans) -> Iterator[Span]:
    resource = _attributes(resource_spans.resource.attributes)
    for scope_spans in resource_spans.scope_spans:
        for s in scope_spans.spans:
            yield Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                       s.start_time_unix_nano, s.end_time_unix_nano, _attributes(s.attributes), s.status.code,
                       resource)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def Export(self, request, context):
        self.collector.receive(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def collecting(protocol: str = "grpc") -> Iterator[Collector]:
    """A receiver of `protocol` ("grpc" or "http") on a free loopback port, for the with-block."""
    if protocol == "grpc":
        with _grpc_receiver() as collector:
            yield collector
    else:
        with _http_receiver() as collector:
            yield collector


@contextmanager
def _grpc_receiver() -> Iterator[Collector]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    collector = Collector(f"http://127.0.0.1:{port}")
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(collector), server)
    server.start()
    try:
        yield collector
    finally:
        server.stop(grace=None)


@contextmanager
def _http_receiver() -> Iterator[Collector]:
    collector_box: list[Collector] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            collector_box[0].receive(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    collector_box.append(Collector(f"http://127.0.0.1:{server.server_address[1]}"))
    thread = threading.Thread(target=server.serve_forever, name="otlp-http-receiver", daemon=True)
    thread.start()
    try:
        yield collector_box[0]
    finally:
        server.shutdown()
        server.server_close()
