"""Every client call has a deadline (default, $ADAPTERSERVE_TIMEOUT, --timeout): against a
server that never answers, the client and the CLI give up with DEADLINE_EXCEEDED."""
from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest

from adapterserve.clients import cli
from adapterserve.clients.client import DEFAULT_TIMEOUT_S, AsyncClient, Client, deadline_s
from adapterserve.clients.types import ClientError


class _Wedged(grpc.GenericRpcHandler):
    """Accepts every call and never answers until released (an engine stuck mid-step)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def service(self, handler_call_details):
        def hang(request, context):
            self.release.wait(60)
            context.abort(grpc.StatusCode.UNAVAILABLE, "released")

        def hang_stream(request, context):
            hang(request, context)
            yield b""

        streaming = handler_call_details.method.endswith("/Generate")
        if streaming:
            return grpc.unary_stream_rpc_method_handler(hang_stream)
        return grpc.unary_unary_rpc_method_handler(hang)


@pytest.fixture
def wedged():
    handler = _Wedged()
    server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    handler.release.set()
    server.stop(None)


def test_the_default_deadline_and_where_it_comes_from(monkeypatch):
    monkeypatch.delenv("ADAPTERSERVE_TIMEOUT", raising=False)
    assert deadline_s() == DEFAULT_TIMEOUT_S == 600
    monkeypatch.setenv("ADAPTERSERVE_TIMEOUT", "2.5")
    assert deadline_s() == 2.5 and Client("127.0.0.1:1").timeout == 2.5
    assert deadline_s(7) == 7, "the caller's own value first"
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv("ADAPTERSERVE_TIMEOUT", bad)
        with pytest.raises(ValueError, match=r"\$ADAPTERSERVE_TIMEOUT must be a number of seconds > 0"):
            deadline_s()
    for bad in (0, -3, True, float("inf")):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            Client("127.0.0.1:1", timeout=bad)


def test_a_wedged_server_ends_each_kind_of_call_at_the_deadline(wedged):
    with Client(wedged, timeout=0.5) as client:
        for call in (client.list_adapters, client.server_info, lambda: client.generate("hello", max_tokens=4)):
            with pytest.raises(ClientError) as stuck:
                call()
            assert stuck.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
            assert stuck.value.details == "no reply within the call's deadline of 0.5 s"


def test_the_async_client_has_the_same_deadline(wedged):
    async def run() -> ClientError:
        async with AsyncClient(wedged, timeout=0.5) as client:
            with pytest.raises(ClientError) as stuck:
                [chunk async for chunk in client.stream("hello", max_tokens=4)]
            return stuck.value

    error = asyncio.run(run())
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_cli_reports_a_deadline_in_one_line(wedged, capsys, monkeypatch):
    assert cli.main(["generate", "hello", "--server", wedged, "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: DEADLINE_EXCEEDED: no reply within the call's deadline of 0.5 s")
    assert "--timeout" in err
    monkeypatch.setenv("ADAPTERSERVE_TIMEOUT", "0.5")
    assert cli.main(["list", "--server", wedged]) == 1
    assert capsys.readouterr().err.startswith("error: DEADLINE_EXCEEDED")


def test_a_bad_timeout_is_a_usage_error(capsys, monkeypatch):
    with pytest.raises(SystemExit) as usage:
        cli.main(["list", "--server", "127.0.0.1:1", "--timeout", "0"])
    assert usage.value.code == 2
    assert "--timeout: the value must be a number of seconds > 0, got '0'" in capsys.readouterr().err
    monkeypatch.setenv("ADAPTERSERVE_TIMEOUT", "forever")
    assert cli.main(["list", "--server", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == "error: $ADAPTERSERVE_TIMEOUT must be a number of seconds > 0, got 'forever'\n"
