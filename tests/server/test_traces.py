"""Traces of requests through the live server (real Ray Serve, gRPC and HTTP through HAProxy,
the engine in its own process), received by the session's in-process OTLP collector.

Each call's spans form one trace whose id is the one its response names (gRPC trailing
metadata, HTTP headers); a caller's traceparent is continued. Every hop has its span, with
its parent: the ingress's (resolve, tokenize), the Serve handle call (`replica`) and the
replica's side of it, the adapter, the engine's stages (recorded in the engine process and
sent back over its pipe), the first token and the stream; attributes name the adapter and
count the tokens the client received.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import grpc
import pytest
import requests

from adapterserve.clients.client import classify_request, generate_request
from adapterserve.proto import adapterserve_pb2_grpc as pb_grpc
from tests.helpers.live_server import ALICE
from tests.helpers.otlp_collector import Span, names

CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
GENERATE = "adapterserve.v1.AdapterServe/Generate"
ENGINE_HOPS = {"replica.generate", "adapter", "engine", "engine.queue", "engine.prefill", "engine.decode"}
GENERATE_HOPS = {"ingress", "resolve", "tokenize", "replica", "first_token", "stream"} | ENGINE_HOPS
PARENTS = {  # span -> its parent's name, in a Generate trace
    "ingress": "root", "resolve": "ingress", "tokenize": "ingress", "replica": "root", "first_token": "root",
    "stream": "root", "replica.generate": "replica", "adapter": "replica.generate", "engine": "replica.generate",
    "engine.queue": "engine", "engine.prefill": "engine", "engine.decode": "engine",
}


@dataclass(frozen=True)
class Sent:
    trace_id: str  # as the response named it
    response: str  # its traceresponse
    tokens: list[int]  # token ids the client received
    prompt_tokens: int


def _grpc_generate(server, adapter: str, metadata: list[tuple[str, str]]) -> Sent:
    with grpc.insecure_channel(server.grpc) as channel:
        call = pb_grpc.AdapterServeStub(channel).Generate(
            generate_request("The lighthouse keeper", adapter=adapter, max_tokens=6, temperature=0.0, ignore_eos=True),
            metadata=[("authorization", f"Bearer {ALICE}"), *metadata], timeout=120)
        chunks = list(call)
        trailing = dict(call.trailing_metadata())
    return Sent(trailing["x-trace-id"], trailing["traceresponse"], [t for c in chunks for t in c.token_ids],
                chunks[0].prompt_tokens)


def _sse_completion(server, adapter: str) -> tuple[Sent, requests.Response]:
    body = {"model": adapter, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start_us = (time.time_ns() - 3_000_000) // 1000  # as a front proxy would stamp it, 3 ms before
    reply = requests.post(f"{server.http}/v1/completions", json=body, stream=True, timeout=120,
                          headers={"Authorization": f"Bearer {ALICE}", "X-Request-Start": f"t={start_us}"})
    tokens = []
    for line in reply.iter_lines():
        if line.startswith(b"data: {"):
            tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    return Sent(reply.headers["x-trace-id"], reply.headers["traceresponse"], tokens, 0), reply


@pytest.fixture(scope="module")
def sent(server, uploaded, otlp_collector) -> dict[str, Sent]:
    """The calls, made once; each test reads one trace."""
    calls = {"grpc": _grpc_generate(server, uploaded["sql"], [("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")])}
    calls["sse"], reply = _sse_completion(server, "chat")
    assert reply.status_code == 200
    missing = requests.post(f"{server.http}/v1/completions", json={"model": "no-such-adapter", "prompt": "hi"},
                            headers={"Authorization": f"Bearer {ALICE}"}, timeout=120)
    assert missing.status_code == 404
    calls["missing"] = Sent(missing.headers["x-trace-id"], missing.headers["traceresponse"], [], 0)
    with grpc.insecure_channel(server.grpc) as channel:
        _, call = pb_grpc.AdapterServeStub(channel).Classify.with_call(
            classify_request(["a wonderful film"], "sentiment"), metadata=[("authorization", f"Bearer {ALICE}")],
            timeout=120)
        trailing = dict(call.trailing_metadata())
    calls["classify"] = Sent(trailing["x-trace-id"], trailing["traceresponse"], [], 0)
    return calls


def _trace(collector, sent: Sent, wanted: set[str], root: str) -> dict[str, Span]:
    spans = collector.trace(sent.trace_id, lambda s: wanted | {root} <= names(s))
    by_name = {s.name: s for s in spans}
    assert len(by_name) == len(spans), sorted(s.name for s in spans)  # one span per hop
    by_name["root"] = by_name[root]
    return by_name


def _assert_parents(by_name: dict[str, Span], parents: dict[str, str]) -> None:
    for name, parent in parents.items():
        assert by_name[name].parent_id == by_name[parent].span_id, f"{name}'s parent is not {parent}"


def test_a_grpc_stream_continues_the_callers_trace(sent, uploaded, otlp_collector):
    call = sent["grpc"]
    assert call.trace_id == CALLER_TRACE
    spans = _trace(otlp_collector, call, GENERATE_HOPS, GENERATE)
    root = spans["root"]
    assert root.parent_id == CALLER_SPAN and root.kind == 2  # server
    assert call.response == f"00-{CALLER_TRACE}-{root.span_id}-01"
    _assert_parents(spans, PARENTS)
    assert (spans["replica"].kind, spans["replica.generate"].kind) == (3, 2)  # client -> server
    assert root.resource["adapterserve.component"] == "ingress"
    assert spans["engine"].resource["adapterserve.component"] == "model"
    assert root.attributes["adapterserve.adapter"] == uploaded["sql"]
    assert spans["adapter"].attributes["adapterserve.adapter"] == uploaded["sql"]
    assert root.attributes["gen_ai.usage.input_tokens"] == call.prompt_tokens > 0
    assert root.attributes["gen_ai.usage.output_tokens"] == len(call.tokens) == 6
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert root.attributes["rpc.grpc.status_code"] == 0 and root.status_code == 0


def test_the_hops_follow_one_another(sent, otlp_collector):
    """Spans of one process nest and follow in order (the ingress's, and the engine's)."""
    s = _trace(otlp_collector, sent["grpc"], GENERATE_HOPS, GENERATE)
    root, ingress = s["root"], s["ingress"]
    assert root.start_ns == ingress.start_ns <= s["resolve"].start_ns <= s["resolve"].end_ns <= s["tokenize"].start_ns
    assert s["tokenize"].end_ns <= ingress.end_ns == s["replica"].start_ns == s["first_token"].start_ns
    assert s["first_token"].end_ns == s["stream"].start_ns <= s["stream"].end_ns <= root.end_ns
    assert s["replica"].end_ns <= root.end_ns
    engine = [s["engine.queue"], s["engine.prefill"], s["engine.decode"]]
    assert s["engine"].start_ns == engine[0].start_ns and engine[-1].end_ns == s["engine"].end_ns
    assert all(a.end_ns == b.start_ns for a, b in zip(engine, engine[1:]))
    assert s["replica.generate"].start_ns <= s["adapter"].start_ns <= s["adapter"].end_ns <= s["engine"].start_ns
    assert s["engine"].end_ns <= s["replica.generate"].end_ns


def test_an_sse_stream_starts_a_trace_and_shows_the_proxy(sent, uploaded, otlp_collector):
    call = sent["sse"]
    spans = _trace(otlp_collector, call, GENERATE_HOPS | {"proxy"}, "POST /v1/completions")
    root = spans["root"]
    assert root.parent_id == "" and call.response == f"00-{call.trace_id}-{root.span_id}-01"
    _assert_parents(spans, {**PARENTS, "proxy": "root"})
    assert spans["proxy"].end_ns == root.start_ns and spans["proxy"].start_ns < root.start_ns
    assert root.attributes["http.route"] == "/v1/completions" and root.attributes["http.request.method"] == "POST"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["adapterserve.adapter"] == uploaded["chat"]
    assert root.attributes["gen_ai.usage.output_tokens"] == len(call.tokens) == 5
    assert spans["stream"].end_ns <= root.end_ns  # the trace ends with the stream, not the handler


def test_a_refused_call_names_its_trace_and_marks_the_hop(sent, otlp_collector):
    spans = _trace(otlp_collector, sent["missing"], {"ingress", "resolve"}, "POST /v1/completions")
    assert spans["resolve"].status_code == 2 and spans["resolve"].attributes["error.type"] == "AdapterNotFound"
    root = spans["root"]
    assert root.attributes["error.type"] == "NOT_FOUND" and root.attributes["http.response.status_code"] == 404
    assert root.status_code == 0  # a client's error leaves the server span unset
    assert "replica" not in spans


def test_classify_goes_through_the_encoder(sent, otlp_collector):
    spans = _trace(otlp_collector, sent["classify"], {"ingress", "resolve", "replica", "replica.classify", "adapter"},
                   "adapterserve.v1.AdapterServe/Classify")
    _assert_parents(spans, {"ingress": "root", "resolve": "ingress", "replica": "root",
                            "replica.classify": "replica", "adapter": "replica.classify"})
    assert spans["replica.classify"].resource["adapterserve.component"] == "encoder"
    assert spans["root"].attributes["adapterserve.adapter"].startswith("sentiment@")
