"""What each error becomes on the wire: a gRPC status code, an HTTP status.

The ingress sets the code, details and retry advice (trailing metadata `retry-after-s`;
HTTP: a Retry-After header) on Ray Serve's gRPC context. Ray's own errors for a replica
that went away (its actor died, its node died, Serve stopped it and cancelled its
requests) are UNAVAILABLE: retryable, the replica is being replaced.
"""
from __future__ import annotations

import logging
import math

import grpc
from ray.exceptions import LocalRayletDiedError, NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
    RequestCancelledError,
)

from adapterserve.errors import (
    AccessDenied,
    AdapterInUse,
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
    StoreUnavailable,
    Unauthenticated,
)
from adapterserve.server.backends import NotServed

logger = logging.getLogger("adapterserve.server")
RETRY_AFTER_KEY = "retry-after-s"  # gRPC trailing metadata: seconds to wait before retrying
# A replica that went away under a call. RequestCancelledError: Serve cancelled the call (the
# replica is stopping); when the caller itself cancels, no status is reported at all.
REPLICA_GONE = (RayActorError, WorkerCrashedError, NodeDiedError, LocalRayletDiedError, ObjectLostError,
                ReplicaUnavailableError, RequestCancelledError)

# Most specific first: AdapterTooLarge is an AdapterError, AccessDenied a PermissionError.
_CODES: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], grpc.StatusCode], ...] = (
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (AccessDenied, grpc.StatusCode.PERMISSION_DENIED),
    (AdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (RequestTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AdapterError, grpc.StatusCode.INVALID_ARGUMENT),
    (RequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotServed, grpc.StatusCode.FAILED_PRECONDITION),
    (AdapterInUse, grpc.StatusCode.FAILED_PRECONDITION),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BackPressureError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeploymentUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (REPLICA_GONE, grpc.StatusCode.UNAVAILABLE),
    (EngineDied, grpc.StatusCode.UNAVAILABLE),
    (EngineBroken, grpc.StatusCode.UNAVAILABLE),
    (ServerDraining, grpc.StatusCode.UNAVAILABLE),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
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
    if isinstance(exc, BackPressureError):
        return f"the server is at capacity, retry later ({exc.message})"
    if isinstance(exc, DeploymentUnavailableError):
        return f"no replica can take this now, retry later ({exc.message})"
    if isinstance(exc, REPLICA_GONE):
        return f"the replica serving this request went away ({type(exc).__name__}); retry: it is being replaced"
    if status_of(exc) is grpc.StatusCode.INTERNAL:
        logger.exception("internal error", exc_info=exc)
        return f"internal server error: {type(exc).__name__}: {exc}"
    return str(exc)


def grpc_error(context, exc: BaseException) -> BaseException:
    """Put `exc`'s status, and its retry advice if any, on a RayServegRPCContext; return `exc`.
    Serve sends trailing metadata only with a call that returns: end the call, do not raise."""
    context.set_code(status_of(exc))
    context.set_details(message_of(exc))
    if (after := retry_after_s(exc)) is not None:
        context.set_trailing_metadata([(RETRY_AFTER_KEY, f"{after:g}")])
    return exc


def http_status(exc: BaseException) -> int:
    if isinstance(exc, RequestTooLarge):
        return 413
    return _HTTP.get(status_of(exc), 500)


def retry_after_s(exc: BaseException) -> float | None:
    """Seconds a client should wait before retrying (Retry-After / retry metadata), if any."""
    if isinstance(exc, Overloaded):
        return exc.retry_after_s
    if isinstance(exc, (BackPressureError, DeploymentUnavailableError, EngineDied, EngineBroken, ServerDraining,
                        StoreUnavailable,
                        *REPLICA_GONE)):
        return 1.0
    return None


def http_headers(exc: BaseException) -> dict[str, str]:
    """Retry-After (whole seconds, at least 1) when `exc` comes with retry advice."""
    after = retry_after_s(exc)
    return {} if after is None else {"Retry-After": str(max(1, math.ceil(after)))}
