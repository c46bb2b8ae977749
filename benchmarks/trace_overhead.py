"""What traces cost a request on the server path: the ingress's and the engine replica's
trace work for one streamed request, with traces off and on, on this CPU.

    PYTHONPATH=. python benchmarks/trace_overhead.py                 # 20,000 calls per row
    PYTHONPATH=. python benchmarks/trace_overhead.py --calls 2000    # quicker

Each call runs what the server runs for one Generate request (server/tracing): the ingress's
call with its hooks (resolve, tokenize, handoff, one `relayed` per chunk, the end, the
trailing metadata) and the replica's part (adapter span, engine stage times turned into
spans). Rows: `none`, the same Python without any trace object (the floor: a loop and the
fake chunks); `off`, traces off (ids and headers only, what every server without an OTLP
endpoint does); `on, sampled out`, traces on but the sampler drops the call
(OTEL_TRACES_SAMPLER=always_off); `on`, every call recorded, its spans batched and sent over
OTLP/gRPC to a receiver in this process on loopback that counts them (the queue is made
large enough that none is dropped; the process's CPU time runs until the last span is sent,
so it holds the sending thread's work). In the server the ingress holds 7 of the 13 spans
of a call and the engine replica 6, each in its own process. Per row: median and p90 wall
microseconds per call over batches of 100 calls, and CPU microseconds per call over the run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from types import SimpleNamespace

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from adapterserve.server.settings import merge_config
from adapterserve.server.tracing import Tracing, open_tracing

CHUNKS = 16  # chunks per streamed request (each may carry several tokens)
BATCH = 100
VERSION = SimpleNamespace(ref="sql@1")
GRPC_METADATA = [("authorization", "Bearer key"), ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]


class _Context:
    """RayServegRPCContext's trailing metadata, as Serve keeps it."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, str]] = []

    def trailing_metadata(self) -> list[tuple[str, str]]:
        return self.pairs

    def set_trailing_metadata(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = pairs


class _Counter(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC receiver that only counts the spans it gets."""

    def __init__(self) -> None:
        self.spans, self._lock = 0, threading.Lock()

    def Export(self, request, context):
        n = sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def _receiver() -> Iterator[tuple[str, _Counter]]:
    server, counter = grpc.server(futures.ThreadPoolExecutor(max_workers=1)), _Counter()
    port = server.add_insecure_port("127.0.0.1:0")
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(counter, server)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", counter
    finally:
        server.stop(grace=None)


def _bare_call(chunks: list[dict]) -> int:
    tokens = 0
    for chunk in chunks:
        tokens += len(chunk["token_ids"])
    return tokens


def _traced_call(tracing: Tracing, chunks: list[dict]) -> int:
    call = tracing.grpc_call("Generate", GRPC_METADATA)
    with call.span("resolve"):
        pass
    call.resolved(VERSION)
    with call.span("tokenize"):
        pass
    call.tokenized(12)
    replica = tracing.replica_call("generate", call.handoff())
    with replica.span("adapter", {"adapterserve.adapter": VERSION.ref}):
        pass
    if replica.times is not None:
        now = time.time_ns()
        vars(replica.times).update(added_ns=now, scheduled_ns=now + 1, first_token_ns=now + 2, finished_ns=now + 3)
    replica.finish()
    tokens = 0
    for chunk in chunks:
        call.relayed(chunk)
        tokens += len(chunk["token_ids"])
    call.replica_done()
    call.tag_grpc(_Context())
    call.finish("OK")
    return tokens


def _measure(name: str, run, calls: int, flush=None) -> dict:
    chunks = [{"token_ids": [7, 8], "finish_reason": None} for _ in range(CHUNKS - 1)]
    chunks.append({"token_ids": [9], "finish_reason": "length"})
    for _ in range(BATCH):  # warm up
        run(chunks)
    per_call_us, cpu0 = [], time.process_time()
    for _ in range(calls // BATCH):
        start = time.perf_counter()
        for _ in range(BATCH):
            run(chunks)
        per_call_us.append((time.perf_counter() - start) / BATCH * 1e6)
    if flush is not None:
        flush()
    cpu_us = (time.process_time() - cpu0) / (len(per_call_us) * BATCH) * 1e6
    per_call_us.sort()
    return {"row": name, "median": statistics.median(per_call_us),
            "p90": per_call_us[int(0.9 * (len(per_call_us) - 1))], "cpu": cpu_us}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args()
    rows = [_measure("none", _bare_call, args.calls)]
    off = Tracing()
    rows.append(_measure("off", lambda chunks: _traced_call(off, chunks), args.calls))
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(20 * (args.calls + BATCH))  # keep every span
    with _receiver() as (endpoint, counter):
        config = merge_config({"tracing": {"otlp_endpoint": endpoint}})
        os.environ["OTEL_TRACES_SAMPLER"] = "always_off"
        dropped = open_tracing(config, "ingress")
        rows.append(_measure("on, sampled out", lambda chunks: _traced_call(dropped, chunks), args.calls))
        del os.environ["OTEL_TRACES_SAMPLER"]
        on = open_tracing(config, "ingress")
        rows.append(_measure("on", lambda chunks: _traced_call(on, chunks), args.calls, flush=on.close))
        dropped.close()
        received = counter.spans
    print(f"\n{_cpu_name()}; {args.calls} calls per row, {CHUNKS} chunks per call; spans received with "
          f"traces on: {received:,}\n")
    print("| traces | wall us per call, median | p90 | CPU us per call |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['median']:.1f} | {r['p90']:.1f} | {r['cpu']:.1f} |")


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
