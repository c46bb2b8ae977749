"""What each error becomes on the wire: a gRPC status code, an HTTP status.

The ingress sets the code and details on Ray Serve's gRPC context and re-raises;
Serve's proxy then answers with that status instead of INTERNAL.
"""
from __future__ import annotations

import logging

import grpc
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from adapterserve.errors import (
    AccessDenied,
    AdapterError,
    AdapterIntegrityError,
    AdapterNotFound,
    CapacityError,
    EngineBroken,
    EngineDied,
    Overloaded,
    RequestError,
    RequestTooLarge,
    ServerDraining,
    Unauthenticated,
)
from adapterserve.server.backends import NotServed

logger = logging.getLogger("adapterserve.server")

# Most specific first: AdapterTooLarge is an AdapterError, AccessDenied a PermissionError.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (AccessDenied, grpc.StatusCode.PERMISSION_DENIED),
    (AdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (RequestTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AdapterError, grpc.StatusCode.INVALID_ARGUMENT),
    (RequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotServed, grpc.StatusCode.FAILED_PRECONDITION),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BackPressureError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeploymentUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (EngineDied, grpc.StatusCode.UNAVAILABLE),
    (EngineBroken, grpc.StatusCode.UNAVAILABLE),
    (ServerDraining, grpc.StatusCode.UNAVAILABLE),
    (AdapterIntegrityError, grpc.StatusCode.DATA_LOSS),
)

_HTTP = {
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.INTERNAL: 500,
}


def status_of(exc: BaseException) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def message_of(exc: BaseException) -> str:
    if isinstance(exc, (BackPressureError, DeploymentUnavailableError)):
        return f"the server is at capacity, retry later ({exc.message})"
    if status_of(exc) is grpc.StatusCode.INTERNAL:
        logger.exception("internal error", exc_info=exc)
        return f"internal server error: {type(exc).__name__}: {exc}"
    return str(exc)


def grpc_error(context, exc: BaseException) -> BaseException:
    """Put `exc`'s status on a RayServegRPCContext; return the exception to raise."""
    context.set_code(status_of(exc))
    context.set_details(message_of(exc))
    return exc


def http_status(exc: BaseException) -> int:
    if isinstance(exc, RequestTooLarge):
        return 413
    return _HTTP.get(status_of(exc), 500)


def retry_after_s(exc: BaseException) -> float | None:
    """Seconds a client should wait before retrying (Retry-After / retry metadata), if any."""
    if isinstance(exc, Overloaded):
        return exc.retry_after_s
    if isinstance(exc, (BackPressureError, DeploymentUnavailableError, EngineDied, EngineBroken, ServerDraining)):
        return 1.0
    return None
