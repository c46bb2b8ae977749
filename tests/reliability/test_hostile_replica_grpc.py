"""The replica's own gRPC listener (setting `replica_grpc`, server/replica_grpc.py), attacked.

Settings: every bad value (wrong types, out of range, a port with two tiers or several
replicas) is refused before anything starts, naming the setting; given to `adapterserve
serve`, a port already in use (by anything, or by another server's listener) stops the
command with one line and exit status 2, no Ray started.

Requests over the listener of a live direct application (on the session's Serve), served by
the replica's loop and by front worker processes (`replica_grpc.workers`, server/front/): the hostile
gRPC corpus gets the very status and message it gets through Serve's replica port while
innocent streams over the listener end token-identical to their runs alone; a message over
the size cap is refused as Serve's port refuses it; a stream cancelled mid-way is aborted in
the engine and the others lose nothing; health answers on the listener; and streams held
when Serve stops the replica end whole before the listener closes.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapterserve.server import serve_env
from adapterserve.server.app import build_app
from adapterserve.server.ports import free_port
from tests.helpers.direct_app import direct_app
from tests.helpers.live_server import ALICE
from tests.reliability.hostile_corpus import GRPC_CASES
from tests.reliability.innocents import INNOCENTS, stream
from tests.reliability.test_hostile_requests import LEAKS, NEVER, _send_grpc

MODEL = Path(__file__).parents[1] / "fixtures" / "adapterhub" / "tiny-llama"
GRPC_INNOCENTS = [i for i in INNOCENTS if i.via == "grpc"]
PROMPT = "To make bread you need"


def _build(**overrides) -> None:
    build_app({"model": str(MODEL), "encoder": False, "direct": True, **overrides})


# --- settings ---------------------------------------------------------------------------

NOT_A_MAPPING = [5, "50051", None, [], [50051], True, b"port"]
BAD_PORTS = ["50051", "", True, False, 0, -1, 65536, 10**9, 1.5, 50051.0, math.nan, math.inf, [], {}, [50051]]
BAD_HOSTS = ["", None, 5, 0.0, True, [], {}, " 127.0.0.1", "127.0.0.1\n", b"127.0.0.1", "[::]"]
BAD_WORKERS = ["4", "", None, True, False, -1, 65, 10**9, 1.5, 4.0, math.nan, [], {}, [4]]


@pytest.mark.parametrize("value", NOT_A_MAPPING, ids=[repr(v) for v in NOT_A_MAPPING])
def test_a_listener_setting_that_is_no_mapping_is_refused(value):
    with pytest.raises(ValueError, match=r"^replica_grpc must be a mapping") as refused:
        _build(replica_grpc=value)
    assert str(refused.value).endswith(f"got {value!r}")


@pytest.mark.parametrize("port", BAD_PORTS, ids=[repr(v) for v in BAD_PORTS])
def test_a_bad_port_is_refused_naming_it(port):
    with pytest.raises(ValueError, match=r"^replica_grpc\.port must be a port number \(1-65535\) or null") as refused:
        _build(replica_grpc={"port": port})
    assert str(refused.value).endswith(f"got {port!r}")


@pytest.mark.parametrize("host", BAD_HOSTS, ids=[repr(v) for v in BAD_HOSTS])
def test_a_bad_host_is_refused_naming_it(host):
    with pytest.raises(ValueError, match=r"^replica_grpc\.host must be an address") as refused:
        _build(replica_grpc={"port": 50061, "host": host})
    assert str(refused.value).endswith(f"got {host!r}")


@pytest.mark.parametrize("workers", BAD_WORKERS, ids=[repr(v) for v in BAD_WORKERS])
def test_a_bad_worker_count_is_refused_naming_it(workers):
    with pytest.raises(ValueError, match=r"^replica_grpc\.workers must be a whole number from 0") as refused:
        _build(replica_grpc={"port": 50061, "workers": workers})
    assert repr(workers) in str(refused.value)


def test_an_unknown_listener_key_is_refused():
    with pytest.raises(ValueError, match=r"unknown config\.replica_grpc key 'prot'"):
        _build(replica_grpc={"prot": 50061})


@pytest.mark.parametrize("overrides, says", [
    ({"direct": False}, "the server runs two tiers"),
    ({"direct": "auto", "replica": {"num_replicas": 2}}, "the server runs two tiers"),
    ({"replica": {"num_replicas": 2}}, "set with 2 replicas: one port serves one replica"),
    ({"replica": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}}, "and autoscaling"),
], ids=["two tiers", "auto with two replicas", "two direct replicas", "autoscaling"])
def test_a_port_without_one_direct_replica_to_own_it_is_refused(overrides, says):
    with pytest.raises(ValueError, match=r"^replica_grpc\.port is set") as refused:
        _build(replica_grpc={"port": 50061}, **overrides)
    assert says in str(refused.value)


@pytest.mark.parametrize("listen", [{"port": None}, {"port": 50061}, {"port": 1, "host": "::1"},
                                    {"port": 65535, "host": "0.0.0.0"}, {"port": 50061, "workers": 4},
                                    {"port": 50061, "workers": 0}, {"port": None, "workers": 2}])
def test_good_values_build_the_app(listen):
    _build(replica_grpc=listen)


def _serve(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "adapterserve.clients.cli", "serve", "--model", str(MODEL), "--no-encoder",
         "--store", str(tmp_path / "store"), "--grpc-port", str(free_port()), "--http-port", str(free_port()),
         *flags], capture_output=True, text=True, timeout=300, start_new_session=True, check=False)


def _refused_in_one_line(done: subprocess.CompletedProcess, says: str) -> None:
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and says in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "Ray" not in done.stdout


def test_a_port_in_use_stops_the_server_before_it_starts(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = _serve(tmp_path, "--replica-grpc-port", str(port))
    _refused_in_one_line(done, f"port {port} (--replica-grpc-port) is already in use on 127.0.0.1")


def test_an_out_of_range_port_stops_the_server_before_it_starts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"replica_grpc": {"port": 70000}}))
    done = _serve(tmp_path, "--config", str(tmp_path / "config.json"))
    _refused_in_one_line(done, "replica_grpc.port must be a port number (1-65535) or null (no listener), got 70000")


# --- requests over a live listener ------------------------------------------------------

live = pytest.mark.skipif(not serve_env.haproxy_ingress(), reason="no HAProxy here: no replica port to compare")


@pytest.fixture(scope="module", params=[0, 2], ids=["replica's loop", "2 front workers"])
def app(server, uploaded, request):
    """The listener served by the replica's loop, then by front worker processes (server/front/)."""
    listen = {"port": free_port(), "workers": request.param}
    with direct_app(server, f"own{request.param}", replica_grpc=listen) as running:
        yield SimpleNamespace(**dataclasses.asdict(running), workers=request.param)


