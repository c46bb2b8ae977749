"""A call's trace as the ingress and the engine replica hold it, when nothing is recorded.

CallTrace (ingress) knows its trace id and the server span's id, which every response
carries back (HTTP headers, gRPC trailing metadata: RESPONSE_KEYS), traced or not; its
hooks do nothing. ReplicaTrace (engine replica) does nothing at all. traced.py's
subclasses record the same hooks as OpenTelemetry spans. Plain Python: no OpenTelemetry.

The hooks, in a call's order (the ingress):
    span("resolve") / span("tokenize")   with-blocks, children of the `ingress` span
    resolved(version) / tokenized(n)      attributes of the call
    handoff()                             the call goes to a replica: the traceparent it takes
    relayed(chunk)                        each chunk back from the replica
    replica_done()                        the replica's reply ended (or failed)
    tag(response) / tag_grpc(context)     the ids onto the response
    finish(code)                          the handler ended (a stream handed over: hand_over(), close())
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from adapterserve.server.tracing.w3c import Incoming, SpanRef, new_span_id, new_trace_id

TRACE_ID_KEY, TRACE_RESPONSE_KEY = "x-trace-id", "traceresponse"
RESPONSE_KEYS = (TRACE_ID_KEY, TRACE_RESPONSE_KEY)
_NOTHING = nullcontext()

if TYPE_CHECKING:
    from adapterserve.engine.request import RequestTimes


class CallTrace:
    recording = False

    def __init__(self, trace_id: int, span_id: int) -> None:
        self.trace_id, self.span_id = trace_id, span_id

    @classmethod
    def untraced(cls, incoming: Incoming) -> CallTrace:
        """The caller's trace (a valid traceparent) or a new one; this call's span id is new."""
        parent = incoming.parent()
        return cls(parent.trace_id if parent else new_trace_id(), new_span_id())

    def headers(self) -> dict[str, str]:
        """x-trace-id (32 hex digits) and W3C traceresponse (sampled: this server records it)."""
        server_span = SpanRef(self.trace_id, self.span_id, self.recording)
        return {TRACE_ID_KEY: f"{self.trace_id:032x}", TRACE_RESPONSE_KEY: server_span.header()}

    def tag(self, response: Any) -> Any:
        """An HTTP response with the trace headers; returns it."""
        response.headers.update(self.headers())
        return response

    def tag_grpc(self, context: Any) -> None:
        """Add the trace pairs to a RayServegRPCContext's trailing metadata (Serve sends none
        before the call ends), keeping what is there (retry advice)."""
        kept = [(k, v) for k, v in context.trailing_metadata() if k not in RESPONSE_KEYS and k != "request_id"]
        context.set_trailing_metadata(kept + list(self.headers().items()))  # Serve adds request_id back

    # hooks: recorded by traced.TracedCall

    def span(self, name: str) -> AbstractContextManager:
        return _NOTHING

    def resolved(self, version: Any) -> None:
        pass

    def tokenized(self, prompt_tokens: int) -> None:
        pass

    def handoff(self) -> str | None:
        """The traceparent a replica continues (None: the replica records nothing)."""
        return None

    def relayed(self, chunk: Mapping[str, Any]) -> None:
        pass

    def replica_done(self) -> None:
        pass

    def hand_over(self) -> CallTrace:
        """This trace, for a stream to close() when it ends: finish() then leaves it open."""
        return self

    def finish(self, code: str) -> None:
        """The handler ended with `code` (a gRPC status name): the call's trace ends, unless handed over."""

    def close(self) -> None:
        """The call ended (a stream handed over: its last event was sent, or its caller went away)."""


class ReplicaTrace:
    """The engine replica's part of a call: nothing recorded (traced.TracedReplica records)."""

    times: RequestTimes | None = None  # filled by the engine when set

    def span(self, name: str, attributes: Mapping[str, Any] | None = None) -> AbstractContextManager:
        return _NOTHING

    def failed(self, why: BaseException | str) -> None:
        pass

    def finish(self) -> None:
        pass


NO_REPLICA_TRACE = ReplicaTrace()
