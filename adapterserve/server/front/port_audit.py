"""Who else listens on a port the front workers share (Linux: /proc/net/tcp, tcp6).

The workers bind with port sharing (SO_REUSEPORT), so another process of the same user that
also asks for sharing (gRPC servers do by default) would silently get a share of the
connections. The pool checks after its workers bind, and from then on at each health check,
that every listening socket on the port whose address overlaps ours is a worker's.
"""
from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

LISTEN = "0A"  # the TCP state column's LISTEN
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def supported() -> bool:
    return TABLES[0].exists()


def listeners(port: int) -> dict[int, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Socket inode -> address of every socket listening on `port` on this host."""
    found = {}
    for table in TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            address, _, hex_port = local.partition(":")
            if state == LISTEN and int(hex_port, 16) == port:
                found[inode] = _address(address)
    return found


def socket_inodes(pids: Iterable[int]) -> set[int]:
    """The socket inodes the processes `pids` hold open."""
    inodes = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for name in names:
            try:
                target = os.readlink(fd_dir / name)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def foreign(host: str, port: int, pids: Iterable[int]) -> list[str]:
    """Addresses of sockets listening on host:port's port, overlapping `host`, held by none of `pids`."""
    ours, mine = socket_inodes(pids), _parse(host)
    return sorted(f"{address}:{port}" for inode, address in listeners(port).items()
                  if inode not in ours and _overlap(mine, address))


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)
    # the kernel prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _parse(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:  # a host name: any listener on the port counts
        return None


def _overlap(mine, theirs) -> bool:
    if mine is None or mine.is_unspecified or theirs.is_unspecified:
        return True
    mapped = getattr(theirs, "ipv4_mapped", None)
    return mine == theirs or (mapped is not None and mine == mapped)
