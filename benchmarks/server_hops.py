"""Where a streamed request spends its time in the server, hop by hop (`server_overhead.py --trace`).

The server records a call's hops as OpenTelemetry spans (server/tracing); here they go to an
OTLP receiver in this process, and the client stamps when it sent the call and when each
chunk arrived (time.time_ns(), one machine: one clock). The client names each call's trace
(its own traceparent), so every call's spans and client stamps meet by trace id.

The hops (HOPS below) follow the span names of server/tracing/traced.py. Recording spans
costs each call about 0.6 ms of CPU (BENCHMARKS.md, traces): compare hops within one run,
and take the added latency itself from the untraced paired run.
"""
from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from adapterserve.clients.client import generate_request
from adapterserve.proto import adapterserve_pb2_grpc as pb_grpc
from adapterserve.server.tracing.w3c import new_span_id, new_trace_id

# (row, what it measures): the table's rows, in a call's order
HOPS = (
    ("client -> ingress", "client sent -> the ingress's handler starts (HAProxy, gRPC)"),
    ("ingress work", "auth, admission, resolve, tokenize (span `ingress`)"),
    ("  of it: resolve", "span `resolve`"),
    ("  of it: tokenize", "span `tokenize`"),
    ("ingress -> replica", "handed to Serve's handle (direct: the local one) -> `replica.generate` starts"),
    ("replica work", "`replica.generate` start -> the engine process's request added (adapter, pipe)"),
    ("  of it: adapter", "span `adapter` (found, or loaded, and acquired)"),
    ("engine first token", "added -> first token (queue + prefill), in the engine process"),
    ("engine -> ingress", "first token -> its chunk at the ingress (pipe, replica, Serve stream unless direct)"),
    ("ingress -> client", "first chunk at the ingress -> at the client"),
    ("added to first token", "everything above but the engine's first token"),
    ("per later chunk", "(client stream time - engine decode time) / later chunks"),
    ("engine end -> client end", "last token in the engine -> last chunk at the client"),
    ("group: sent", "a group's calls: last minus first sent (one value per group)"),
    ("group: handlers start", "last minus first ingress handler start"),
    ("group: engine adds", "last minus first added in the engine process"),
    ("group: first tokens in engine", "last minus first first token in the engine"),
)


@dataclass
class Sent:
    """One call as the client saw it (time.time_ns())."""

    trace_id: str
    sent_ns: int
    chunk_ns: list[int] = field(default_factory=list)


def stub_of(grpc_address: str) -> pb_grpc.AdapterServeStub:
    """A stub on a channel of its own (call in the loop that will use it)."""
    return pb_grpc.AdapterServeStub(grpc.aio.insecure_channel(grpc_address))


