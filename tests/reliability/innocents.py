"""Innocent streams for the chaos suite: greedy generations whose tokens must not change
whatever else the server is put through (over gRPC, or SSE over HTTP)."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import grpc
import requests

from tests.helpers.live_server import ALICE
from tests.reliability.hostile_corpus import BASE

MAX_TOKENS = 24


@dataclass(frozen=True)
class Innocent:
    via: str  # "grpc" or "http" (SSE)
    adapter: str | None  # None = the base model
    prompt: str


INNOCENTS = (
    Innocent("grpc", None, "The lighthouse keeper"),
    Innocent("grpc", "sql", "To make bread you need"),
    Innocent("http", "chat", "A server that answers many questions"),
)


class Busy(Exception):
    """The server asked to retry later before the first token (its queue was full)."""


# --- innocent streams -------------------------------------------------------------------

def stream_grpc(server, innocent: Innocent, started: threading.Event) -> tuple[list[int], str]:
    from adapterserve.clients.client import Client
    from adapterserve.clients.types import ClientError

    tokens, text = [], ""
    with Client(server.grpc, api_key=ALICE, timeout=120) as client:
        try:
            for chunk in client.stream(innocent.prompt, adapter=innocent.adapter, max_tokens=MAX_TOKENS,
                                       temperature=0.0, ignore_eos=True):
                tokens += chunk.token_ids
                text += chunk.text
                started.set()
        except ClientError as error:
            if error.code is grpc.StatusCode.RESOURCE_EXHAUSTED and not tokens:
                raise Busy from error
            raise
    return tokens, text


def stream_http(server, innocent: Innocent, started: threading.Event) -> tuple[list[int], str]:
    body = {"model": innocent.adapter or BASE, "prompt": innocent.prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    with requests.post(f"{server.http}/v1/completions", json=body, stream=True, timeout=120,
                       headers={"Authorization": f"Bearer {ALICE}"}) as reply:
        if reply.status_code == 429:
            raise Busy(reply.text)
        assert reply.status_code == 200, reply.text
        tokens, text = [], ""
        for line in reply.iter_lines(decode_unicode=True):
            if not line or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            tokens += event["choices"][0]["token_ids"]
            text += event["choices"][0]["text"]
            started.set()
    return tokens, text


def stream(server, innocent: Innocent, started: threading.Event | None = None) -> tuple[list[int], str]:
    run = stream_grpc if innocent.via == "grpc" else stream_http
    for _ in range(60):
        try:
            return run(server, innocent, started or threading.Event())
        except Busy:
            time.sleep(0.5)  # the previous tests' work drains
    raise AssertionError(f"{innocent} was never admitted")
