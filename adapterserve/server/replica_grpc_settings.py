"""The `replica_grpc` setting (settings.DEFAULTS): a gRPC listener of the direct replica's own
(server/replica_grpc.py), checked here without importing gRPC's services.

    replica_grpc: {port: null, host: 127.0.0.1}   # port: a port number, or null (no listener)
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SETTING = "replica_grpc"


def check_replica_grpc(value: Any) -> None:
    """ValueError naming the first bad `replica_grpc.*` value."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{SETTING} must be a mapping {{port: ..., host: ...}}, got {value!r}")
    port, host = value["port"], value["host"]
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535):
        raise ValueError(f"{SETTING}.port must be a port number (1-65535) or null (no listener), got {port!r}")
    if not isinstance(host, str) or not host or host.strip() != host or host.startswith("["):
        raise ValueError(f"{SETTING}.host must be an address to listen on, e.g. 0.0.0.0 or :: (no brackets), "
                         f"got {host!r}")


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
