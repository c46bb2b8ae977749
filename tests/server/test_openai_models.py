"""Model objects of /v1/models and errors in OpenAI's shape (no Ray needed)."""
from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import pytest
from starlette.exceptions import HTTPException
from starlette.requests import Request

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.errors import (
    AccessDenied,
    AdapterNotFound,
    Overloaded,
    RequestError,
    RequestTooLarge,
    Unauthenticated,
)
from adapterserve.server.backends import NotServed
from adapterserve.server.openai_errors import error_body, error_response, routing_error
from adapterserve.server.openai_models import adapter_entry, models_body

NOW = datetime(2026, 1, 2, tzinfo=timezone.utc)


def _version(name: str, number: int, backbone: str | None, tenant: str | None = "alice") -> AdapterVersion:
    info = {"kind": "lora"} | ({"backbone": backbone} if backbone else {})
    return AdapterVersion(name, number, f"{name}{number}", tenant, False, NOW, 10, ("a",), info)


def test_models_lists_both_backbones_then_each_name_before_its_versions():
    versions = [_version("sentiment", 1, "minilm", None), _version("sql", 1, "llama"), _version("sql", 2, "llama"),
                _version("old", 1, None)]
    data = models_body("llama", "minilm", versions)["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in data] == [
        ("llama", "llama", None), ("minilm", "minilm", None),
        ("sentiment", "sentiment@1", "minilm"), ("sentiment@1", "sentiment@1", "minilm"),
        ("sql", "sql@2", "llama"), ("sql@1", "sql@1", "llama"), ("sql@2", "sql@2", "llama"),
        ("old", "old@1", "llama"), ("old@1", "old@1", "llama"),  # no recorded backbone: the generation one
    ]
    assert data[2]["owned_by"] == "adapterserve" and data[4]["owned_by"] == "alice"
    assert data[4]["created"] == int(NOW.timestamp()) and all(m["object"] == "model" for m in data)
    assert [m["id"] for m in models_body("llama", None, [])["data"]] == ["llama"]


def test_a_retrieved_name_shows_the_version_it_resolved_to():
    entry = adapter_entry(_version("sql", 3, "llama"), "sql", "llama")
    assert (entry["id"], entry["root"], entry["parent"]) == ("sql", "sql@3", "llama")


@pytest.mark.parametrize("exc, status, kind, param", [
    (RequestError("'stop[0]' must be a string, got 1"), 400, "invalid_request_error", "stop[0]"),
    (RequestError("'stream_options.include_usage' must be true or false"), 400, "invalid_request_error",
     "stream_options.include_usage"),
    (RequestError("prompt has 2000 tokens and max_tokens is 4: ..."), 400, "invalid_request_error", None),
    (RequestTooLarge("'prompt' has 9 characters; ..."), 413, "invalid_request_error", "prompt"),
    (Unauthenticated("unknown API key"), 401, "authentication_error", None),
    (AccessDenied("adapter 'sql' belongs to another tenant"), 403, "permission_error", "model"),
    (AdapterNotFound("no adapter named 'x'"), 404, "not_found_error", "model"),
    (NotServed("generate: adapter 'sentiment@1' is made for backbone ..."), 400, "invalid_request_error", "model"),
    (Overloaded("at capacity", retry_after_s=2.5), 429, "rate_limit_error", None),
    (ZeroDivisionError("boom"), 500, "server_error", None),
])
def test_errors_have_openais_type_names_and_name_the_field(exc, status, kind, param):
    error = error_body(exc)["error"]
    assert (error["code"], error["type"], error["param"]) == (status, kind, param)
    assert set(error) == {"message", "type", "param", "code"}


def test_retry_advice_goes_with_the_error():
    reply = error_response(Overloaded("at capacity", retry_after_s=2.5))
    assert reply.status_code == 429 and reply.headers["retry-after"] == "3"
    assert error_body(AdapterNotFound("gone"), model_param="lora_name")["error"]["param"] == "lora_name"


def _request(method: str, path: str) -> Request:
    return Request({"type": "http", "method": method, "path": path, "headers": [], "query_string": b""})


def test_routing_errors_come_in_openais_shape():
    missing = asyncio.run(routing_error(_request("POST", "/v1/responses"), HTTPException(404)))
    error = json.loads(missing.body)["error"]
    assert missing.status_code == 404 and error["type"] == "not_found_error"
    assert "no route POST /v1/responses" in error["message"] and "/v1/chat/completions" in error["message"]
    not_allowed = HTTPException(405, headers={"Allow": "POST"})
    wrong = asyncio.run(routing_error(_request("GET", "/v1/completions"), not_allowed))
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    message = json.loads(wrong.body)["error"]["message"]
    assert message == "GET /v1/completions is not allowed; /v1/completions takes POST"
