"""The gRPC server options of a front worker: the replica's own listener's (replica_grpc.py:
message caps, pending-call limits, HTTP/2 streams per connection), with port sharing on, so
the workers share the port (the replica guards it: pool.py)."""
from __future__ import annotations

from typing import Any

from adapterserve.server.replica_grpc import SERVER_OPTIONS


def worker_options() -> list[tuple[str, Any]]:
    return [("grpc.so_reuseport", 1), *(o for o in SERVER_OPTIONS if o[0] != "grpc.so_reuseport")]
