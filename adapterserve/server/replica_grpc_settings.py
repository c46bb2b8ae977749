"""The `replica_grpc` setting (settings.DEFAULTS): a gRPC listener of the direct replica's own
(server/replica_grpc.py), checked here without importing gRPC's services.

    replica_grpc: {port: null, host: 127.0.0.1, workers: 0}
        port: a port number, or null (no listener)
        workers: 0, the replica's event loop serves the port; N, N front worker processes share
            it and forward each call to the replica (server/front/), so the calls' gRPC work
            runs on N more cores
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SETTING = "replica_grpc"
MAX_WORKERS = 64


def check_replica_grpc(value: Any) -> None:
    """ValueError naming the first bad `replica_grpc.*` value."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{SETTING} must be a mapping {{port: ..., host: ...}}, got {value!r}")
    port, host, workers = value["port"], value["host"], value["workers"]
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535):
        raise ValueError(f"{SETTING}.port must be a port number (1-65535) or null (no listener), got {port!r}")
    if not isinstance(host, str) or not host or host.strip() != host or host.startswith("["):
        raise ValueError(f"{SETTING}.host must be an address to listen on, e.g. 0.0.0.0 or :: (no brackets), "
                         f"got {host!r}")
    if not isinstance(workers, int) or isinstance(workers, bool) or not 0 <= workers <= MAX_WORKERS:
        raise ValueError(f"{SETTING}.workers must be a whole number from 0 (the replica serves the port) to "
                         f"{MAX_WORKERS} (front worker processes), got {workers!r}")


def check_fits_deployment(cfg: Mapping[str, Any], direct: bool) -> None:
    """ValueError unless a listener set in `cfg` has one direct replica to live in."""
    if cfg[SETTING]["port"] is None:
        return
    if not direct:
        raise ValueError(f"{SETTING}.port is set but the server runs two tiers (direct: false, or auto with "
                         "several generation replicas): only a direct replica owns the engine it would serve; "
                         "set direct: true with one replica, or unset the port")
    replica = cfg["replica"]
    if replica["num_replicas"] != 1 or replica["autoscaling_config"]:
        raise ValueError(f"{SETTING}.port is set with {replica['num_replicas']!r} replicas"
                         f"{' and autoscaling' if replica['autoscaling_config'] else ''}: one port serves one "
                         "replica; run one replica, or unset the port and let HAProxy spread the calls")
