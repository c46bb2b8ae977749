"""The call context a forwarded call's handler sees in the replica: what the ingress uses of
grpc's (grpc_services.CallContext), recorded here and sent to the front worker with the
call's end, which sets them on the real call."""
from __future__ import annotations

from collections.abc import Sequence

import grpc

Metadata = Sequence[tuple[str, str | bytes]]


class Aborted(Exception):
    """Raised by BridgedContext.abort, as grpc.aio's abort raises: the handler ends there."""


class BridgedContext:
    def __init__(self, metadata: Metadata, peer: str) -> None:
        self._metadata = tuple(metadata)
        self._peer = peer
        self.code: grpc.StatusCode = grpc.StatusCode.OK
        self.details = ""
        self._trailing: tuple[tuple[str, str | bytes], ...] = ()

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def set_trailing_metadata(self, trailing_metadata: Metadata) -> None:
        self._trailing = tuple(trailing_metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Metadata = ()) -> None:
        self.code, self.details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise Aborted(details)

    def end(self) -> tuple[int, str, tuple]:
        """(status code's number, details, trailing metadata), as the call's end frame carries them."""
        return self.code.value[0], self.details, self._trailing