def _storm(app) -> tuple[dict, dict, dict, dict]:
    """(the corpus's answers over the listener, over Serve's replica port, the innocents' runs
    alone, their runs during the corpus) over the listener."""
    door = SimpleNamespace(grpc=app.own)
    alone = {i: stream(door, i) for i in GRPC_INNOCENTS}
    during = {i: [] for i in GRPC_INNOCENTS}
    started = {i: threading.Event() for i in GRPC_INNOCENTS}
    over = threading.Event()

    def keep_streaming(innocent) -> None:
        while not over.is_set():
            during[innocent].append(stream(door, innocent, started[innocent]))

    def corpus(address: str) -> dict:
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 16 << 20)]) as channel:
            return {case.name: _send_grpc(channel, case) for case in GRPC_CASES}

    with ThreadPoolExecutor(len(GRPC_INNOCENTS)) as pool:
        streams = [pool.submit(keep_streaming, i) for i in GRPC_INNOCENTS]
        try:
            for innocent, event in started.items():
                assert event.wait(120), f"{innocent} sent no token"
            own, serves = corpus(app.own), corpus(app.replica_port)
        finally:
            over.set()
        for done in streams:
            done.result()
    return own, serves, alone, during


@live
def test_hostile_calls_get_serves_answers_and_innocents_lose_nothing(app):
    own, serves, alone, during = _storm(app)
    for case in GRPC_CASES:
        code, message = own[case.name]
        assert code not in NEVER and code == case.code, (case.name, code, message)
        assert case.says in message and not any(leak in message for leak in LEAKS), (case.name, message)
        assert (code, message) == serves[case.name], case.name
    for innocent, runs in during.items():
        assert runs and all(run == alone[innocent] for run in runs), innocent


