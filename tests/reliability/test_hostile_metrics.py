"""Hostile calls to GET /metrics on the HTTP port and to the metrics port, while innocent
streams run: each gets its precise answer (a 4xx, or 503 beyond the port's connections),
none sees more than its view allows, a flood of scrapes is served, and the innocent streams
end token-identical to their run alone. Afterwards both endpoints scrape normally."""
from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
import requests

from adapterserve.server.metrics.listener import HEAD_LIMIT, MAX_CONNECTIONS
from tests.helpers.live_server import ALICE
from tests.helpers.scrape import parse
from tests.reliability.innocents import INNOCENTS, stream

PRIVATE = {"sql", "chat", "poem"}  # alice's adapters


@dataclass(frozen=True)
class RawCase:
    name: str
    request: bytes  # sent as is on a fresh connection to the metrics port
    status: int
    says: str
    hang_up: bool = True  # the client closes its side once sent (else it waits, silent)


RAW_CASES = [
    RawCase("another path", b"GET /debug/vars HTTP/1.1\r\nHost: x\r\n\r\n", 404, "serves GET /metrics"),
    RawCase("path with a prefix", b"GET /metrics/../admin HTTP/1.1\r\n\r\n", 404, "serves GET /metrics"),
    RawCase("post with a body", b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 405, "takes GET"),
    RawCase("delete", b"DELETE /metrics HTTP/1.1\r\n\r\n", 405, "takes GET"),
    RawCase("tls hello", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n", 400, "not an HTTP/1 request"),
    RawCase("http/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, "not an HTTP/1 request"),
    RawCase("no version", b"GET /metrics\r\n\r\n", 400, "not an HTTP/1 request"),
    RawCase("head over the limit", b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * HEAD_LIMIT + b"\r\n\r\n", 431,
            "over 16 KiB"),
    RawCase("head cut short", b"GET /metrics HTTP/1.1\r\nHost:", 408, "no complete request head"),
    RawCase("silent client", b"", 408, "no complete request head", hang_up=False),  # answered after 5 s
]


@dataclass(repr=False)
class Storm:
    raw: dict[str, tuple[int, str]] = field(default_factory=dict)
    http: dict[str, requests.Response] = field(default_factory=dict)
    flood: list[int] = field(default_factory=list)
    crowded: list[int] = field(default_factory=list)  # answers to scrapes past the port's connections
    alone: dict = field(default_factory=dict)
    during: dict = field(default_factory=dict)


def _raw(port_url: str, request: bytes, hang_up: bool = True) -> tuple[int, str]:
    url = urlsplit(port_url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(request)
        if hang_up:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode(errors="replace")


def _crowd(port_url: str) -> list[int]:
    """Hold MAX_CONNECTIONS idle connections open, then scrape: the port answers 503 at once."""
    url = urlsplit(port_url)
    idle = [socket.create_connection((url.hostname, url.port), timeout=60) for _ in range(MAX_CONNECTIONS)]
    try:
        return [_raw(port_url, b"GET /metrics HTTP/1.1\r\n\r\n")[0] for _ in range(3)]
    finally:
        for sock in idle:
            sock.close()


def _http_cases(server) -> dict[str, requests.Response]:
    url = f"{server.http}/metrics"
    return {
        "post": requests.post(url, data=b"{}", timeout=60),
        "a view asked for": requests.get(f"{url}?view=full", headers={"Authorization": f"Bearer {ALICE}"},
                                         timeout=60),
        "a bad api key": requests.get(url, headers={"Authorization": "Bearer not-a-key"}, timeout=60),
    }


@pytest.fixture(scope="module")
def storm(server, uploaded) -> Storm:
    result = Storm(alone={i: stream(server, i) for i in INNOCENTS})
    over = threading.Event()

    def keep_streaming(innocent):
        runs = result.during.setdefault(innocent, [])
        while not over.is_set():
            runs.append(stream(server, innocent))

    with ThreadPoolExecutor(len(INNOCENTS) + 24) as pool:
        streams = [pool.submit(keep_streaming, i) for i in INNOCENTS]
        try:
            raw = {c.name: pool.submit(_raw, server.metrics, c.request, c.hang_up) for c in RAW_CASES}
            flood = [pool.submit(requests.get, f"{server.http}/metrics", timeout=60) for _ in range(16)]
            result.http = _http_cases(server)
            result.raw = {name: f.result() for name, f in raw.items()}
            result.flood = [f.result().status_code for f in flood]
            result.crowded = _crowd(server.metrics)  # alone: the other cases' connections are closed
        finally:
            over.set()
        for done in streams:
            done.result()
    return result


@pytest.mark.parametrize("case", RAW_CASES, ids=[c.name for c in RAW_CASES])
def test_the_metrics_port_answers_a_hostile_request_precisely(storm, case):
    status, body = storm.raw[case.name]
    assert status == case.status, body
    assert case.says in body


def test_the_metrics_port_refuses_connections_past_its_limit_at_once(storm):
    assert storm.crowded == [503, 503, 503]


def test_the_http_route_takes_get_only(storm):
    reply = storm.http["post"]
    assert reply.status_code == 405
    assert "POST /metrics is not allowed" in reply.json()["error"]["message"]


def test_no_key_and_no_parameter_widens_the_public_view(storm):
    for name in ("a view asked for", "a bad api key"):
        reply = storm.http[name]
        assert reply.status_code == 200, reply.text
        found = parse(reply.text)
        assert not found.label_values("adapterserve_requests_total", "adapter") & PRIVATE, name
        assert not [n for n in found.names() if n.startswith("adapterserve_tenant")], name


def test_a_flood_of_scrapes_is_served(storm):
    assert storm.flood == [200] * 16


def test_innocent_streams_end_token_identical_to_their_run_alone(storm):
    for innocent, runs in storm.during.items():
        assert runs, innocent
        assert all(run == storm.alone[innocent] for run in runs), innocent


def test_both_endpoints_scrape_normally_afterwards(storm, server):
    for url in (server.metrics, f"{server.http}/metrics"):
        reply = requests.get(url, timeout=60)
        assert reply.status_code == 200
        assert parse(reply.text).total("adapterserve_requests_total") > 0
