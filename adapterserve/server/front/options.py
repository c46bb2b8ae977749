"""The gRPC server options of a front worker: the replica's own listener's (replica_grpc.py:
message caps, pending-call limits, HTTP/2 streams per connection), with port sharing on, so
the workers share the port (the replica guards it: pool.py)."""
from __future__ import annotations

from typing import Any

from adapterserve.server.grpc_services import PENDING_CALL_OPTIONS
from adapterserve.server.serve_env import H2_MAX_STREAMS, MAX_GRPC_MESSAGE_BYTES


def worker_options() -> list[tuple[str, Any]]:
    return [("grpc.so_reuseport", 1),
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
            ("grpc.max_concurrent_streams", H2_MAX_STREAMS),
            *PENDING_CALL_OPTIONS]
