"""Exceptions users see. Messages say what is wrong and what to do about it."""


class AdapterError(ValueError):
    """An adapter was refused: malformed, unsupported, or not made for this backbone."""


class AdapterNotFound(KeyError):
    """No adapter is loaded (or stored) under that id."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message plain
        return str(self.args[0]) if self.args else "adapter not found"


class RequestError(ValueError):
    """A request's fields are invalid (prompt, sampling parameters, adapter id)."""


class CapacityError(RuntimeError):
    """The engine cannot take this now (no free adapter slot, KV cache too small)."""


class AdapterTooLarge(AdapterError):
    """An upload is over the store's size or file-count limit."""


class AdapterIntegrityError(RuntimeError):
    """Stored adapter files do not match the content hash recorded when they were published."""


class AccessDenied(PermissionError):
    """The caller's tenant may not see, use or change this adapter."""


class Unauthenticated(PermissionError):
    """No API key, or an API key that no tenant owns."""


class EngineDied(RuntimeError):
    """The engine's process exited: its requests failed and the replica must restart."""


class EngineBroken(RuntimeError):
    """The engine hit a fault of its own (a failed step, a CUDA error, out of memory): it
    serves no more requests and its replica must be replaced. Retry: another replica
    (or this one's replacement) takes the request."""


class Overloaded(CapacityError):
    """The server sheds this request: its queue is full. Retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # keep retry_after_s across pickling (engine process, Ray)
        return type(self), (str(self), self.retry_after_s)


class ServerDraining(RuntimeError):
    """The server is shutting down: it finishes running requests but takes no new ones.
    Retry on another server (or this one after its restart)."""


class RequestTooLarge(RequestError):
    """A request body, message or prompt is over the server's size limit (HTTP 413)."""


class StoreUnavailable(RuntimeError):
    """The adapter store cannot be read or written now (read-only, full, unreachable).
    The message names no server paths; the server log has the details. Retry later."""


class QuotaExceeded(Overloaded):
    """A tenant is at one of its quotas (RESOURCE_EXHAUSTED / 429). `quota` names it;
    `retry_after_s` is None where waiting does not help (stored bytes, versions, adapters)."""

    def __init__(self, message: str, quota: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.quota = quota
        self.retry_after_s = retry_after_s  # type: ignore[assignment]

    def __reduce__(self):
        return type(self), (str(self), self.quota, self.retry_after_s)


class AdapterInUse(RuntimeError):
    """An adapter cannot be unloaded now: requests queued for it have not started."""