@live
def test_a_message_over_the_cap_is_refused_as_on_serves_port(app):
    oversized = b"\x0a" + b"\xff" * (serve_env.MAX_GRPC_MESSAGE_BYTES + 16)

    def send(address: str) -> grpc.StatusCode:
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            call = channel.unary_stream("/adapterserve.v1.AdapterServe/Generate")
            with pytest.raises(grpc.RpcError) as refused:
                list(call(oversized, metadata=(("authorization", f"Bearer {ALICE}"),), timeout=120))
            return refused.value.code()

    assert send(app.own) == send(app.replica_port) == grpc.StatusCode.RESOURCE_EXHAUSTED
    with grpc.insecure_channel(app.own) as channel:  # the listener still serves
        checked = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
    assert checked.status == health_pb2.HealthCheckResponse.SERVING


@live
def test_a_stream_cancelled_mid_way_is_aborted_and_the_others_lose_nothing(app):
    from adapterserve.clients.client import Client

    door = SimpleNamespace(grpc=app.own)
    alone = {i: stream(door, i) for i in GRPC_INNOCENTS}
    with Client(app.own, api_key=ALICE, timeout=120) as client, ThreadPoolExecutor(len(GRPC_INNOCENTS)) as pool:
        before = client.server_info().cancelled_requests
        left = client.stream(PROMPT, adapter="sql", max_tokens=400, temperature=0.0, ignore_eos=True)
        for _, _chunk in zip(range(3), left):
            pass
        started = {i: threading.Event() for i in GRPC_INNOCENTS}
        runs = {i: pool.submit(stream, door, i, started[i]) for i in GRPC_INNOCENTS}
        for event in started.values():
            assert event.wait(120)
        left.close()  # cancels the gRPC call mid-stream, the innocents streaming beside it
        assert {i: run.result() for i, run in runs.items()} == alone
        deadline = time.monotonic() + 120
        while client.server_info().cancelled_requests < before + 1:
            assert time.monotonic() < deadline, "the cancelled stream was never aborted in the engine"
            time.sleep(0.2)


@live
def test_health_answers_on_the_listener(app):
    with grpc.insecure_channel(app.own) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=60).status == \
            health_pb2.HealthCheckResponse.SERVING
        first = next(health.Watch(health_pb2.HealthCheckRequest(), timeout=60))
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=60)
        assert unknown.value.code() is grpc.StatusCode.NOT_FOUND and "no.such.Service" in unknown.value.details()
        with pytest.raises(grpc.RpcError) as listed:
            health.List(health_pb2.HealthListRequest(), timeout=60)
        assert listed.value.code() is grpc.StatusCode.UNIMPLEMENTED


@live
def test_the_listener_shares_its_port_with_no_one(app, tmp_path):
    port = int(app.own.rsplit(":", 1)[1])
    if not app.workers:  # front workers share the port among themselves: test_front.py holds their audit
        with socket.socket() as sharing:  # a server asking for port sharing is refused too
            sharing.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError) as refused:
                sharing.bind(("127.0.0.1", port))
            assert refused.value.errno == errno.EADDRINUSE
    _refused_in_one_line(_serve(tmp_path, "--replica-grpc-port", str(port)),
                         f"port {port} (--replica-grpc-port) is already in use")


LONG_TOKENS = 1000  # with the prompt, near max_model_len: one stream at a time fits the KV cache
HELD = 2  # streams held when Serve stops the replica: one running, one queued in the engine


def _long_stream(address: str, started: threading.Event | None = None) -> list[int]:
    from adapterserve.clients.client import Client

    tokens: list[int] = []
    with Client(address, api_key=ALICE, timeout=300) as client:
        for chunk in client.stream(PROMPT, max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True):
            tokens += chunk.token_ids
            if started is not None:
                started.set()
    return tokens


@live
@pytest.mark.parametrize("workers", [0, 2], ids=["replica's loop", "2 front workers"])
def test_streams_held_when_serve_stops_the_replica_end_whole(server, uploaded, workers):
    from ray import serve

    engine = {**server.config["engine"], "max_num_seqs": 1}  # the held streams run one after another
    listen = {"port": free_port(), "workers": workers}
    with direct_app(server, f"own-stop{workers}", engine=engine, replica_grpc=listen) as stopping:
        alone = _long_stream(stopping.own)
        started = threading.Event()
        with ThreadPoolExecutor(HELD) as pool:
            runs = [pool.submit(_long_stream, stopping.own, started) for _ in range(HELD)]
            assert started.wait(120), "no stream started"
            serve.delete(stopping.name)  # returns once the replica has stopped
            assert [run.result() for run in runs] == [alone] * HELD
    with grpc.insecure_channel(stopping.own) as channel, pytest.raises(grpc.RpcError) as gone:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert gone.value.code() is grpc.StatusCode.UNAVAILABLE
