"""Hostile requests over HTTP and gRPC while innocent streams run (the live test server).

Innocent greedy streams (the base model and two adapters, over gRPC and SSE) are run
alone first; then they stream again and again while the corpora of hostile_corpus.py
(completions, gRPC) and hostile_openai_corpus.py (every other HTTP route) arrive, plus
bodies over max_request_bytes (declared, and chunked without a length). Every hostile
request must get its 4xx or its gRPC status (never OK, UNKNOWN or INTERNAL) with a message
naming the problem, and every innocent stream must end token-identical to its run alone.
"""
from __future__ import annotations

import json
import select
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc
import pytest
import requests

from adapterserve.server.settings import DEFAULTS
from tests.helpers.live_server import ALICE
from tests.reliability.hostile_corpus import BASE, GRPC_CASES, MAX_MODEL_LEN, VOCAB
from tests.reliability.hostile_corpus import HTTP_CASES as COMPLETION_CASES
from tests.reliability.hostile_openai_corpus import ROUTE_CASES
from tests.reliability.innocents import INNOCENTS, Innocent, stream

HTTP_CASES = COMPLETION_CASES + ROUTE_CASES
MAX_REQUEST_BYTES = DEFAULTS["max_request_bytes"]
OVERSIZED = ("declared over max_request_bytes", "chunked over max_request_bytes")
NEVER = {grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
LEAKS = ("Traceback", 'File "', "internal server error")


@dataclass(repr=False)  # pytest shows each failing case's own answer, not every answer
class Storm:
    http: dict[str, tuple[int, str]] = field(default_factory=dict)  # case name -> (status, message)
    grpc: dict[str, tuple[grpc.StatusCode, str]] = field(default_factory=dict)  # case name -> (code, message)
    alone: dict[Innocent, tuple[list[int], str]] = field(default_factory=dict)
    during: dict[Innocent, list[tuple[list[int], str]]] = field(default_factory=dict)
    failed: dict[Innocent, str] = field(default_factory=dict)  # an innocent stream's error


# --- hostile requests -------------------------------------------------------------------

def _http_answer(reply: requests.Response) -> tuple[int, str]:
    try:
        return reply.status_code, reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return reply.status_code, reply.text


def _send_http(server, case) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **case.headers}
    reply = requests.request(case.method, f"{server.http}{case.path}", data=case.body, headers=headers, timeout=120)
    return _http_answer(reply)


def _send_grpc(channel: grpc.Channel, case) -> tuple[grpc.StatusCode, str]:
    method = f"/adapterserve.v1.AdapterServe/{case.method}"
    metadata = (("authorization", f"Bearer {case.api_key}"),)
    try:
        if case.method == "Generate":  # identity (de)serializers: the bytes go as they are
            for _ in channel.unary_stream(method)(case.request, metadata=metadata, timeout=120):
                pass
        else:
            channel.unary_unary(method)(case.request, metadata=metadata, timeout=120)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def _send_oversized(server, chunked: bool) -> tuple[int, str]:
    """More than max_request_bytes on a raw socket: declared in Content-Length (no body
    sent), or chunked without a length, sent until the server answers."""
    url = urlsplit(server.http)
    head = ["POST /v1/completions HTTP/1.1", f"Host: {url.netloc}", f"Authorization: Bearer {ALICE}",
            "Content-Type: application/json", "Connection: close",
            "Transfer-Encoding: chunked" if chunked else f"Content-Length: {MAX_REQUEST_BYTES + 1}"]
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        if chunked:
            _send_chunks_until_answered(sock, limit=3 * MAX_REQUEST_BYTES)
        return _read_http_answer(sock)


def _send_chunks_until_answered(sock: socket.socket, limit: int) -> None:
    piece = b" " * (64 << 10)  # JSON whitespace, 64 KiB a chunk
    frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    sent = 0
    try:
        while sent < limit and not select.select([sock], [], [], 0)[0]:
            sock.sendall(frame)
            sent += len(piece)
        sock.sendall(b"0\r\n\r\n")
    except OSError:  # the server answered and closed while we were sending
        pass


def _read_http_answer(sock: socket.socket) -> tuple[int, str]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        more = sock.recv(65536)
        if not more:
            break
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return status, body.decode(errors="replace")


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30  # unknown: read until the server closes


def _http_storm(server) -> dict[str, tuple[int, str]]:
    answers = {case.name: _send_http(server, case) for case in HTTP_CASES}
    for name, chunked in zip(OVERSIZED, (False, True)):
        answers[name] = _send_oversized(server, chunked)
    return answers


def _grpc_storm(server) -> dict[str, tuple[grpc.StatusCode, str]]:
    with grpc.insecure_channel(server.grpc, options=[("grpc.max_send_message_length", 16 << 20)]) as channel:
        return {case.name: _send_grpc(channel, case) for case in GRPC_CASES}


# --- the storm --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def storm(server, uploaded) -> Storm:
    from adapterserve.clients.client import Client

    with Client(server.grpc, api_key=ALICE, timeout=60) as client:
        info = client.server_info()
    assert (info.backbone_id, info.vocab_size, info.max_model_len) == (BASE, VOCAB, MAX_MODEL_LEN)
    result = Storm(alone={i: stream(server, i) for i in INNOCENTS})
    assert len({tuple(t) for t, _ in result.alone.values()}) == len(INNOCENTS), "adapters must change the tokens"
    result.during = {i: [] for i in INNOCENTS}
    started = {i: threading.Event() for i in INNOCENTS}
    over = threading.Event()

    def keep_streaming(innocent: Innocent) -> None:
        try:
            while not over.is_set():
                result.during[innocent].append(stream(server, innocent, started[innocent]))
        except Exception as error:  # reported by the innocent streams' test
            result.failed[innocent] = repr(error)
            started[innocent].set()

    with ThreadPoolExecutor(len(INNOCENTS) + 2) as pool:
        streams = [pool.submit(keep_streaming, i) for i in INNOCENTS]
        for innocent, event in started.items():
            assert event.wait(120), f"{innocent} sent no token"
        http_answers, grpc_answers = pool.submit(_http_storm, server), pool.submit(_grpc_storm, server)
        try:
            result.http, result.grpc = http_answers.result(), grpc_answers.result()
        finally:
            over.set()
        for done in streams:
            done.result()
    return result


def _check_message(message: str, says: str) -> None:
    assert says in message, message
    assert not any(leak in message for leak in LEAKS), message


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.name for c in HTTP_CASES])
def test_hostile_http_request_gets_a_4xx_naming_the_problem(storm, case):
    status, message = storm.http[case.name]
    assert status == case.status, message
    _check_message(message, case.says)


@pytest.mark.parametrize("name", OVERSIZED)
def test_a_body_over_max_request_bytes_gets_413(storm, name):
    status, message = storm.http[name]
    assert status == 413, message
    _check_message(message, f"at most {MAX_REQUEST_BYTES} bytes")


@pytest.mark.parametrize("case", GRPC_CASES, ids=[c.name for c in GRPC_CASES])
def test_hostile_grpc_request_gets_a_precise_status(storm, case):
    code, message = storm.grpc[case.name]
    assert code not in NEVER, (code, message)
    assert code == case.code, message
    _check_message(message, case.says)


def test_innocent_streams_end_token_identical_to_their_run_alone(storm):
    assert not storm.failed
    for innocent, runs in storm.during.items():
        assert runs, innocent
        for run in runs:
            assert run == storm.alone[innocent], innocent
