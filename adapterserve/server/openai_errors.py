"""Errors on the HTTP routes in OpenAI's shape, routing errors included:

    {"error": {"message": "'max_tokens' must be between 1 and ...", "type": "invalid_request_error",
               "param": "max_tokens", "code": 400}}

`type` is OpenAI's name for the HTTP status; `param` names the request field where it is
known (a check's message starts with the quoted field, and a model that cannot be found,
used or served is the route's `model` field); `code` is the HTTP status, as vLLM sends it.
Unknown routes (404), wrong methods (405), bodies FastAPI refuses and errors no route
caught get the same shape.
"""
from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from adapterserve.errors import AccessDenied, AdapterNotFound
from adapterserve.server.backends import NotServed
from adapterserve.server.status import http_headers, http_status, message_of

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
ROUTES = ("GET /v1/models", "GET /v1/models/{model}", "POST /v1/completions", "POST /v1/chat/completions",
          "POST /v1/embeddings", "POST /v1/classify", "POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter",
          "GET /health", "GET /metrics")
_FIELD = re.compile(r"'([A-Za-z_][\w.\[\]]*)' ")  # a check's message: "'stop[0]' must be a string, ..."
_ABOUT_MODEL = (AdapterNotFound, AccessDenied, NotServed)


def error_type(status: int) -> str:
    return TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


def error_body(exc: BaseException, model_param: str | None = "model") -> dict[str, Any]:
    """The body for `exc`; an error about the adapter or model names `model_param`."""
    message = message_of(exc)
    param = param_of(message) or (model_param if isinstance(exc, _ABOUT_MODEL) else None)
    return body(message, http_status(exc), param)


def error_response(exc: BaseException, model_param: str | None = "model") -> JSONResponse:
    return JSONResponse(error_body(exc, model_param), status_code=http_status(exc), headers=http_headers(exc))


def param_of(message: str) -> str | None:
    """The field a check's message starts with ("'stop[0]' must be ..." -> "stop[0]")."""
    found = _FIELD.match(message)
    return found.group(1) if found else None


def install(app: FastAPI) -> None:
    """Answer routing errors, bodies FastAPI refuses and uncaught errors in OpenAI's shape."""
    app.add_exception_handler(HTTPException, routing_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(Exception, _uncaught)


async def routing_error(request: Request, exc: HTTPException) -> JSONResponse:
    route = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"this server has no route {route}; it serves {', '.join(ROUTES)}"
    elif exc.status_code == 405:
        allowed = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow")
        message = f"{route} is not allowed; {request.url.path} takes {allowed or 'other methods'}"
    else:
        message = str(exc.detail)
    return JSONResponse(body(message, exc.status_code), status_code=exc.status_code, headers=exc.headers)


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = (exc.errors() or [{}])[0]
    where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
    message = f"{where or 'the request'}: {first.get('msg', 'is invalid')}"
    return JSONResponse(body(message, 400, where), status_code=400)


async def _uncaught(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)
