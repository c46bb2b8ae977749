"""What a call brings of its trace (W3C `traceparent`, a front proxy's `x-request-start`) and
the ids of a new one. Plain Python: importing it imports no OpenTelemetry.

An incoming `traceparent` that does not parse is ignored (the call starts a trace of its own),
as W3C Trace Context asks: a bad trace header never fails a request.
"""
from __future__ import annotations

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass

TRACEPARENT, TRACESTATE, REQUEST_START = "traceparent", "tracestate", "x-request-start"
_MAX_TRACESTATE_CHARS = 512  # W3C: a vendor may drop a longer tracestate
_TRACEPARENT_RE = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\s]*)?")
_KEY = r"[a-z0-9][a-z0-9_\-*/]{0,255}(?:@[a-z0-9][a-z0-9_\-*/]{0,13})?"
_TRACESTATE_MEMBER_RE = re.compile(_KEY + r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
_MAX_TRACESTATE_MEMBERS = 32
_REQUEST_START_RE = re.compile(r"(?:t=)?(\d{1,19})(?:\.(\d{1,9}))?")
_UNIT_NS = {10: 1_000_000_000, 13: 1_000_000, 16: 1_000, 19: 1}  # digits of now in s, ms, us, ns
_MAX_PROXY_NS = 3600 * 1_000_000_000  # a proxy time earlier than this before receipt is not believed


@dataclass(frozen=True)
class SpanRef:
    """A span of a trace as W3C names it: the parent a call continues, or one we started."""

    trace_id: int  # 128 bits, never 0
    span_id: int  # 64 bits, never 0
    sampled: bool

    def header(self) -> str:
        """As a `traceparent` (or `traceresponse`) value."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"


@dataclass(frozen=True)
class Incoming:
    """The trace headers (HTTP) or metadata (gRPC) of one call, as sent."""

    traceparent: str | None = None
    tracestate: str | None = None
    request_start: str | None = None

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str]]) -> Incoming:
        """From header or metadata pairs (names compared case-insensitively; the first of each)."""
        found: dict[str, str] = {}
        for key, value in pairs:
            name = key.lower()
            if name in (TRACEPARENT, TRACESTATE, REQUEST_START) and name not in found and isinstance(value, str):
                found[name] = value
        return cls(found.get(TRACEPARENT), found.get(TRACESTATE), found.get(REQUEST_START))

    def parent(self) -> SpanRef | None:
        return parse_traceparent(self.traceparent)

    def state(self) -> str | None:
        """The tracestate to carry on: only with a parent, and only a valid one (W3C list
        members, at most 32, at most 512 characters); else None."""
        if self.parent() is None or not self.tracestate or len(self.tracestate) > _MAX_TRACESTATE_CHARS:
            return None
        members = [m.strip(" \t") for m in self.tracestate.split(",")]
        members = [m for m in members if m]
        if len(members) > _MAX_TRACESTATE_MEMBERS or not all(_TRACESTATE_MEMBER_RE.fullmatch(m) for m in members):
            return None
        return ",".join(members) or None

    def proxy_ns(self, received_ns: int) -> int | None:
        return parse_request_start(self.request_start, received_ns)


def parse_traceparent(value: str | None) -> SpanRef | None:
    """The parent span a `traceparent` names; None if absent or invalid (W3C Trace Context:
    version ff, ids of zeros, upper case, or more fields in version 00 are invalid)."""
    if not value or len(value) > 512:
        return None
    match = _TRACEPARENT_RE.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace, span = int(trace_id, 16), int(span_id, 16)
    if trace == 0 or span == 0:
        return None
    return SpanRef(trace, span, bool(int(flags, 16) & 1))


def parse_request_start(value: str | None, received_ns: int) -> int | None:
    """When a front proxy took the call, from `x-request-start` (`t=` then seconds with a
    fraction, or whole s, ms, us or ns since the epoch, as nginx, HAProxy and others write
    it), as time.time_ns(); None if absent, malformed, or not within the hour before receipt."""
    if not value or len(value) > 40:
        return None
    match = _REQUEST_START_RE.fullmatch(value.strip())
    if match is None:
        return None
    whole, fraction = match.groups()
    if fraction is not None:
        at = int(whole) * 1_000_000_000 + int(fraction.ljust(9, "0"))
    elif (unit := _UNIT_NS.get(len(whole))) is not None:
        at = int(whole) * unit
    else:
        return None
    return at if 0 <= received_ns - at <= _MAX_PROXY_NS else None


def new_trace_id() -> int:
    return random.getrandbits(128) or 1


def new_span_id() -> int:
    return random.getrandbits(64) or 1
