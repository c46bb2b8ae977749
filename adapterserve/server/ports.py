"""Ports of a server started on this machine: the user's, checked before anything starts, and
a block of Serve's own, claimed so that no other server here takes the same ones.

Serve binds its gRPC ports with port sharing (SO_REUSEPORT), so a second server binding
the same port does not fail: the kernel splits the connections between the two. Each server
therefore claims a whole block of ports, by an exclusive lock on a file named after the
block, held by the claiming process until it exits (the kernel drops the lock then, even
after kill -9), and gives Serve only ports inside its block.
"""
from __future__ import annotations

import errno
import fcntl
import os
import random
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# Below Linux's ephemeral range (32768-60999, the OS's pick for outgoing connections) and
# above Ray's worker ports (10002-19999).
BLOCKS_START, BLOCKS_END = 20000, 30000
BLOCK_SIZE = 64
LOCKS_DIR = Path(tempfile.gettempdir()) / "adapterserve-ports"


class PortInUse(OSError):
    """A port the server must bind is held by another process (or may not be bound)."""


@dataclass(frozen=True)
class PortBlock:
    """BLOCK_SIZE consecutive ports from `first`, claimed by this process."""

    first: int

    def port(self, offset: int) -> int:
        if not 0 <= offset < BLOCK_SIZE:
            raise ValueError(f"offset {offset} is outside a block of {BLOCK_SIZE} ports")
        return self.first + offset

    def span(self, start: int, stop: int) -> tuple[int, int]:
        """Ports [first + start, first + stop) as (min, max), max excluded."""
        return self.port(start), self.port(stop - 1) + 1


_held: dict[int, int] = {}  # first port of a claimed block -> its open lock file


def claim_block() -> PortBlock:
    """A block that no other server here has claimed and where nothing listens."""
    firsts, hosts = range(BLOCKS_START, BLOCKS_END - BLOCK_SIZE + 1, BLOCK_SIZE), _wildcards()
    for first in random.sample(firsts, len(firsts)):  # random: servers starting together rarely meet
        if first in _held or not _lock(first):
            continue
        if all(bind_problem(port, host) is None for port in range(first, first + BLOCK_SIZE) for host in hosts):
            return PortBlock(first)
        release(PortBlock(first))
    raise PortInUse(f"no free block of {BLOCK_SIZE} ports between {BLOCKS_START} and {BLOCKS_END}: stop "
                    "another server on this machine or free some of those ports")


def claim_port(port: int) -> int | None:
    """Lock `port` for this process (a listener that shares it among its own processes, front/pool.py):
    the lock's file descriptor, to close when done, or None if another process holds it."""
    fd = _lock_file(f"port-{port}.lock")
    if fd is None:
        return None
    if fd < 0:  # another user's lock file: the port's own checks decide
        return os.open(os.devnull, os.O_RDONLY)
    return fd


def release(block: PortBlock) -> None:
    """Give the block back (nothing of this server may listen in it any more)."""
    fd = _held.pop(block.first, None)
    if fd is not None:
        os.close(fd)


def check_free(host: str, ports: Mapping[str, int]) -> None:
    """PortInUse naming the port and its flag if one of `ports` ({flag: port}) can't be listened on."""
    for flag, port in ports.items():
        problem = bind_problem(port, host)
        if problem:
            raise PortInUse(f"port {port} ({flag}) {problem} on {host}: stop what listens there or choose "
                            f"another port with {flag}")


def bind_problem(port: int, host: str = "") -> str | None:
    """Why a server could not listen on host:port now, or None. Binds as servers do (with
    SO_REUSEADDR), so connections of an earlier server still closing do not count."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen()
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "is already in use"
            if exc.errno == errno.EACCES:
                return "needs privileges this user lacks"
            return f"cannot be bound ({exc.strerror})"
    return None


_given: set[int] = set()  # ports free_port has handed out in this process


def free_port() -> int:
    """A port free on every interface now, for tests and benchmarks that start servers: between
    the servers' blocks and the OS's ephemeral range, where a process that binds port 0 or
    connects out (Ray starts many) cannot take it before its server binds it; none twice."""
    hosts = _wildcards()
    spare = range(BLOCKS_END, max(BLOCKS_END, _ephemeral_start()))
    for port in random.sample(spare, len(spare)):
        if port not in _given and all(bind_problem(port, host) is None for host in hosts):
            _given.add(port)
            return port
    with socket.socket() as sock:  # no spare range on this host: the OS's pick
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _ephemeral_start() -> int:
    """The first port of the OS's ephemeral range (Linux's default where it can't be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _wildcards() -> list[str]:
    """IPv4's all-interfaces address, and IPv6's where this host has IPv6 (Serve's gRPC binds [::])."""
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::", 0))
    except OSError:
        return ["0.0.0.0"]
    return ["0.0.0.0", "::"]


def _lock(first: int) -> bool:
    """Take the block's lock; False if another process holds it."""
    fd = _lock_file(f"{first}.lock")
    if fd is None:
        return False
    if fd >= 0:
        _held[first] = fd
    return True


def _lock_file(name: str) -> int | None:
    """An exclusive lock on LOCKS_DIR/name: its descriptor, None if another process holds it, -1 if
    the file is another user's and unreadable (the free-port check decides then)."""
    try:
        if not LOCKS_DIR.is_dir():
            LOCKS_DIR.mkdir(exist_ok=True)
            LOCKS_DIR.chmod(0o1777)  # every user's servers claim blocks here, as in /tmp
        fd = os.open(LOCKS_DIR / name, os.O_RDONLY | os.O_CREAT, 0o644)
    except PermissionError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
