"""What errors become on the wire: Ray's errors for a replica that went away are
UNAVAILABLE with retry advice; retry advice travels as trailing metadata (gRPC) and
Retry-After (HTTP); a replica's errors cross Ray as data and keep their type."""
from __future__ import annotations

import grpc
import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, NodeDiedError, WorkerCrashedError
from ray.serve.exceptions import DeploymentUnavailableError, RequestCancelledError

from adapterserve import errors
from adapterserve.server.replies import error_reply, raise_if_error
from adapterserve.server.status import RETRY_AFTER_KEY, grpc_error, http_headers, http_status, message_of, status_of

GONE = [ActorDiedError(), ActorUnavailableError("the actor is restarting", b"\0" * 16), WorkerCrashedError(),
        NodeDiedError("node 1 died"), RequestCancelledError("r-1")]


@pytest.mark.parametrize("exc", GONE, ids=lambda e: type(e).__name__)
def test_a_replica_that_went_away_is_unavailable_and_retryable(exc):
    assert (status_of(exc), http_status(exc)) == (grpc.StatusCode.UNAVAILABLE, 503)
    assert message_of(exc) == (f"the replica serving this request went away ({type(exc).__name__}); "
                               "retry: it is being replaced")
    assert http_headers(exc) == {"Retry-After": "1"}


@pytest.mark.parametrize("exc, code, after", [
    (errors.Overloaded("full", retry_after_s=2.5), grpc.StatusCode.RESOURCE_EXHAUSTED, "2.5"),
    (errors.EngineDied("gone"), grpc.StatusCode.UNAVAILABLE, "1"),
    (errors.EngineBroken("broken"), grpc.StatusCode.UNAVAILABLE, "1"),
    (errors.ServerDraining("draining"), grpc.StatusCode.UNAVAILABLE, "1"),
    (DeploymentUnavailableError("EngineReplica"), grpc.StatusCode.UNAVAILABLE, "1"),
    (errors.RequestError("bad"), grpc.StatusCode.INVALID_ARGUMENT, None),
])
def test_grpc_errors_carry_their_retry_advice(exc, code, after):
    context = _Context()
    assert grpc_error(context, exc) is exc
    assert context.code == code and context.details == message_of(exc)
    assert context.trailing == ([(RETRY_AFTER_KEY, after)] if after else [])


def test_http_retry_after_is_whole_seconds():
    assert http_headers(errors.Overloaded("full", retry_after_s=2.5)) == {"Retry-After": "3"}
    assert http_headers(errors.Overloaded("full", retry_after_s=0.2)) == {"Retry-After": "1"}
    assert http_headers(errors.AdapterNotFound("x")) == {}


@pytest.mark.parametrize("exc", [errors.EngineDied("gone"), errors.EngineBroken("CUDA error"),
                                 errors.Overloaded("full", retry_after_s=3.0), errors.AdapterNotFound("no 'x'"),
                                 errors.RequestTooLarge("too long")])
def test_a_replicas_error_keeps_its_type_message_and_retry_advice(exc):
    with pytest.raises(type(exc)) as raised:
        raise_if_error(error_reply(exc))
    assert type(raised.value) is type(exc) and str(raised.value) == str(exc)
    assert getattr(raised.value, "retry_after_s", None) == getattr(exc, "retry_after_s", None)
    raise_if_error({"token_ids": [1], "text": "a"})  # no error: nothing raised


def test_an_error_name_that_is_not_ours_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="__class__: x"):
        raise_if_error({"error": "__class__", "message": "x"})


class _Context:
    """What Ray Serve's RayServegRPCContext offers the ingress for errors."""

    def __init__(self) -> None:
        self.code, self.details, self.trailing = None, None, []

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, pairs) -> None:
        self.trailing = list(pairs)
