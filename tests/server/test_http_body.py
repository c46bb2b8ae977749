"""read_json: size caps before and while reading, UTF-8, nesting depth, JSON syntax.

Requests are real Starlette requests fed through the ASGI receive channel, chunk by
chunk, the way Serve's HTTP proxy delivers a body."""
from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from adapterserve.errors import RequestError, RequestTooLarge
from adapterserve.server.http_body import MAX_DEPTH, parse_json, read_json
from adapterserve.server.status import http_status

CAP = 1000


class Body:
    """An ASGI receive channel sending `chunks` (then, if endless, the last one for ever)."""

    def __init__(self, chunks: list[bytes], endless: bool = False, disconnect: bool = False):
        self.chunks, self.endless, self.disconnect, self.pulled = chunks, endless, disconnect, 0

    async def __call__(self) -> dict:
        self.pulled += 1
        if self.pulled <= len(self.chunks) or self.endless:
            chunk = self.chunks[min(self.pulled, len(self.chunks)) - 1]
            more = self.endless or self.pulled < len(self.chunks) or self.disconnect
            return {"type": "http.request", "body": chunk, "more_body": more}
        return {"type": "http.disconnect"}


def _request(body: Body, content_length: int | str | None = None) -> Request:
    headers = [(b"content-type", b"application/json")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode("latin-1")))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers, "query_string": b""}
    return Request(scope, body)


def _read(body: Body, content_length: int | str | None = None, cap: int = CAP):
    return asyncio.run(read_json(_request(body, content_length), cap))


def test_a_body_in_chunks_is_parsed():
    data = json.dumps({"model": "m", "prompt": "hello"}).encode()
    assert _read(Body([data[:5], data[5:9], data[9:]]), len(data)) == {"model": "m", "prompt": "hello"}


def test_a_body_of_exactly_the_cap_is_taken():
    data = b'"' + b"x" * (CAP - 2) + b'"'
    assert _read(Body([data]), len(data)) == "x" * (CAP - 2)


def test_a_declared_length_over_the_cap_is_refused_before_reading():
    body = Body([b"{}"], endless=True)
    with pytest.raises(RequestTooLarge) as caught:
        _read(body, CAP + 1)
    assert body.pulled == 0
    assert str(caught.value) == f"the request body has {CAP + 1} bytes; this server takes at most {CAP} bytes " \
                                "(max_request_bytes)"
    assert http_status(caught.value) == 413


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_cap():
    body = Body([b"[" + b"1," * 49], endless=True)  # 99 bytes a chunk, no end, no length
    with pytest.raises(RequestTooLarge, match=f"at most {CAP} bytes"):
        _read(body)
    assert body.pulled == CAP // 99 + 1  # the chunk that would pass the cap is never kept


def test_a_body_longer_than_its_declared_length_is_still_capped():
    body = Body([b"x" * 400], endless=True)
    with pytest.raises(RequestTooLarge):
        _read(body, 10)


def test_a_client_leaving_mid_body_is_a_request_error():
    with pytest.raises(RequestError, match="went away"):
        _read(Body([b'{"a": '], disconnect=True))


@pytest.mark.parametrize("declared", ["12x", "-1", "\u00b2", " 5"])
def test_a_malformed_content_length_is_refused(declared):
    with pytest.raises(RequestError, match="Content-Length must be a number of bytes") as caught:
        _read(Body([b"{}"]), declared)
    assert not isinstance(caught.value, RequestTooLarge)


def test_a_content_length_of_many_digits_is_too_large():
    with pytest.raises(RequestTooLarge, match="has 9999999999999999999999999999999999999999 bytes"):
        _read(Body([b"{}"]), "9" * 5000)


def test_a_large_body_is_parsed_off_the_event_loop_the_same():
    data = json.dumps({"prompt": list(range(40_000))}).encode()  # over the in-loop size
    assert _read(Body([data[i:i + 4096] for i in range(0, len(data), 4096)]), cap=len(data)) == json.loads(data)


@pytest.mark.parametrize("data, message", [
    (b"", "the request body is empty: send a JSON object"),
    (b" \n ", "the request body is empty"),
    (b'{"a": "\xe9"}', "the request body is not UTF-8: byte 7 is b'\\xe9'"),
    ('{"a": 1}'.encode("utf-16"), "the request body is not UTF-8: byte 0"),
    (b'{"a": [1, 2,}', "the request body is not valid JSON: Expecting value (line 1, column 13, character 12)"),
    (b'{"a": 1}\n{"b"', "the request body is not valid JSON: Extra data (line 2, column 1, character 9)"),
    (b'{"t": NaN}', "the request body is not valid JSON: NaN is not a JSON number"),
    (b'{"t": -Infinity}', "the request body is not valid JSON: -Infinity is not a JSON number"),
    (b'{"t": ' + b"9" * 5000 + b"}", "the request body is not valid JSON: Exceeds the limit (4300 digits)"),
    (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "the request body nests arrays/objects more than 64 levels"),
    (b'{"a":' * 100_000, "the request body nests arrays/objects more than 64 levels"),
    (b"[" * (8 << 20), "the request body nests arrays/objects more than 64 levels"),
    (b'"open' + b"[" * 5000, "the request body is not valid JSON: Unterminated string starting at"),
])
def test_bad_bodies_are_request_errors(data, message):
    with pytest.raises(RequestError) as caught:
        parse_json(data)
    assert str(caught.value).startswith(message), str(caught.value)


def test_nesting_up_to_the_limit_is_parsed_and_brackets_in_strings_do_not_count():
    deepest = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert parse_json(deepest) == json.loads(deepest)
    in_strings = b'{"prompt": "' + b"[{" * 5000 + b'", "stop": ["\\"[[[", "]]"]}'
    assert parse_json(in_strings)["prompt"] == "[{" * 5000
    many_shallow = b"[" + b"[[]]," * 10_000 + b"[]]"
    assert len(parse_json(many_shallow)) == 10_001
