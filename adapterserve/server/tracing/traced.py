"""Calls recorded as OpenTelemetry spans and sent over OTLP (imported only when traces are on).

One trace per call, continuing the caller's (traceparent). The ingress records its hops as
they happen (TracedCall); the engine replica records its part (TracedReplica) and, when the
request ends, turns the engine's stage times (RequestTimes: taken in the engine, sent back
over the pipe from the engine process) into spans, so the step loop does no span work.

    POST /v1/completions | adapterserve.v1.AdapterServe/Generate   (server: receipt -> end)
      proxy          x-request-start -> receipt (only when a front proxy sends that header)
      ingress        receipt -> handed to a replica (auth, admission, checks)
        resolve      the adapter name -> its version
        tokenize
      replica        (client) the Serve handle call, to the replica's last chunk
        replica.generate          (server, in the engine replica)
          adapter                 the adapter found or loaded, and acquired
          engine                  in the engine: added -> finished
            engine.queue          waiting to be scheduled
            engine.prefill        scheduled -> first token
            engine.decode         first token -> last
      first_token    handed to a replica -> its first chunk back
      stream         first chunk -> last chunk
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import Span, Tracer
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from adapterserve import __version__
from adapterserve.engine.request import RequestTimes
from adapterserve.server.tracing import Tracing
from adapterserve.server.tracing.calls import NO_REPLICA_TRACE, CallTrace, ReplicaTrace
from adapterserve.server.tracing.config import OtlpSettings
from adapterserve.server.tracing.pipeline import tracer_provider
from adapterserve.server.tracing.w3c import Incoming, SpanRef, parse_traceparent

GRPC_SERVICE = "adapterserve.v1.AdapterServe"
# gRPC codes that mark a server span as failed (OpenTelemetry's semantic conventions)
_GRPC_SERVER_ERRORS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE",
                                 "DATA_LOSS"})
Context = Any  # an opentelemetry.context.Context


class OtlpTracing(Tracing):
    on = True

    def __init__(self, settings: OtlpSettings, component: str) -> None:
        self.provider = tracer_provider(settings, component)
        self.tracer: Tracer = self.provider.get_tracer("adapterserve", __version__)

    def grpc_call(self, method: str, metadata: Iterable[tuple[str, str]]) -> CallTrace:
        attributes = {"rpc.system": "grpc", "rpc.service": GRPC_SERVICE, "rpc.method": method}
        return self._call(f"{GRPC_SERVICE}/{method}", attributes, Incoming.of(metadata))

    def http_call(self, method: str, route: str, headers: Iterable[tuple[str, str]]) -> CallTrace:
        attributes = {"http.request.method": method, "http.route": route}
        return self._call(f"{method} {route}", attributes, Incoming.of(headers))

    def _call(self, name: str, attributes: dict[str, Any], incoming: Incoming) -> CallTrace:
        received = time.time_ns()
        parent = _remote(incoming.parent(), incoming.state())
        root = self.tracer.start_span(name, parent, kind=SpanKind.SERVER, attributes=attributes, start_time=received)
        ids = root.get_span_context()
        if not root.is_recording():  # sampled out: ids only
            return CallTrace(ids.trace_id, ids.span_id)
        return TracedCall(self.tracer, root, received, incoming.proxy_ns(received))

    def replica_call(self, task: str, traceparent: str | None) -> ReplicaTrace:
        parent = parse_traceparent(traceparent)
        if parent is None:
            return NO_REPLICA_TRACE
        span = self.tracer.start_span(f"replica.{task}", _remote(parent), kind=SpanKind.SERVER)
        if not span.is_recording():
            return NO_REPLICA_TRACE
        return TracedReplica(self.tracer, span, timed=task == "generate")

    def close(self) -> None:
        self.provider.shutdown()  # sends what is left


class TracedCall(CallTrace):
    recording = True

    def __init__(self, tracer: Tracer, root: Span, received_ns: int, proxy_ns: int | None) -> None:
        self._open = self._ended = False
        ids = root.get_span_context()
        super().__init__(ids.trace_id, ids.span_id)
        self._tracer, self._root = tracer, root
        self._in_root = trace.set_span_in_context(root)
        if proxy_ns is not None:
            self._tracer.start_span("proxy", self._in_root, start_time=proxy_ns).end(end_time=received_ns)
        self._ingress = self._tracer.start_span("ingress", self._in_root, start_time=received_ns)
        self._in_ingress = trace.set_span_in_context(self._ingress)
        self._replica: Span | None = None
        self._stream: Span | None = None
        self._handed_ns = 0
        self._output_tokens, self._finish_reason = 0, None
        self._code, self._http_status = "OK", None
        self._attributes: dict[str, Any] = {}  # the root's, set when it ends

    def span(self, name: str) -> AbstractContextManager[None]:
        return _child_span(self._tracer, name, self._in_ingress)

    def resolved(self, version: Any) -> None:
        if version is not None:
            self._attributes["adapterserve.adapter"] = version.ref

    def tokenized(self, prompt_tokens: int) -> None:
        self._attributes["gen_ai.usage.input_tokens"] = prompt_tokens

    def handoff(self) -> str:
        self._handed_ns = time.time_ns()
        _end(self._ingress, self._handed_ns)
        self._replica = self._tracer.start_span("replica", self._in_root, kind=SpanKind.CLIENT,
                                                start_time=self._handed_ns)
        return SpanRef(self.trace_id, self._replica.get_span_context().span_id, True).header()

    def relayed(self, chunk: Mapping[str, Any]) -> None:
        if self._stream is None:
            now = time.time_ns()
            self._tracer.start_span("first_token", self._in_root, start_time=self._handed_ns).end(end_time=now)
            self._stream = self._tracer.start_span("stream", self._in_root, start_time=now)
        self._output_tokens += len(chunk["token_ids"])
        self._finish_reason = chunk.get("finish_reason") or self._finish_reason

    def replica_done(self) -> None:
        now = time.time_ns()
        if self._stream is not None:
            _end(self._stream, now)
            self._attributes["gen_ai.usage.output_tokens"] = self._output_tokens
        if self._finish_reason:
            self._attributes["gen_ai.response.finish_reasons"] = [self._finish_reason]
        if self._replica is not None:
            _end(self._replica, now)

    def tag(self, response: Any) -> Any:
        self._http_status = response.status_code
        return super().tag(response)

    def hand_over(self) -> CallTrace:
        self._open = True
        return self

    def finish(self, code: str) -> None:
        self._code = code
        if not self._open:
            self.close()

    def close(self) -> None:
        if self._ended:
            return
        self._ended = True
        now = time.time_ns()
        for span in (self._ingress, self._replica, self._stream):
            if span is not None:
                _end(span, now)
        self._set_outcome()
        self._root.set_attributes(self._attributes)
        self._root.end(end_time=now)

    def __del__(self) -> None:  # a stream handed over whose response never started
        if self._open and not self._ended:
            self.close()

    def _set_outcome(self) -> None:
        if self._code != "OK":
            self._attributes["error.type"] = self._code
        if self._http_status is not None:
            self._attributes["http.response.status_code"] = self._http_status
            failed = self._http_status >= 500
        else:
            self._attributes["rpc.grpc.status_code"] = grpc.StatusCode[self._code].value[0]
            failed = self._code in _GRPC_SERVER_ERRORS
        if failed:
            self._root.set_status(Status(StatusCode.ERROR, self._code))


class TracedReplica(ReplicaTrace):
    def __init__(self, tracer: Tracer, root: Span, timed: bool) -> None:
        self._tracer, self._root = tracer, root
        self._in_root = trace.set_span_in_context(root)
        self.times = RequestTimes() if timed else None

    def span(self, name: str, attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[None]:
        return _child_span(self._tracer, name, self._in_root, attributes)

    def failed(self, why: BaseException | str) -> None:
        _fail(self._root, why)

    def finish(self) -> None:
        now = time.time_ns()
        if self.times is not None and self.times.added_ns:
            self._engine_spans(self.times, now)
        self._root.end(end_time=now)

    def _engine_spans(self, times: RequestTimes, now: int) -> None:
        """The engine's stages as spans; a stage not reached (the request failed or was
        cancelled) is left out, one not left ends now."""
        end = times.finished_ns or now
        engine = self._tracer.start_span("engine", self._in_root, start_time=times.added_ns)
        in_engine = trace.set_span_in_context(engine)
        stages = (("engine.queue", times.added_ns, times.scheduled_ns or end),
                  ("engine.prefill", times.scheduled_ns, times.first_token_ns or end),
                  ("engine.decode", times.first_token_ns, end))
        for name, start, stop in stages:
            if start and stop > start:
                self._tracer.start_span(name, in_engine, start_time=start).end(end_time=stop)
        engine.end(end_time=end)


def _remote(parent: SpanRef | None, state: str | None = None) -> Context | None:
    """A context whose current span is the caller's (None: this call starts a trace)."""
    if parent is None:
        return None
    flags = TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT)
    trace_state = TraceState.from_header([state]) if state else None
    span = NonRecordingSpan(SpanContext(parent.trace_id, parent.span_id, True, flags, trace_state))
    return trace.set_span_in_context(span)


def _end(span: Span, end_ns: int) -> None:
    if span.end_time is None:
        span.end(end_time=end_ns)


def _fail(span: Span, why: BaseException | str) -> None:
    if isinstance(why, BaseException):
        span.set_attribute("error.type", type(why).__name__)
        span.set_status(Status(StatusCode.ERROR, f"{type(why).__name__}: {why}"))
    else:
        span.set_attribute("error.type", why)
        span.set_status(Status(StatusCode.ERROR, why))


@contextmanager
def _child_span(tracer: Any, name: str, parent: Any, attributes: Mapping[str, Any] | None = None) -> Iterator[None]:
    """A span of `name` under `parent` for the with-block; an exception marks it failed."""
    span = tracer.start_span(name, parent, attributes=attributes)
    try:
        yield
    except BaseException as exc:
        _fail(span, exc)
        raise
    finally:
        span.end()
