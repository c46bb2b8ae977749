"""Traces without Ray: W3C trace context, the settings and environment that turn traces on,
nothing of OpenTelemetry imported when they are off, and spans sent to a real OTLP receiver
on loopback (gRPC and HTTP) with their names, parents and attributes (server/tracing).

The live server's traces (every hop, across the Serve handle and the engine process's pipe)
are tests/server/test_traces.py's.
"""
from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from adapterserve.engine.request import RequestTimes
from adapterserve.server.settings import merge_config
from adapterserve.server.tracing import Tracing, open_tracing
from adapterserve.server.tracing.calls import CallTrace
from adapterserve.server.tracing.config import check_settings, http_traces_url, otlp_settings
from adapterserve.server.tracing.w3c import Incoming, SpanRef, parse_request_start, parse_traceparent
from tests.helpers.otlp_collector import collecting

TRACE, SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
CALLER = f"00-{TRACE}-{SPAN}-01"
OFF = {"otlp_endpoint": None, "otlp_protocol": None, "service_name": None}


def tracing_config(**settings) -> dict:
    return merge_config({"tracing": settings})


# --- W3C trace context -------------------------------------------------------------------

@pytest.mark.parametrize("value, parsed", [
    (CALLER, SpanRef(int(TRACE, 16), int(SPAN, 16), True)),
    (f"00-{TRACE}-{SPAN}-00", SpanRef(int(TRACE, 16), int(SPAN, 16), False)),
    (f"00-{TRACE}-{SPAN}-03", SpanRef(int(TRACE, 16), int(SPAN, 16), True)),  # other flags: sampled bit read
    (f"01-{TRACE}-{SPAN}-01-later-fields", SpanRef(int(TRACE, 16), int(SPAN, 16), True)),  # a later version
    (f" {CALLER} ", SpanRef(int(TRACE, 16), int(SPAN, 16), True)),
])
def test_a_valid_traceparent_names_the_callers_span(value, parsed):
    assert parse_traceparent(value) == parsed


@pytest.mark.parametrize("value", [
    None, "", "garbage", CALLER.upper(), f"ff-{TRACE}-{SPAN}-01", f"00-{'0' * 32}-{SPAN}-01",
    f"00-{TRACE}-{'0' * 16}-01", f"00-{TRACE}-{SPAN}-01-extra", f"00-{TRACE[:-1]}-{SPAN}-01",
    f"00-{TRACE}-{SPAN}-1", f"00_{TRACE}_{SPAN}_01", CALLER + "x" * 600, f"00-{TRACE}-{SPAN}-0g",
])
def test_an_invalid_traceparent_is_ignored(value):
    assert parse_traceparent(value) is None


def test_a_call_continues_the_callers_trace_or_starts_one():
    continued = CallTrace.untraced(Incoming.of([("Traceparent", CALLER)]))
    assert continued.trace_id == int(TRACE, 16) and continued.span_id != int(SPAN, 16)
    headers = continued.headers()
    assert headers == {"x-trace-id": TRACE, "traceresponse": f"00-{TRACE}-{continued.span_id:016x}-00"}

    fresh = [CallTrace.untraced(Incoming.of([("traceparent", "garbage")])) for _ in range(2)]
    assert fresh[0].trace_id != fresh[1].trace_id
    assert all(0 < c.trace_id < 2**128 and 0 < c.span_id < 2**64 for c in fresh)
    assert parse_traceparent(fresh[0].headers()["traceresponse"]).trace_id == fresh[0].trace_id


def test_trailing_metadata_gets_the_trace_and_keeps_retry_advice():
    class Context:  # RayServegRPCContext's two methods, as Serve implements them
        def __init__(self):
            self.pairs = [("request_id", "r1")]

        def trailing_metadata(self):
            return self.pairs

        def set_trailing_metadata(self, pairs):
            self.pairs = [("request_id", "r1")] + pairs

    context = Context()
    context.set_trailing_metadata([("retry-after-s", "1")])
    call = CallTrace.untraced(Incoming())
    call.tag_grpc(context)
    call.tag_grpc(context)  # idempotent
    assert context.pairs == [("request_id", "r1"), ("retry-after-s", "1"), *call.headers().items()]


def test_tracestate_is_kept_only_when_valid():
    assert Incoming(CALLER, "vendor=1, other=x@y").state() == "vendor=1,other=x@y"
    for bad in ("a=b=c", "UPPER=1", ",".join(f"k{i}=v" for i in range(33)), "k=" + "v" * 600, "\x00=1"):
        assert Incoming(CALLER, bad).state() is None
    assert Incoming(None, "vendor=1").state() is None  # no parent: nothing to carry on


def test_a_front_proxys_request_start_in_any_common_unit():
    now = time.time_ns()
    at = now - 12_345_678  # 12 ms before receipt
    for value in (f"t={at // 1000}", f"{at // 1_000_000}", f"t={at / 1e9:.6f}", f"t={at}"):
        parsed = parse_request_start(value, now)
        assert parsed is not None and abs(parsed - at) < 1_000_000, value
    for value in (None, "", "t=abc", "t=-5", "t=" + "9" * 25, f"t={now // 1000 + 60_000_000}",
                  f"t={(now - 7200 * 10**9) // 1000}", "t=12345", "t=1.2.3"):
        assert parse_request_start(value, now) is None, value


