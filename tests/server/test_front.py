"""Front workers (server/front/): N processes share the replica's own gRPC port and forward
every call to the replica, which runs its handlers. Here without Ray: a servicer of our own
behind a real FrontPool (real worker processes, real gRPC over loopback), its answers held
against the same servicer behind the replica's own single-loop listener."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapterserve.proto import adapterserve_pb2 as pb
from adapterserve.proto import adapterserve_pb2_grpc as pb_grpc
from adapterserve.server.front import port_audit
from adapterserve.server.front.pool import FrontPool
from adapterserve.server.grpc_services import Undecodable
from adapterserve.server.ports import PortInUse, free_port
from adapterserve.server.replica_grpc import start_listener

HOST = "127.0.0.1"


class Servicer(pb_grpc.AdapterServeServicer, health_pb2_grpc.HealthServicer):
    """Answers that show what reached the handler: metadata, the parsed request, the stream (the
    generated bases stand in for the methods not used here)."""

    def __init__(self) -> None:
        self.cancelled = 0

    async def Generate(self, request, context):
        if isinstance(request, Undecodable):
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(request.refuse().args[0])
            return
        who = dict(context.invocation_metadata()).get("authorization", "")
        try:
            for i in range(request.sampling.max_tokens):
                await asyncio.sleep(request.sampling.seed / 1000)  # seed: ms between tokens
                yield pb.GenerateResponse(token_ids=[i], text=who, request_id=request.text)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        context.set_trailing_metadata([("served-by", str(os.getpid()))])

    async def UploadAdapter(self, requests, context):
        sizes = [len(r.chunk.data) async for r in requests]
        return pb.AdapterInfo(name=",".join(map(str, sizes)))

    async def ServerInfo(self, request, context):
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details("busy")
        context.set_trailing_metadata([("retry-after-s", "2")])
        return pb.ServerInfoResponse()

    async def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def Watch(self, request, context):
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def _generate(tokens: int, ms: int = 0, text: str = "p") -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=tokens, seed=ms))


async def _answers(address: str) -> list:
    """What a client sees of each kind of call at `address`."""
    out = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub, health = pb_grpc.AdapterServeStub(channel), health_pb2_grpc.HealthStub(channel)
        call = stub.Generate(_generate(4), metadata=[("authorization", "Bearer k")])
        out.append([(list(r.token_ids), r.text, r.request_id) async for r in call])
        out.append((await call.code(), dict(await call.trailing_metadata()).keys() >= {"served-by"}))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ServerInfo(pb.ServerInfoRequest())
        out.append((refused.value.code(), refused.value.details(), tuple(refused.value.trailing_metadata())))
        undecodable = channel.unary_stream("/adapterserve.v1.AdapterServe/Generate")
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            [r async for r in undecodable(b"\xff\xff\xff")]
        out.append((bad.value.code(), bad.value.details()))

        async def files():
            for size in (1, 1000, 3):
                yield pb.UploadAdapterRequest(chunk=pb.FileChunk(path="a", data=b"x" * size))

        out.append((await stub.UploadAdapter(files())).name)
        out.append((await health.Check(health_pb2.HealthCheckRequest())).status)
        out.append([r.status async for r in health.Watch(health_pb2.HealthCheckRequest())])
        with pytest.raises(grpc.aio.AioRpcError) as listed:
            await health.List(health_pb2.HealthListRequest())
        out.append(listed.value.code())
    return out


def test_calls_through_front_workers_get_what_the_replica_s_own_loop_gives():
    async def both():
        own_port, front_port = free_port(), free_port()
        servicer = Servicer()
        own = await start_listener(servicer, HOST, own_port)
        front = FrontPool(servicer, HOST, front_port, 2)
        await front.start()
        try:
            return await _answers(f"{HOST}:{own_port}"), await _answers(f"{HOST}:{front_port}")
        finally:
            await own.stop(0)
            await front.stop(0)

    own, front = asyncio.run(both())
    assert front == own
    assert front[0] == [([i], "Bearer k", "p") for i in range(4)]
    assert front[2] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("retry-after-s", "2"),))
    assert front[3][0] == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in front[3][1]
    assert front[4] == "1,1000,3"


@asynccontextmanager
async def _running(port: int, workers: int, servicer: Servicer | None = None,
                   wait_s: float = 0.0) -> AsyncIterator[FrontPool]:
    """A started pool on `port`, stopped (no grace) on the way out."""
    pool = FrontPool(servicer or Servicer(), HOST, port, workers)
    await pool.start(wait_s)
    try:
        yield pool
    finally:
        await pool.stop(0)


async def _stream(address: str, tokens: int, ms: int, text: str = "p") -> list[int]:
    async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        return [r.token_ids[0] async for r in pb_grpc.AdapterServeStub(channel).Generate(_generate(tokens, ms, text))]


def test_a_cancelled_call_is_cancelled_in_the_replica_and_the_others_go_on():
    async def run():
        servicer, port = Servicer(), free_port()
        async with _running(port, 2, servicer):
            others = [asyncio.ensure_future(_stream(f"{HOST}:{port}", 20, 5)) for _ in range(4)]
            async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
                call = pb_grpc.AdapterServeStub(channel).Generate(_generate(1000, 5))
                assert (await call.read()).token_ids == [0]
                call.cancel()
            deadline = time.monotonic() + 30
            while servicer.cancelled < 1:
                assert time.monotonic() < deadline, "the replica's handler was never cancelled"
                await asyncio.sleep(0.05)
            return await asyncio.gather(*others)

    assert asyncio.run(run()) == [list(range(20))] * 4


def test_a_killed_worker_is_replaced_and_the_other_s_calls_go_on():
    async def run():
        port = free_port()
        async with _running(port, 2) as pool:
            streams = [asyncio.ensure_future(_stream(f"{HOST}:{port}", 40, 10, str(i))) for i in range(8)]
            await asyncio.sleep(0.2)
            victim = pool.pids[0]
            os.kill(victim, signal.SIGKILL)
            ended = await asyncio.gather(*streams, return_exceptions=True)
            lost = [e for e in ended if isinstance(e, BaseException)]
            assert all(e.code() is grpc.StatusCode.UNAVAILABLE for e in lost), lost
            assert [e for e in ended if not isinstance(e, BaseException)] == [list(range(40))] * (8 - len(lost))
            deadline = time.monotonic() + 60
            while len(pool.pids) < 2 or victim in pool.pids:
                assert time.monotonic() < deadline, "the killed worker was not replaced"
                await asyncio.sleep(0.1)
            return await asyncio.gather(*(_stream(f"{HOST}:{port}", 3, 0) for _ in range(8)))

    assert asyncio.run(run()) == [[0, 1, 2]] * 8


def test_a_held_call_finishes_when_the_pool_stops_within_its_grace():
    async def run():
        port = free_port()
        pool = FrontPool(Servicer(), HOST, port, 1)
        await pool.start()
        held = asyncio.ensure_future(_stream(f"{HOST}:{port}", 30, 20))
        await asyncio.sleep(0.3)
        await pool.stop(30.0)
        assert all(p.poll() is not None for p in (w.process for w in pool._workers.values()))
        return await held

    assert asyncio.run(run()) == list(range(30))


def test_a_second_pool_on_the_port_is_refused_until_the_first_stops():
    async def run():
        port = free_port()
        async with _running(port, 1):
            with pytest.raises(PortInUse, match=rf"^replica_grpc\.port {port} on {HOST} cannot be bound \(another "):
                await FrontPool(Servicer(), HOST, port, 1).start(wait_s=0.3)
        async with _running(port, 1):
            assert await _stream(f"{HOST}:{port}", 2, 0) == [0, 1]

    asyncio.run(run())


def _sharing_listener(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((HOST, port))
    sock.listen()
    return sock


@pytest.mark.skipif(not port_audit.supported(), reason="the listener audit reads Linux's /proc/net")
def test_another_process_sharing_the_port_is_refused_at_start_and_reported_after(caplog):
    async def run():
        port = free_port()
        with _sharing_listener(port):
            with pytest.raises(PortInUse, match=rf"^replica_grpc\.port {port} on {HOST} is shared with another "
                                                rf"process .*{HOST}:{port}"):
                await FrontPool(Servicer(), HOST, port, 2).start()
        async with _running(port, 2) as pool:
            pool.check()
            assert "another process listens" not in caplog.text
            with _sharing_listener(port), caplog.at_level(logging.ERROR, "adapterserve.server"):
                pool.check()
                pool.check()  # once per change

    asyncio.run(run())
    assert caplog.text.count("another process listens there with port sharing") == 1


@pytest.mark.skipif(not port_audit.supported(), reason="the listener audit reads Linux's /proc/net")
def test_a_predecessor_s_listener_that_leaves_within_the_wait_lets_the_pool_start():
    async def run():
        port = free_port()
        leaving = _sharing_listener(port)  # as a replaced replica's worker, on its way out
        asyncio.get_running_loop().call_later(0.5, leaving.close)
        async with _running(port, 1, wait_s=30):
            return await _stream(f"{HOST}:{port}", 2, 0)

    assert asyncio.run(run()) == [0, 1]


def test_the_workers_leave_when_the_replica_s_end_of_the_link_goes():
    async def run():
        port = free_port()
        pool = FrontPool(Servicer(), HOST, port, 2)
        await pool.start()
        processes = [w.process for w in pool._workers.values()]
        pool._stopping = True  # no replacement: as when the replica itself is gone
        for worker in pool._workers.values():
            worker.link.close()
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in processes):
            assert time.monotonic() < deadline, "a worker outlived its link"
            await asyncio.sleep(0.05)
        await pool.stop(0)

    asyncio.run(run())


def test_the_listener_audit_reads_this_host_s_listeners():
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        port = sock.getsockname()[1]
        if not port_audit.supported():
            pytest.skip("no /proc/net here")
        assert port_audit.foreign(HOST, port, []) == [f"{HOST}:{port}"]
        assert port_audit.foreign("0.0.0.0", port, []) == [f"{HOST}:{port}"]
        assert port_audit.foreign("127.0.0.2", port, []) == []  # another address: no overlap
        assert port_audit.foreign(HOST, port, [os.getpid()]) == []


def test_a_worker_imports_neither_torch_nor_ray():
    import subprocess
    import sys

    code = ("import sys, adapterserve.server.front.worker; "
            "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
