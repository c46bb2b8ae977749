"""OpenAI-compatible /v1/completions bodies and error mapping (no Ray needed)."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from ray.serve.exceptions import BackPressureError

from adapterserve.adapters_store.keys import ApiKeys
from adapterserve.errors import (
    AccessDenied,
    AdapterNotFound,
    AdapterTooLarge,
    RequestError,
    RequestTooLarge,
    Unauthenticated,
)
from adapterserve.server.auth import http_tenant, key_from_pairs
from adapterserve.server.openai_errors import error_body
from adapterserve.server.openai_http import completion_body, parse_completion, sse_events
from adapterserve.server.status import http_status, status_of


def test_model_prompt_and_sampling_are_read():
    call = parse_completion({"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0}, "tiny")
    assert (call.model, call.prompt) == ("tiny", "hi")
    assert (call.sampling.max_tokens, call.sampling.temperature) == (3, 0.0)
    assert parse_completion({"model": "sql@2", "prompt": [[1, 2, 3]]}, "tiny").prompt == [1, 2, 3]
    assert parse_completion({"model": "sql", "prompt": [1, 2]}, "tiny").prompt == [1, 2]


def test_neutral_values_of_unsupported_fields_and_unknown_keys_are_accepted():
    body = {"model": "tiny", "prompt": "hi", "n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": "",
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u-1", "min_p": 0,
            "repetition_penalty": 1.0, "min_tokens": 0, "stream": None, "stream_options": None, "top_k": -1,
            "seed": None, "stop": None, "metadata": {"x": [1, {"y": 2}]}, "service_tier": "auto"}
    call = parse_completion(body, "tiny")
    assert (call.prompt, call.stream, call.include_usage, call.sampling.top_k, call.sampling.stop) == ("hi", False,
                                                                                                         False, 0, ())


def test_a_prompt_over_the_size_limit_is_too_large():
    with pytest.raises(RequestTooLarge, match="'prompt' has 1048577 characters; this server takes at most 1048576"):
        parse_completion(_body(prompt="x" * ((1 << 20) + 1)), "tiny")
    with pytest.raises(RequestTooLarge, match="'prompt\\[0\\]' has 1048577 items"):
        parse_completion(_body(prompt=[[1] * ((1 << 20) + 1)]), "tiny")


def _body(**fields):
    return {"model": "m", "prompt": "x", **fields}


BAD_BODIES = [
    ([], "the request body must be a JSON object, got []"),
    ("x", "the request body must be a JSON object, got 'x'"),
    ({"prompt": "hi"}, "'model' is required: 'tiny' for the base model"),
    ({"model": 5, "prompt": "hi"}, "'model' must be a string, got 5"),
    ({"model": "m" * 2000, "prompt": "hi"}, "'model' has 2000 characters"),
    ({"model": "m"}, "'prompt' is required"),
    (_body(prompt=""), "'prompt' is empty"),
    (_body(prompt=[]), "'prompt' is empty"),
    (_body(prompt=[[]]), "'prompt[0]' is empty"),
    (_body(prompt=5), "'prompt' must be a string or a list of token ids, got 5"),
    (_body(prompt={"text": "x"}), "'prompt' must be a string or a list of token ids, got {'text': 'x'}"),
    (_body(prompt=["a", "b"]), "'prompt' holds 2 prompts; this server takes one per request"),
    (_body(prompt=[[1], [2]]), "'prompt' holds 2 prompts"),
    (_body(prompt=[1, "a"]), "'prompt[1]' must be a token id (an integer from 0 to 2147483647), got 'a'"),
    (_body(prompt=[1, -1]), "'prompt[1]' must be a token id"),
    (_body(prompt=[1, 2**40]), "'prompt[1]' must be a token id"),
    (_body(prompt=[1, True]), "'prompt[1]' must be a token id"),
    (_body(prompt=[1.0]), "'prompt[0]' must be a token id"),
    (_body(prompt=[[1, None]]), "'prompt[0][1]' must be a token id"),
    (_body(max_tokens=0), "'max_tokens' must be between 1"),
    (_body(max_tokens="16"), "'max_tokens' must be an integer, got '16'"),
    (_body(temperature="0.5"), "'temperature' must be a number, got '0.5'"),
    (_body(top_p=2), "'top_p' must be between 1e-09 and 1, got 2"),
    (_body(top_k=10**30), "'top_k' must be between -1 and 9223372036854775807"),
    (_body(seed="42"), "'seed' must be an integer, got '42'"),
    (_body(seed=2**70), "'seed' must be between"),
    (_body(stop=5), "'stop' must be a string or a list of strings, got 5"),
    (_body(stop=[1]), "'stop[0]' must be a string, got 1"),
    (_body(stop=[["x"]]), "'stop[0]' must be a string, got ['x']"),
    (_body(stop_token_ids=[-3]), "'stop_token_ids[0]' must be a token id"),
    (_body(stop_token_ids="1"), "'stop_token_ids' must be a list of token ids, got '1'"),
    (_body(ignore_eos="yes"), "'ignore_eos' must be true or false, got 'yes'"),
    (_body(stream="true"), "'stream' must be true or false, got 'true'"),
    (_body(stream=True, stream_options="x"), "'stream_options' must be an object or null, got 'x'"),
    (_body(stream=True, stream_options=[]), "'stream_options' must be an object or null, got []"),
    (_body(stream_options={"include_usage": True}), "'stream_options' is only allowed when 'stream' is true"),
    (_body(stream=True, stream_options={"include_usage": 1}),
     "'stream_options.include_usage' must be true or false, got 1"),
    (_body(return_token_ids=1), "'return_token_ids' must be true or false, got 1"),
    (_body(user=7), "'user' must be a string, got 7"),
    (_body(n=0), "'n' must be between 1 and 128, got 0"),
    (_body(n=True), "'n' must be an integer, got True"),
    (_body(best_of=3), "'best_of' is not supported"),
    (_body(echo=True), "'echo' is not supported by this server (only false or null), got True"),
    (_body(logprobs=0), "'logprobs' is not supported by this server (only null), got 0"),
    (_body(suffix="end"), "'suffix' is not supported"),
    (_body(presence_penalty=2.5), "'presence_penalty' must be between -2 and 2, got 2.5"),
    (_body(frequency_penalty="0"), "'frequency_penalty' must be a number, got '0'"),
    (_body(logit_bias={"abc": -100}), "'logit_bias' keys must be token ids"),
    (_body(logit_bias=[1]), "'logit_bias[0]' must be a (token id, bias) pair"),
    (_body(repetition_penalty=0), "'repetition_penalty' must be between 1e-06 and 1e+06, got 0"),
    (_body(prompt="a\ud800b"), "'prompt' holds a lone surrogate (U+D800 at character 1)"),
    (_body(prompt=["\udfff"]), "'prompt[0]' holds a lone surrogate (U+DFFF at character 0)"),
    (_body(stop=["ok", "x\udc80"]), "'stop[1]' holds a lone surrogate"),
    (_body(metadata={"note": "\ud83d"}), "'metadata.note' holds a lone surrogate"),
    (_body(**{"\ud800": 1}), "a key in the body holds a lone surrogate"),
    (_body(stream_options={"\ud800": 1}), "a key in 'stream_options' holds a lone surrogate"),
]


@pytest.mark.parametrize("body, message", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_bodies_are_refused_naming_the_field(body, message):
    with pytest.raises(RequestError) as caught:
        parse_completion(body, "tiny")
    assert str(caught.value).startswith(message), str(caught.value)
    sent = json.dumps(error_body(caught.value), ensure_ascii=False).encode("utf-8")  # as JSONResponse encodes it
    error = json.loads(sent)["error"]
    assert (error["code"], error["type"]) == (400, "invalid_request_error")


CHUNKS = [
    {"token_ids": [5, 6], "text": "ab", "finish_reason": None, "prompt_tokens": 4},
    {"token_ids": [7], "text": "c", "finish_reason": "length"},
]


def test_completion_body_puts_chunks_together():
    call = parse_completion({"model": "m", "prompt": "x", "return_token_ids": True}, "tiny")
    body = completion_body(call, CHUNKS)
    assert body["choices"][0] == {"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length",
                                  "token_ids": [5, 6, 7]}
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # a chunk without it: none cached


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