# --- settings and environment ------------------------------------------------------------

def test_traces_are_off_unless_an_endpoint_is_set():
    assert otlp_settings(OFF, {}) is None
    on = otlp_settings({**OFF, "otlp_endpoint": "http://collector:4317"}, {})
    assert (on.endpoint, on.protocol, on.service_name) == ("http://collector:4317", "grpc", "adapterserve")


def test_the_standard_environment_is_honoured():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_SERVICE_NAME": "gateway-llm"}
    on = otlp_settings(OFF, env)
    assert (on.endpoint, on.protocol, on.service_name) == (None, "http/protobuf", "gateway-llm")  # exporter reads it
    assert otlp_settings(OFF, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317/"}).protocol == "grpc"
    assert otlp_settings({**OFF, "otlp_protocol": "http"}, env).protocol == "http/protobuf"  # settings first
    for off in ({"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}):
        assert otlp_settings({**OFF, "otlp_endpoint": "http://c:4317"}, {**env, **off}) is None


@pytest.mark.parametrize("key, value, says", [
    ("otlp_endpoint", "collector:4317", "tracing.otlp_endpoint must be the collector's URL"),
    ("otlp_endpoint", "ftp://collector", "tracing.otlp_endpoint"),
    ("otlp_endpoint", 4317, "tracing.otlp_endpoint"),
    ("otlp_protocol", "http/json", "tracing.otlp_protocol must be one of grpc, http/protobuf"),
    ("service_name", " ", "tracing.service_name"),
])
def test_a_bad_setting_is_refused_by_name(key, value, says):
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        check_settings({**OFF, key: value}, {})


def test_a_bad_protocol_in_the_environment_is_refused_by_name():
    with pytest.raises(ValueError, match=r"\$OTEL_EXPORTER_OTLP_PROTOCOL is 'http/json'"):
        otlp_settings(OFF, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_an_unknown_tracing_key_is_refused():
    with pytest.raises(ValueError, match="unknown config.tracing key 'endpoint'"):
        merge_config({"tracing": {"endpoint": "http://c:4317"}})


def test_the_http_url_gets_the_traces_path_unless_it_has_one():
    assert http_traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert http_traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert http_traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"


def test_off_imports_no_opentelemetry():
    """Traces off: the ingress's and the engine process's modules, a call's ids and hooks and a
    timed engine stream's records import nothing of OpenTelemetry."""
    script = """
import sys
from adapterserve.server.tracing import open_tracing
import adapterserve.server.engine_process.child
tracing = open_tracing({"tracing": %r}, "ingress")
call = tracing.http_call("POST", "/v1/completions", [("traceparent", %r)])
with call.span("resolve"):
    pass
assert call.handoff() is None and tracing.replica_call("generate", None).times is None
call.relayed({"token_ids": [1]}); call.replica_done(); call.finish("OK")
print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
""" % (OFF, CALLER)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_open_tracing_is_off_by_default():
    assert type(open_tracing(merge_config(), "ingress")) is Tracing


# --- spans to a real OTLP receiver ---------------------------------------------------------

def _generate_call(tracing, parent: str | None) -> tuple:
    """One Generate call through every ingress hook and its replica part; (call, trace id hex)."""
    metadata = [("traceparent", parent)] if parent else []
    start = time.time_ns() - 5_000_000
    call = tracing.grpc_call("Generate", [*metadata, ("x-request-start", f"t={start // 1000}")])
    with call.span("resolve"):
        pass
    call.resolved(SimpleNamespace(ref="sql@2"))
    with call.span("tokenize"):
        pass
    call.tokenized(7)
    replica = tracing.replica_call("generate", call.handoff())
    with replica.span("adapter", {"adapterserve.adapter": "sql@2"}):
        pass
    now = time.time_ns()
    vars(replica.times).update(added_ns=now, scheduled_ns=now + 1000, first_token_ns=now + 5000,
                               finished_ns=now + 9000)
    replica.finish()
    for tokens, reason in (([4, 5], None), ([6], "length")):
        call.relayed({"token_ids": tokens, "finish_reason": reason})
    call.replica_done()
    call.finish("OK")
    return call, f"{call.trace_id:032x}"


EXPECTED = {  # span -> its parent's name (None: the caller's span)
    "adapterserve.v1.AdapterServe/Generate": None, "proxy": "adapterserve.v1.AdapterServe/Generate",
    "ingress": "adapterserve.v1.AdapterServe/Generate", "resolve": "ingress", "tokenize": "ingress",
    "replica": "adapterserve.v1.AdapterServe/Generate", "replica.generate": "replica",
    "adapter": "replica.generate", "engine": "replica.generate", "engine.queue": "engine",
    "engine.prefill": "engine", "engine.decode": "engine",
    "first_token": "adapterserve.v1.AdapterServe/Generate", "stream": "adapterserve.v1.AdapterServe/Generate",
}


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_an_otlp_receiver(protocol):
    with collecting("grpc" if protocol == "grpc" else "http") as collector:
        tracing = open_tracing(tracing_config(otlp_endpoint=collector.endpoint, otlp_protocol=protocol,
                                              service_name="test-adapterserve"), "ingress")
        call, trace_id = _generate_call(tracing, CALLER)
        tracing.close()  # sends what waits
        spans = collector.trace(trace_id, lambda s: len(s) >= len(EXPECTED), wait_s=10)
    assert trace_id == TRACE and call.headers()["traceresponse"] == f"00-{TRACE}-{call.span_id:016x}-01"
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == sorted(EXPECTED) and len(spans) == len(EXPECTED)
    for name, parent in EXPECTED.items():
        assert by_name[name].parent_id == (by_name[parent].span_id if parent else SPAN), name
    root = by_name["adapterserve.v1.AdapterServe/Generate"]
    assert root.span_id == f"{call.span_id:016x}" and root.kind == 2 and by_name["replica"].kind == 3
    assert root.attributes == {
        "rpc.system": "grpc", "rpc.service": "adapterserve.v1.AdapterServe", "rpc.method": "Generate",
        "adapterserve.adapter": "sql@2", "gen_ai.usage.input_tokens": 7, "gen_ai.usage.output_tokens": 3,
        "gen_ai.response.finish_reasons": ["length"], "rpc.grpc.status_code": 0,
    }
    assert root.resource["service.name"] == "test-adapterserve"
    assert root.resource["adapterserve.component"] == "ingress"
    engine = [by_name[n] for n in ("engine.queue", "engine.prefill", "engine.decode")]
    assert [s.end_ns - s.start_ns for s in engine] == [1000, 4000, 4000]
    assert by_name["proxy"].end_ns == root.start_ns == by_name["ingress"].start_ns
    assert by_name["ingress"].end_ns == by_name["replica"].start_ns == by_name["first_token"].start_ns
    assert by_name["first_token"].end_ns == by_name["stream"].start_ns


def test_a_failed_call_is_marked_and_an_unsampled_caller_is_not_recorded():
    with collecting("grpc") as collector:
        tracing = open_tracing(tracing_config(otlp_endpoint=collector.endpoint), "ingress")
        unsampled = tracing.grpc_call("Generate", [("traceparent", f"00-{TRACE}-{SPAN}-00")])
        assert not unsampled.recording and unsampled.handoff() is None
        assert unsampled.headers()["traceresponse"].endswith("-00")

        failed = tracing.grpc_call("Generate", [])
        with pytest.raises(LookupError):
            with failed.span("resolve"):
                raise LookupError("no adapter 'x'")
        failed.finish("UNAVAILABLE")
        tracing.close()
        spans = collector.trace(f"{failed.trace_id:032x}", lambda s: len(s) == 3, wait_s=10)
        assert not [s for s in collector.spans if s.trace_id == TRACE]
    by_name = {s.name: s for s in spans}
    assert by_name["resolve"].status_code == 2 and by_name["resolve"].attributes["error.type"] == "LookupError"
    root = by_name["adapterserve.v1.AdapterServe/Generate"]
    assert root.parent_id == "" and root.status_code == 2
    assert root.attributes["error.type"] == "UNAVAILABLE" and root.attributes["rpc.grpc.status_code"] == 14
    assert by_name["ingress"].end_ns == root.end_ns  # it never reached a replica


def test_engine_stages_left_unreached_are_left_out():
    """A request cancelled while waiting: engine and engine.queue only, ending at the cancel."""
    with collecting("grpc") as collector:
        tracing = open_tracing(tracing_config(otlp_endpoint=collector.endpoint), "model")
        replica = tracing.replica_call("generate", CALLER)
        replica.times.added_ns = time.time_ns()
        replica.failed("cancelled")
        replica.finish()
        tracing.close()
        spans = collector.trace(TRACE, lambda s: len(s) == 3, wait_s=10)
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"replica.generate", "engine", "engine.queue"}
    assert by_name["replica.generate"].status_code == 2 and by_name["replica.generate"].parent_id == SPAN
    assert by_name["engine.queue"].end_ns == by_name["engine"].end_ns <= by_name["replica.generate"].end_ns


def test_request_times_are_taken_in_order(tmp_path):
    """Engine.stream fills a request's stage times (the engine a replica drives, in process)."""
    import asyncio

    from adapterserve.engine.engine import Engine
    from adapterserve.engine.sampling_params import SamplingParams
    from adapterserve.models.tiny import write_tiny_checkpoint

    engine = Engine.from_pretrained(write_tiny_checkpoint(tmp_path / "tiny", "llama"), max_num_batched_tokens=4)

    async def run() -> tuple[RequestTimes, int]:
        times, chunks = RequestTimes(), 0
        async for _ in engine.stream(list(range(1, 11)), SamplingParams(max_tokens=3, temperature=0.0), times=times):
            chunks += 1
        return times, chunks

    times, chunks = asyncio.run(run())
    assert 0 < times.added_ns < times.scheduled_ns < times.first_token_ns <= times.finished_ns
    assert chunks >= 1
