"""OpenAI-compatible bodies and error mapping (no Ray needed)."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from ray.serve.exceptions import BackPressureError

from adapterserve.adapters_store.keys import ApiKeys
from adapterserve.errors import AccessDenied, AdapterNotFound, AdapterTooLarge, RequestError, Unauthenticated
from adapterserve.server.auth import http_tenant, key_from_pairs
from adapterserve.server.openai_http import completion_body, parse_completion, sse_events
from adapterserve.server.status import http_status, status_of


def test_base_model_id_means_no_adapter():
    call = parse_completion({"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0}, "tiny")
    assert call.adapter is None and call.prompt == "hi"
    assert (call.sampling.max_tokens, call.sampling.temperature) == (3, 0.0)
    assert parse_completion({"model": "sql@2", "prompt": [[1, 2, 3]]}, "tiny").adapter == "sql@2"
    assert parse_completion({"model": "sql", "prompt": [1, 2]}, "tiny").prompt == [1, 2]


@pytest.mark.parametrize("body", [
    [], {"prompt": "hi"}, {"model": "m"}, {"model": "m", "prompt": ["a", "b"]}, {"model": "m", "prompt": "x", "n": 2},
    {"model": "m", "prompt": "x", "echo": True}, {"model": "m", "prompt": "x", "max_tokens": 0},
    {"model": "m", "prompt": [1, "a"]},
])
def test_bad_bodies_are_request_errors(body):
    with pytest.raises(RequestError):
        parse_completion(body, "tiny")


CHUNKS = [
    {"token_ids": [5, 6], "text": "ab", "finish_reason": None, "prompt_tokens": 4},
    {"token_ids": [7], "text": "c", "finish_reason": "length"},
]


def test_completion_body_puts_chunks_together():
    call = parse_completion({"model": "m", "prompt": "x", "return_token_ids": True}, "tiny")
    body = completion_body(call, CHUNKS)
    assert body["choices"][0] == {"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length",
                                  "token_ids": [5, 6, 7]}
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_sse_events_end_with_done_and_report_errors_in_band():
    call = parse_completion({"model": "m", "prompt": "x", "stream": True,
                             "stream_options": {"include_usage": True}}, "tiny")

    async def chunks(fail: bool):
        yield CHUNKS[0]
        if fail:
            raise AdapterNotFound("gone")
        yield CHUNKS[1]

    async def collect(fail: bool):
        return [e async for e in sse_events(call, chunks(fail))]

    events = asyncio.run(collect(False))
    assert events[-1] == "data: [DONE]\n\n"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3
    assert json.loads(events[1][6:])["choices"][0]["finish_reason"] == "length"
    failed = asyncio.run(collect(True))
    assert json.loads(failed[-1][6:])["error"]["code"] == 404


@pytest.mark.parametrize("exc, code, status", [
    (Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED, 401),
    (AccessDenied("x"), grpc.StatusCode.PERMISSION_DENIED, 403),
    (AdapterNotFound("x"), grpc.StatusCode.NOT_FOUND, 404),
    (AdapterTooLarge("x"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (RequestError("x"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (BackPressureError(num_queued_requests=2, max_queued_requests=2), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (ZeroDivisionError(), grpc.StatusCode.INTERNAL, 500),
])
def test_errors_map_to_status_codes(exc, code, status):
    assert (status_of(exc), http_status(exc)) == (code, status)


def test_api_keys_from_headers():
    assert key_from_pairs([("Authorization", "Bearer k1")]) == "k1"
    assert key_from_pairs([("x-api-key", "k2")]) == "k2"
    assert key_from_pairs([("authorization", "Basic abc")]) is None
    keys = ApiKeys.from_mapping({"k1": "acme"})
    assert http_tenant(keys, {"authorization": "Bearer k1"}) == "acme"
    with pytest.raises(Unauthenticated):
        http_tenant(keys, {})
    assert http_tenant(ApiKeys.open(), {}) is None
