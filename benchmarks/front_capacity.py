"""What the replica's own gRPC port can take: the replica's event loop serving it
(`replica_grpc.workers: 0`) against N front worker processes forwarding to it
(server/front/), under load from several client processes, each its own connection.

    PYTHONPATH=. python benchmarks/front_capacity.py                      # workers 0 1 2 4
    PYTHONPATH=. python benchmarks/front_capacity.py --workers 0 4 --clients 16 --streams 4

The server is a servicer of this script's, not the Ingress: each Generate call burns
--work-us of CPU on the replica's loop (the Ingress's own work per call: auth, quotas,
admission, validation, the engine's pipe) and streams --tokens replies. So the table shows
what the port's gRPC layer costs the replica's loop, and the calls per second and latency
that the loop allows, for each way of serving the port. No GPU, no Ray. Reports, per way:
calls/s, call latency p50 / p99 (start to last reply), and the replica process's CPU per call.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import time

import grpc
from grpc_health.v1 import health_pb2_grpc

from adapterserve.proto import adapterserve_pb2 as pb
from adapterserve.proto import adapterserve_pb2_grpc as pb_grpc
from adapterserve.server.ports import free_port

HOST = "127.0.0.1"


class Servicer(pb_grpc.AdapterServeServicer, health_pb2_grpc.HealthServicer):
    """Generate only (the generated bases stand in for the other methods, never called)."""

    def __init__(self, work_us: float, tokens: int) -> None:
        self.work_s, self.tokens = work_us / 1e6, tokens

    async def Generate(self, request, context):
        dict(context.invocation_metadata())
        until = time.perf_counter() + self.work_s
        while time.perf_counter() < until:  # the Ingress's work per call, on the loop
            pass
        for i in range(self.tokens):
            yield pb.GenerateResponse(token_ids=[i])
            await asyncio.sleep(0)


def _serve(workers: int, port: int, work_us: float, tokens: int, ready, stop, cpu) -> None:
    async def run() -> None:
        servicer = Servicer(work_us, tokens)
        if workers:
            from adapterserve.server.front.pool import FrontPool

            server = FrontPool(servicer, HOST, port, workers)
            await server.start()
        else:
            from adapterserve.server.replica_grpc import start_listener

            server = await start_listener(servicer, HOST, port)
        ready.set()
        start = time.process_time()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        cpu.value = time.process_time() - start
        await server.stop(0)

    _loop_run(run())


def _loop_run(coro) -> None:
    try:
        import uvloop  # as Ray's replicas run
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def _load(port: int, streams: int, seconds: float, go, out) -> None:
    async def run() -> None:
        latencies: list[float] = []
        async with grpc.aio.insecure_channel(f"{HOST}:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            stub = pb_grpc.AdapterServeStub(ch)
            request = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=1))

            async def call() -> None:
                async for _ in stub.Generate(request):
                    pass

            await asyncio.gather(*(call() for _ in range(streams)))  # the connection, warm
            go.wait()
            until = time.perf_counter() + seconds

            async def keep_calling() -> None:
                while time.perf_counter() < until:
                    start = time.perf_counter()
                    await call()
                    latencies.append(time.perf_counter() - start)

            await asyncio.gather(*(keep_calling() for _ in range(streams)))
        out.put(latencies)

    _loop_run(run())


def measure(workers: int, clients: int, streams: int, seconds: float, work_us: float, tokens: int) -> dict:
    ctx = mp.get_context("spawn")
    port = free_port()
    ready, stop, go, cpu, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Value("d", 0.0), ctx.Queue()
    server = ctx.Process(target=_serve, args=(workers, port, work_us, tokens, ready, stop, cpu))
    server.start()
    assert ready.wait(120), "the server did not start"
    loads = [ctx.Process(target=_load, args=(port, streams, seconds, go, out)) for _ in range(clients)]
    for p in loads:
        p.start()
    time.sleep(2.0)  # every client connected and warm
    go.set()
    latencies = [x for _ in loads for x in out.get(timeout=seconds + 120)]
    for p in loads:
        p.join()
    stop.set()
    server.join(60)
    latencies.sort()
    calls = len(latencies)
    return {"calls/s": calls / seconds, "p50": latencies[calls // 2] * 1e3,
            "p99": latencies[int(calls * 0.99)] * 1e3, "cpu_us": cpu.value / calls * 1e6 if calls else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--clients", type=int, default=16, help="client processes, a connection each")
    parser.add_argument("--streams", type=int, default=1, help="concurrent calls per client")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--work-us", type=float, default=100.0, help="the replica loop's own work per call")
    parser.add_argument("--tokens", type=int, default=8, help="replies streamed per call")
    args = parser.parse_args()
    rows = {w: measure(w, args.clients, args.streams, args.seconds, args.work_us, args.tokens) for w in args.workers}
    base = rows[args.workers[0]]
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {args.clients} clients x "
          f"{args.streams} streams, {args.tokens} replies a call, {args.work_us:g} us of replica work a call, "
          f"{args.seconds:g} s each")
    print("| replica_grpc.workers | calls/s | vs first | p50 ms | p99 ms | replica CPU us/call |")
    print("|---|---|---|---|---|---|")
    for w, r in rows.items():
        print(f"| {w} | {r['calls/s']:,.0f} | {r['calls/s'] / base['calls/s']:.2f}x | {r['p50']:.2f} | "
              f"{r['p99']:.2f} | {r['cpu_us']:.0f} |")


if __name__ == "__main__":
    main()