async def traced_call(stub, prompt: list[int], max_tokens: int, adapter: str | None) -> Sent:
    trace_id = f"{new_trace_id():032x}"
    metadata = (("traceparent", f"00-{trace_id}-{new_span_id():016x}-01"),)
    request = generate_request(prompt, adapter=adapter, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sent = Sent(trace_id, time.time_ns())
    async for _ in stub.Generate(request, metadata=metadata, timeout=600):
        sent.chunk_ns.append(time.time_ns())
    return sent


async def traced_calls(grpc_address: str, prompts: Sequence[list[int]], max_tokens: int,
                       concurrency: int, adapter: str | None = None, clients=None) -> list[Sent]:
    """The prompts through the server, `concurrency` at a time (after one warm-up group), each
    naming `adapter` (None: the base model); from this process, or from `clients`
    (client_processes.ClientProcesses: a group's calls dealt out among them, sent at one instant)."""
    async with grpc.aio.insecure_channel(grpc_address) as channel:
        stub = pb_grpc.AdapterServeStub(channel)

        async def group(prompts: Sequence[list[int]]) -> list[Sent]:
            if clients is not None:
                return await clients.traced_group(grpc_address, list(prompts), max_tokens, adapter)
            return await asyncio.gather(*[traced_call(stub, p, max_tokens, adapter) for p in prompts])

        await group(prompts[:concurrency])
        sent: list[Sent] = []
        for i in range(0, len(prompts), concurrency):
            sent += await group(prompts[i:i + concurrency])
        return sent


def _ms(ns: int) -> float:
    return ns / 1e6


def _engine_first_token_ns(by_name: dict) -> int:
    """When the engine gave the call's first token: its decode span's start (the engine span's end
    for a call of one token)."""
    decode = by_name.get("engine.decode")
    return decode.start_ns if decode else by_name["engine"].end_ns


def hops_of(sent: Sent, spans: list) -> dict[str, float]:
    """One call's hops in ms from its spans (tests/helpers/otlp_collector.Span) and client stamps."""
    by_name = {s.name: s for s in spans}
    root = next(s for s in spans if s.name.endswith("/Generate"))
    ingress, replica, served = by_name["ingress"], by_name["replica"], by_name["replica.generate"]
    engine, first = by_name["engine"], by_name["first_token"]
    decode = by_name.get("engine.decode")
    first_token_ns = _engine_first_token_ns(by_name)
    later_chunks = len(sent.chunk_ns) - 1
    client_stream = sent.chunk_ns[-1] - sent.chunk_ns[0]
    engine_decode = (decode.end_ns - decode.start_ns) if decode else 0
    hops = {
        "client -> ingress": _ms(root.start_ns - sent.sent_ns),
        "ingress work": _ms(ingress.end_ns - ingress.start_ns),
        "  of it: resolve": _ms(by_name["resolve"].end_ns - by_name["resolve"].start_ns) if "resolve" in by_name else 0.0,
        "  of it: tokenize": _ms(by_name["tokenize"].end_ns - by_name["tokenize"].start_ns),
        "ingress -> replica": _ms(served.start_ns - replica.start_ns),
        "replica work": _ms(engine.start_ns - served.start_ns),
        "  of it: adapter": _ms(by_name["adapter"].end_ns - by_name["adapter"].start_ns) if "adapter" in by_name else 0.0,
        "engine first token": _ms(first_token_ns - engine.start_ns),
        "engine -> ingress": _ms(first.end_ns - first_token_ns),
        "ingress -> client": _ms(sent.chunk_ns[0] - first.end_ns),
        "per later chunk": _ms(client_stream - engine_decode) / later_chunks if later_chunks else float("nan"),
        "engine end -> client end": _ms(sent.chunk_ns[-1] - engine.end_ns),
    }
    hops["added to first token"] = _ms(sent.chunk_ns[0] - sent.sent_ns) - hops["engine first token"]
    return hops


def _group_spreads(group: list[tuple[Sent, list]]) -> dict[str, float]:
    """How far apart one group's calls (sent together) reached each stage: last minus first, ms."""
    def spread(stamps: list[int]) -> float:
        return _ms(max(stamps) - min(stamps))

    spans = [{s.name: s for s in found} for _, found in group]
    roots = [next(s for s in found if s.name.endswith("/Generate")) for _, found in group]
    return {
        "group: sent": spread([sent.sent_ns for sent, _ in group]),
        "group: handlers start": spread([root.start_ns for root in roots]),
        "group: engine adds": spread([by["engine"].start_ns for by in spans]),
        "group: first tokens in engine": spread([_engine_first_token_ns(by) for by in spans]),
    }


def collect_hops(collector, sent: list[Sent], concurrency: int = 1) -> dict[str, list[float]]:
    """Every call's hops, once all its spans arrived (the exporters send every few seconds);
    with `concurrency` > 1 also each group's spreads (the "group:" rows of HOPS)."""
    needed = {"ingress", "replica", "replica.generate", "engine", "first_token", "stream"}
    by_hop: dict[str, list[float]] = defaultdict(list)
    found = []
    for call in sent:
        spans = collector.trace(call.trace_id, until=lambda s: needed <= {x.name for x in s}, wait_s=60)
        found.append((call, spans))
        for hop, ms in hops_of(call, spans).items():
            by_hop[hop].append(ms)
    if concurrency > 1:
        for i in range(0, len(found) - concurrency + 1, concurrency):
            for row, ms in _group_spreads(found[i:i + concurrency]).items():
                by_hop[row].append(ms)
    return by_hop


def report_hops(by_concurrency: dict[int, dict[str, list[float]]]) -> None:
    """One table: median (p10-p90) ms of each hop, a column per concurrency."""
    levels = sorted(by_concurrency)
    print("| hop | " + " | ".join(f"conc {c}: median (p10-p90) ms" for c in levels) + " | what |")
    print("|---|" + "---|" * len(levels) + "---|")
    for hop, what in HOPS:
        cells = []
        for c in levels:
            values = sorted(by_concurrency[c].get(hop, []))
            values = [v for v in values if not math.isnan(v)]  # NaN: a call of one chunk
            if not values:
                cells.append("-")
                continue
            deciles = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
            p10, p90 = deciles[0], deciles[-1]
            cells.append(f"{statistics.median(values):.2f} ({p10:.2f}-{p90:.2f})")
        print(f"| {hop} | " + " | ".join(cells) + f" | {what} |")
