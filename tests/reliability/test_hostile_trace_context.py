"""Hostile trace headers (traceparent, tracestate, x-request-start) over HTTP and gRPC, on the
live test server (which sends traces to the session's OTLP collector).

W3C Trace Context asks that a bad trace header never fails a request: each call here must
be served with exactly the tokens of a clean call, and name a well-formed trace of its own
(x-trace-id, traceresponse) that the server records as a new trace, with no parent. A valid
traceparent of a later version is continued; an unsampled one is continued and not recorded.
"""
from __future__ import annotations

import re
import time

import grpc
import pytest
import requests

from adapterserve.clients.client import generate_request
from adapterserve.proto import adapterserve_pb2_grpc as pb_grpc
from tests.helpers.live_server import ALICE
from tests.reliability.hostile_corpus import BASE

TRACE, SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
PROMPT, MAX_TOKENS = "The lighthouse keeper", 4
FUTURE_US = (time.time_ns() + 3600 * 10**9) // 1000
HOSTILE = {  # case -> trace headers (all ignored: the call starts a trace of its own)
    "not a traceparent": {"traceparent": "garbage"},
    "upper-case hex": {"traceparent": f"00-{TRACE.upper()}-{SPAN}-01"},
    "version ff": {"traceparent": f"ff-{TRACE}-{SPAN}-01"},
    "trace id of zeros": {"traceparent": f"00-{'0' * 32}-{SPAN}-01"},
    "span id of zeros": {"traceparent": f"00-{TRACE}-{'0' * 16}-01"},
    "version 00 with more fields": {"traceparent": f"00-{TRACE}-{SPAN}-01-more"},
    "short trace id": {"traceparent": f"00-{TRACE[:30]}-{SPAN}-01"},
    "4 KB traceparent": {"traceparent": f"00-{TRACE}-{SPAN}-01" + "a" * 4000},
    "tracestate without traceparent": {"tracestate": "vendor=1"},
    "request start in the future": {"x-request-start": f"t={FUTURE_US}"},
    "request start not a number": {"x-request-start": "t=yesterday"},
    "request start of 40 digits": {"x-request-start": "t=" + "9" * 40},
    "request start negative": {"x-request-start": "t=-1700000000"},
}
CONTINUED = {  # case -> trace headers a caller's trace goes on with
    "later version with more fields": {"traceparent": f"01-{TRACE}-{SPAN}-01-later"},
    "valid traceparent, garbage tracestate": {"traceparent": f"00-{TRACE}-{SPAN}-01", "tracestate": "=,=,a=b=c" * 100},
}
TRACE_ID = re.compile(r"[0-9a-f]{32}")


def _http(server, headers: dict[str, str]) -> tuple[list[int], dict[str, str]]:
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    reply = requests.post(f"{server.http}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {ALICE}", **headers})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"], dict(reply.headers)


def _grpc(server, headers: dict[str, str]) -> tuple[list[int], dict[str, str]]:
    with grpc.insecure_channel(server.grpc) as channel:
        call = pb_grpc.AdapterServeStub(channel).Generate(
            generate_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            metadata=[("authorization", f"Bearer {ALICE}"), *headers.items()], timeout=120)
        tokens = [t for chunk in call for t in chunk.token_ids]
        return tokens, dict(call.trailing_metadata())


SEND = {"http": _http, "grpc": _grpc}
UNSAMPLED = "1f2e3d4c5b6a79881f2e3d4c5b6a7988"
CASES = {**HOSTILE, **CONTINUED, "unsampled caller": {"traceparent": f"00-{UNSAMPLED}-{SPAN}-00"}, "clean": {}}


@pytest.fixture(scope="module")
def answers(server) -> dict[tuple[str, str], tuple[list[int], dict[str, str]]]:
    """(via, case) -> (tokens, trace headers or trailing metadata); every call made once, the
    clean ones last (their spans come after the others')."""
    return {(via, case): send(server, CASES[case]) for case in CASES for via, send in SEND.items()}


def _root_of(collector, trace_id: str):
    """The ingress's server span of a trace, once received."""
    spans = collector.trace(trace_id, lambda s: any(x.kind == 2 and x.name != "replica.generate" for x in s))
    return next(s for s in spans if s.kind == 2 and s.name != "replica.generate")


@pytest.mark.parametrize("via", SEND)
@pytest.mark.parametrize("case", HOSTILE)
def test_a_bad_trace_header_starts_a_new_trace(otlp_collector, answers, via, case):
    tokens, answer = answers[via, case]
    assert tokens == answers[via, "clean"][0]
    trace_id = answer["x-trace-id"]
    assert TRACE_ID.fullmatch(trace_id) and trace_id != TRACE and int(trace_id, 16) != 0
    assert re.fullmatch(rf"00-{trace_id}-[0-9a-f]{{16}}-01", answer["traceresponse"])
    assert _root_of(otlp_collector, trace_id).parent_id == ""
    assert "proxy" not in {s.name for s in otlp_collector.spans if s.trace_id == trace_id}


@pytest.mark.parametrize("via", SEND)
@pytest.mark.parametrize("case", CONTINUED)
def test_a_valid_traceparent_is_continued_whatever_comes_with_it(otlp_collector, answers, via, case):
    tokens, answer = answers[via, case]
    assert tokens == answers[via, "clean"][0] and answer["x-trace-id"] == TRACE
    root_id = answer["traceresponse"].split("-")[2]
    root = next(s for s in otlp_collector.trace(TRACE, lambda s: root_id in {x.span_id for x in s})
                if s.span_id == root_id)
    assert root.parent_id == SPAN


@pytest.mark.parametrize("via", SEND)
def test_an_unsampled_caller_is_continued_and_not_recorded(otlp_collector, answers, via):
    tokens, answer = answers[via, "unsampled caller"]
    assert tokens == answers[via, "clean"][0] and answer["x-trace-id"] == UNSAMPLED
    assert answer["traceresponse"].endswith("-00")
    _root_of(otlp_collector, answers[via, "clean"][1]["x-trace-id"])  # sent later: its spans are in
    assert not [s for s in otlp_collector.spans if s.trace_id == UNSAMPLED]
