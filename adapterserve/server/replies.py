"""Errors a replica returns as data, and the ingress raises again as the same type.

Raised through Ray, an error reaches the caller wrapped (RayTaskError); returned as a
reply it keeps its type, its message and its retry advice, so the status the client
gets (status.py) is the one the error deserves.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapterserve import errors


def error_reply(exc: BaseException) -> dict[str, Any]:
    """{"error": class name, "message": ..., "retry_after_s": ... (Overloaded only)}."""
    reply: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, errors.Overloaded):
        reply["retry_after_s"] = exc.retry_after_s
    return reply


def raise_if_error(reply: Mapping[str, Any]) -> None:
    """Raise the error a reply (or a streamed chunk) carries; nothing if it carries none."""
    if "error" not in reply:
        return
    cls = getattr(errors, reply["error"], None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        raise RuntimeError(f"{reply['error']}: {reply['message']}")
    if issubclass(cls, errors.Overloaded):
        raise cls(reply["message"], retry_after_s=reply.get("retry_after_s", 1.0))
    raise cls(reply["message"])
