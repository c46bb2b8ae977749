"""Ports of a server started here: the user's checked before anything starts, Serve's own from a
block that no other server here claims, even one that binds with port sharing."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from adapterserve.server import ports


def _listener(port: int = 0, *, reuseport: bool = False, reuseaddr: bool = False) -> socket.socket:
    sock = socket.socket()
    if reuseport:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if reuseaddr:  # as servers bind
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen()
    return sock


def test_a_taken_port_is_named_with_its_flag():
    with _listener() as held:
        port = held.getsockname()[1]
        with pytest.raises(ports.PortInUse) as refused:
            ports.check_free("127.0.0.1", {"--http-port": ports.free_port(), "--grpc-port": port})
    message = str(refused.value)
    assert f"port {port} (--grpc-port) is already in use on 127.0.0.1" in message
    assert "\n" not in message


def test_free_ports_are_outside_the_ephemeral_range_and_the_blocks_and_never_twice(monkeypatch):
    """A test's server binds its port a while after free_port: a port the OS could hand to any
    process binding port 0 (Ray's workers do) would race it. A port with a listener is passed over."""
    picks = [ports.free_port() for _ in range(50)]
    assert len(set(picks)) == len(picks)
    assert all(ports.BLOCKS_END <= port < ports._ephemeral_start() for port in picks)
    with _listener(picks[0] + 1, reuseaddr=True) as held:  # the next in order is taken: skipped
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports.random, "sample", lambda spare, k: [taken, *(p for p in spare if p != taken)])
        assert ports.free_port() not in (taken, *picks)


def test_a_port_shared_with_so_reuseport_counts_as_taken():
    """Serve's gRPC servers bind with SO_REUSEPORT: a second such bind would succeed and split
    the traffic, so the check must not bind that way."""
    with _listener(reuseport=True) as held:
        assert ports.bind_problem(held.getsockname()[1]) == "is already in use"


def test_a_port_left_by_a_stopped_server_is_free():
    with _listener(reuseaddr=True) as held:
        port = held.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = held.accept()
        accepted.close()  # the server side closes first: its end lingers in TIME_WAIT
        client.close()
    assert ports.bind_problem(port) is None


def test_two_claims_never_share_a_block():
    first, second = ports.claim_block(), ports.claim_block()
    try:
        assert abs(first.first - second.first) >= ports.BLOCK_SIZE
        assert ports.BLOCKS_START <= first.first and first.port(ports.BLOCK_SIZE - 1) < ports.BLOCKS_END
    finally:
        ports.release(first)
        ports.release(second)


def test_a_block_claimed_by_another_process_or_in_use_is_skipped(monkeypatch, tmp_path):
    size = ports.BLOCK_SIZE
    first = _free_ports(3 * size)  # three blocks: one with a listener, one claimed elsewhere, one free
    monkeypatch.setattr(ports, "BLOCKS_START", first)
    monkeypatch.setattr(ports, "BLOCKS_END", first + 3 * size)
    monkeypatch.setattr(ports, "LOCKS_DIR", tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path / f"{first + size}.lock")],
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"locked\n"
        with _listener(first + 5):
            block = ports.claim_block()
            assert block.first == first + 2 * size
            with pytest.raises(ports.PortInUse, match="no free block"):
                ports.claim_block()
        ports.release(block)
    finally:
        holder.kill()
        holder.wait()


def test_ports_are_taken_only_inside_the_block():
    block = ports.PortBlock(20000)
    assert block.span(4, 34) == (20004, 20034)
    with pytest.raises(ValueError, match="outside a block"):
        block.port(ports.BLOCK_SIZE)


_HOLD_LOCK = """
import fcntl, sys, time
fd = open(sys.argv[1], "w")
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def _free_ports(count: int) -> int:
    """The first of `count` consecutive ports that are free now (outside the server blocks)."""
    for first in range(40000, 60000 - count, count):
        if all(ports.bind_problem(port) is None for port in range(first, first + count)):
            return first
    pytest.skip(f"no {count} consecutive free ports on this machine")
