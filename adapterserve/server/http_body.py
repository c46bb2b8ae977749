"""Reading an HTTP request's JSON body within limits.

    body = await read_json(request, max_bytes=8 << 20)

- Size: a Content-Length over `max_bytes` is refused before anything is read; a body
  without one (chunked) is refused as soon as it passes `max_bytes`, so no more than
  `max_bytes` is ever held (RequestTooLarge: HTTP 413).
- Encoding: the body must be UTF-8 (RequestError naming the byte offset).
- Nesting: arrays and objects nested deeper than MAX_DEPTH are refused before the
  parser runs (it recurses once per level).
- Syntax: malformed JSON, and NaN or Infinity (not JSON), are refused with the
  parser's position.
"""
from __future__ import annotations

import asyncio
import json
import re
from itertools import accumulate
from typing import Any

from starlette.requests import ClientDisconnect, Request

from adapterserve.errors import RequestError, RequestTooLarge

MAX_DEPTH = 64
_THREAD_BYTES = 64 << 10  # bodies larger than this are checked and parsed off the event loop
# A JSON string, or an unterminated one up to the end (one pass: no retry from every quote).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_SLICE = 1 << 16


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request's JSON body; RequestTooLarge or RequestError saying what is wrong."""
    body = await read_body(request, max_bytes)
    if len(body) > _THREAD_BYTES:
        return await asyncio.to_thread(parse_json, body)
    return parse_json(body)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refused (413) as soon as it is known to be over `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise RequestError(f"Content-Length must be a number of bytes, got {declared[:40]!r}")
        if len(declared) > 18 or int(declared) > max_bytes:
            raise _too_large(max_bytes, f"the request body has {declared[:40]} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > max_bytes:
                raise _too_large(max_bytes, "the request body is larger")
            body += chunk
    except ClientDisconnect as exc:
        raise RequestError("the client went away before sending the whole request body") from exc
    return body  # a bytearray: no second copy


def parse_json(body: bytes) -> Any:
    """Decode and parse a whole body; RequestError for non-UTF-8, too deep, or malformed JSON."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = bytes(body[exc.start:exc.start + 1])
        message = f"the request body is not UTF-8: byte {exc.start} is {bad!r}; send JSON encoded as UTF-8"
        raise RequestError(message) from None
    if not text.strip():
        raise RequestError("the request body is empty: send a JSON object")
    check_depth(body)
    try:
        return json.loads(text, parse_constant=_not_json)
    except RequestError:
        raise
    except json.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, "
                           f"column {exc.colno}, character {exc.pos})") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise RequestError(f"the request body is not valid JSON: {exc}") from None


def check_depth(body: bytes, max_depth: int = MAX_DEPTH) -> None:
    """RequestError if arrays/objects nest deeper than max_depth; brackets inside strings
    do not count. One pass over the body, with an early exit."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return  # nearly every body: too few brackets to nest that deep
    steps = memoryview(_STRING.sub(b"", body).translate(_STEPS, _NOT_BRACKETS)).cast("b")
    depth = 0
    for start in range(0, len(steps), _SLICE):
        running = list(accumulate(steps[start:start + _SLICE], initial=depth))
        if max(running) > max_depth:
            raise RequestError(f"the request body nests arrays/objects more than {max_depth} levels deep")
        depth = running[-1]


def _not_json(constant: str) -> Any:
    raise RequestError(f"the request body is not valid JSON: {constant} is not a JSON number")


def _too_large(max_bytes: int, what: str) -> RequestTooLarge:
    return RequestTooLarge(f"{what}; this server takes at most {max_bytes} bytes (max_request_bytes)")
