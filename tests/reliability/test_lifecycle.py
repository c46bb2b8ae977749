"""`adapterserve serve` as an operator runs it, beside the session's live server: two servers
on one host each answer only their own clients; a port already taken is one line and exit
status 2; SIGTERM under load lets every running stream finish, refuses new requests, exits 0
and leaves no process and no port behind; a second signal stops at once; a signal to the
whole process group (Ray's processes get it too) stops at once with status 0 and a line that
says so; kill -9 leaves no process behind either. And replicas that Serve itself stops
(scale-down, upgrades) finish their streams.

One subprocess server at a time (CI has 2 cores): `spare` starts one when a test needs it
and none is running.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from adapterserve.clients.client import Client
from adapterserve.clients.types import ClientError
from adapterserve.server.ports import free_port
from tests.helpers.live_server import ALICE
from tests.reliability.serve_process import ServeProcess, still_listening, unbindable

PROMPT, MAX_TOKENS, STREAMS = "hello there", 900, 8  # the tiny model's context is 1024 tokens
GRACE_S = 60


class Spare:
    """The subprocess server of this module: the running one, or a new one if none runs."""

    def __init__(self, model: Path, root: Path) -> None:
        self.model, self.root, self.count = model, root, 0
        self.current: ServeProcess | None = None

    def get(self) -> ServeProcess:
        if self.current is None or self.current.popen.poll() is not None:
            self.count += 1
            self.current = ServeProcess.start(self.model, self.root / f"serve-{self.count}",
                                              "--grace-period", str(GRACE_S))
        return self.current


@pytest.fixture(scope="module")
def spare(tiny_model, tmp_path_factory):
    spare = Spare(tiny_model, tmp_path_factory.mktemp("lifecycle"))
    yield spare
    if spare.current is not None:
        spare.current.kill_all()


def test_two_servers_side_by_side_each_answer_only_their_own_clients(server, uploaded, lora_dirs, spare):
    other = spare.get()
    with Client(other.grpc, timeout=120) as client:
        assert client.upload(lora_dirs["poem"], name="side-poem").ref == "side-poem@1"
    for _ in range(6):  # fresh connections: the kernel would spread them over servers sharing a port
        with Client(other.grpc, timeout=120) as client:
            assert [a.ref for a in client.list_adapters()] == ["side-poem@1"]
        with Client(server.grpc, api_key=ALICE, timeout=120) as client:
            refs = {a.ref for a in client.list_adapters()}
            assert set(uploaded.values()) <= refs and "side-poem@1" not in refs
    with Client(server.grpc, api_key=ALICE, timeout=120) as client, pytest.raises(ClientError) as unknown:
        client.generate("hello", adapter="side-poem", max_tokens=2)
    assert unknown.value.code is grpc.StatusCode.NOT_FOUND
    with Client(other.grpc, timeout=120) as client:
        assert client.generate("hello", adapter="side-poem", max_tokens=2).adapter == "side-poem@1"


@pytest.mark.parametrize("flag", ["--grpc-port", "--http-port"])
def test_a_taken_port_is_one_line_and_exit_status_2(tiny_model, tmp_path, flag):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        other = "--http-port" if flag == "--grpc-port" else "--grpc-port"
        done = subprocess.run(
            [sys.executable, "-m", "adapterserve.clients.cli", "serve", "--model", str(tiny_model), "--no-encoder",
             "--store", str(tmp_path / "store"), flag, str(port), other, str(free_port())],
            capture_output=True, text=True, timeout=300, start_new_session=True,
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"error: port {port} ({flag}) is already in use on 127.0.0.1: stop what listens there "
                           f"or choose another port with {flag}\n")
    assert "Ray" not in done.stdout


def test_sigterm_under_load_finishes_every_stream_then_leaves_nothing(spare):
    served = spare.get()
    with Client(served.grpc, timeout=120) as client:
        alone = client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0).token_ids
    assert len(alone) == MAX_TOKENS
    ports, streams = served.listening_ports(), _Streams(served.grpc, STREAMS)
    assert {served.grpc_port, served.http_port} < ports
    streams.wait_started()

    served.popen.send_signal(signal.SIGTERM)
    refused, refused_at = _first_refusal(served.grpc)
    assert refused.code is grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details
    with Client(served.grpc, timeout=30) as client:
        assert client.health() == "NOT_SERVING"

    assert streams.join() == [alone] * STREAMS, "every running stream ends with all its tokens"
    assert min(streams.ended_at) > refused_at, "the streams were still running while new requests were refused"
    assert served.popen.wait(GRACE_S + 60) == 0, served.output()[-3000:]
    assert served.left_running(30.0) == set()
    _assert_ports_given_back(served, ports)


def test_a_second_signal_stops_at_once(spare):
    served = spare.get()
    streams = _Streams(served.grpc, STREAMS)
    streams.wait_started()
    served.popen.send_signal(signal.SIGINT)  # Ctrl-C
    served.wait_for("draining", 60)
    served.popen.send_signal(signal.SIGINT)
    second_at = time.monotonic()
    assert served.popen.wait(GRACE_S / 2) == 1, "it does not wait for the running streams"
    outcomes = streams.join()
    # a stream still running at the second signal is cut (UNAVAILABLE); one that had ended by then
    # (a loaded host drains slowly) had all its tokens
    cut = [isinstance(t, ClientError) and t.code is grpc.StatusCode.UNAVAILABLE for t in outcomes]
    done = [isinstance(t, list) and len(t) == MAX_TOKENS and end < second_at
            for t, end in zip(outcomes, streams.ended_at)]
    described = [f"{type(t).__name__} {getattr(t, 'code', '')}" if isinstance(t, BaseException) else f"{len(t)} tokens"
                 for t in outcomes]
    assert all(c or d for c, d in zip(cut, done)) and any(cut), described
    assert served.left_running(30.0) == set()


def test_a_signal_to_the_whole_process_group_stops_at_once(spare):
    """What `timeout`, `kill -TERM -PGID` or a service manager stopping every process of its unit
    sends: Ray's own processes end with the server's signal, so there is nothing to drain."""
    served = spare.get()
    ports = served.listening_ports()
    os.killpg(served.popen.pid, signal.SIGTERM)  # the server leads a session of its own (ServeProcess)
    assert served.popen.wait(60) == 0, served.output()[-3000:]
    assert "Ray's own processes got the stop signal too" in served.output()
    assert "Traceback" not in served.output(), served.output()[-3000:]
    assert served.left_running(30.0) == set()
    _assert_ports_given_back(served, ports)


def test_replicas_that_serve_stops_finish_their_streams(server):
    """What a scale-down or a KubeRay upgrade does to a replica: Serve stops it, and its running
    streams finish first (graceful_shutdown_timeout_s = drain_grace_s)."""
    from ray import serve

    from adapterserve.server import launch

    streams = _Streams(server.grpc, 4, api_key=ALICE)
    streams.wait_started()
    removing = time.monotonic()
    try:
        launch.stop(server.config)  # every replica of the application stops
        assert "adapterserve" not in serve.status().applications
    finally:
        launch.start(server.config, grpc_port=server.grpc_port, http_port=server.http_port)
    assert all(isinstance(t, list) and len(t) == MAX_TOKENS for t in streams.join()), streams.tokens
    assert min(streams.ended_at) > removing, "they were running while the replicas stopped"


def test_kill_9_of_serve_leaves_no_process_behind(spare):
    served = spare.get()
    ports = served.listening_ports()
    assert served.watchdog is not None
    served.popen.kill()
    served.popen.wait()
    assert served.left_running(60.0) == set()
    _assert_ports_given_back(served, ports)


def _assert_ports_given_back(served: ServeProcess, ports: set[int]) -> None:
    """Nothing listens on the server's ports any more, and its gRPC and HTTP ports take a new
    server at once (Serve's own ports may rest in TIME_WAIT: the next server takes other ones)."""
    assert still_listening(ports, timeout_s=10.0) == set()
    assert unbindable("127.0.0.1", {served.grpc_port, served.http_port}) == {}


class _Streams:
    """`count` greedy streams of MAX_TOKENS tokens, each in a thread."""

    def __init__(self, server: str, count: int, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.tokens: list[list[int] | BaseException] = [[] for _ in range(count)]
        self.ended_at = [0.0] * count
        self._started = [threading.Event() for _ in range(count)]
        self._threads = [threading.Thread(target=self._run, args=(server, i)) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def _run(self, server: str, i: int) -> None:
        try:
            with Client(server, api_key=self.api_key, timeout=300) as client:
                for chunk in client.stream(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0):
                    self.tokens[i] += chunk.token_ids
                    self._started[i].set()
        except BaseException as exc:  # reported by join()
            self.tokens[i] = exc
        finally:
            self.ended_at[i] = time.monotonic()
            self._started[i].set()

    def wait_started(self) -> None:
        assert all(started.wait(120) for started in self._started)

    def join(self) -> list[list[int] | BaseException]:
        for thread in self._threads:
            thread.join(300)
        return self.tokens


def _first_refusal(server: str, timeout_s: float = 30.0) -> tuple[ClientError, float]:
    """Send short requests until one is refused; each one taken meanwhile must complete."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with Client(server, timeout=30) as client:
                assert len(client.generate("hi", max_tokens=2, temperature=0.0).token_ids) == 2
        except ClientError as refused:
            return refused, time.monotonic()
        time.sleep(0.05)
    pytest.fail(f"no request was refused {timeout_s} s after SIGTERM")
