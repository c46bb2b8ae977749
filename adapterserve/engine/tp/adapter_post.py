"""How an adapter's part travels from rank 0 to a worker, on the worker's adapters connection.

A part (an AdapterShard, or any object holding CPU tensors) is packed once: its tensors' bytes
laid end to end in one blob (each at a 64-byte boundary) and the rest of the object tree as a
small pickled skeleton that names each tensor by its index in a table (dtype, shape, offset).
A worker on rank 0's host gets the blob as a file in a shared-memory directory (``/dev/shm``):
rank 0 sends its path with the skeleton, the worker reads the file and replies. Any other
worker, or any failure to write or read the file, gets the blob over the connection itself.

Messages, rank 0 -> worker (each pickled):
  ("file", key, header, path)   the blob is the file at path
  ("inline", key, header)       the blob is the next message, as raw bytes
and the worker's reply to each: ("ok", key) or ("failed", key, why). After a failed file
rank 0 sends the same part inline; a failed inline part is an error (the engine breaks).

Rank 0 posts a part (``post``) and collects the reply later (``settle``), before it posts
the next part to that worker or needs the worker to hold it: so the worker reads its part
while rank 0 goes on with the rest of the adapter's adding.

Files: rank 0 creates each one (mode 0600, a name of its own) and owns it until the worker's
reply (``settle`` removes it) or until the group closes (Lockstep.close removes what is still
in flight); the worker removes it too, as soon as it has read it. Only rank 0 killed while a
part is in flight leaves its file behind.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

SHARED_MEMORY_DIR = "/dev/shm"
FILE_PREFIX = "adapterserve-tp-"
_ALIGN = 64  # each tensor's offset in the blob (any dtype's element size divides it)
_REPLY_POLL_S = 0.05


@dataclass
class Packed:
    """An object as it travels: the header (skeleton and tensor table, pickled) and the tensors'
    bytes, each flat, with its offset in the blob of ``size`` bytes."""

    header: bytes
    chunks: list[tuple[int, torch.Tensor]]  # (offset, the tensor's bytes as a flat uint8 tensor)
    size: int

    @property
    def nbytes(self) -> int:
        """Bytes that reach the worker: the header and the blob."""
        return len(self.header) + self.size

    def blob(self) -> torch.Tensor:
        """The blob in memory (for the connection)."""
        out = torch.zeros(self.size, dtype=torch.uint8)
        for offset, data in self.chunks:
            out[offset:offset + data.numel()].copy_(data)
        return out

    def write_file(self, directory: str) -> str:
        """The blob as a new file in directory; its path. OSError (nothing left behind) when the
        directory lacks room or refuses the file."""
        if shutil.disk_usage(directory).free < self.size + (1 << 20):
            raise OSError(f"{directory} has no room for {self.size} bytes")
        path = os.path.join(directory, f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
            for offset, data in self.chunks:
                _write_all(fd, memoryview(data.numpy()), offset)
        except BaseException:
            remove_file(path)
            raise
        finally:
            os.close(fd)
        return path


class _SkeletonPickler(pickle.Pickler):
    """Pickles an object tree with its CPU tensors replaced by their index in ``tensors``."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}  # id(tensor) -> its index: one tensor twice is sent once

    def persistent_id(self, obj: object) -> int | None:
        if not _travels_as_bytes(obj):
            return None
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return index


def _travels_as_bytes(obj: object) -> bool:
    return (type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided
            and not obj.requires_grad and not obj.is_quantized)


def pack(obj: object) -> Packed:
    """obj as a skeleton and one blob (its tensors' values, dtypes and shapes kept)."""
    skeleton = io.BytesIO()
    pickler = _SkeletonPickler(skeleton)
    pickler.dump(obj)
    table, chunks, size = [], [], 0
    for tensor in pickler.tensors:
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        table.append((tensor.dtype, tuple(tensor.shape), size))
        chunks.append((size, data))
        size += -(-data.numel() // _ALIGN) * _ALIGN
    header = pickle.dumps((skeleton.getvalue(), table, size), protocol=pickle.HIGHEST_PROTOCOL)
    return Packed(header, chunks, size)


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self.tensors = tensors

    def persistent_load(self, index: int) -> torch.Tensor:
        return self.tensors[index]


def blob_size(header: bytes) -> int:
    return pickle.loads(header)[2]


def unpack(header: bytes, blob: torch.Tensor) -> object:
    """The object ``pack`` packed, its tensors views of ``blob`` (uint8, as packed)."""
    skeleton, table, size = pickle.loads(header)
    if blob.numel() != size:
        raise ValueError(f"an adapter's blob has {blob.numel()} bytes where its header says {size}")
    tensors = []
    for dtype, shape, offset in table:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        tensors.append(blob[offset:offset + nbytes].view(dtype).reshape(shape))
    return _SkeletonUnpickler(skeleton, tensors).load()


def read_file(path: str, size: int) -> torch.Tensor:
    """The blob in the file at path (removed once read, where this process may: rank 0
    removes it in any case)."""
    blob = torch.empty(size, dtype=torch.uint8)
    try:
        with open(path, "rb", buffering=0) as file:
            view, done = memoryview(blob.numpy()), 0
            while done < size:
                got = file.readinto(view[done:])
                if not got:
                    raise OSError(f"{path} ended after {done} of {size} bytes")
                done += got
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return blob


def remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


# each side's identity and directory


def host_identity() -> str:
    """This host, as a worker tells rank 0 (its name and the kernel's boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def send_at_once(conn: Connection) -> None:
    """Turn off Nagle's delay on conn where it is a TCP socket (rank 0's and the worker's ends):
    an inline part is two messages in a row, whose second would otherwise wait for the
    peer's delayed acknowledgement of the first (tens of milliseconds)."""
    fd = os.dup(conn.fileno())
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket
        os.close(fd)
        return
    with sock:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def default_shared_dir() -> str | None:
    """/dev/shm where it exists and this process may write there; else None (the connection)."""
    shm = SHARED_MEMORY_DIR
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


# rank 0's side


class PartRefused(RuntimeError):
    """The worker could not take a part sent over the connection itself (its reason)."""


FILE, CONNECTION, UNREADABLE = "file", "connection", "unreadable"  # how a part went (``settle``)


@dataclass
class InFlight:
    """A part sent and not yet acknowledged: rank 0 owns its file (path) until then."""

    key: int
    packed: Packed
    path: str | None  # the file it went as; None: over the connection


def post(conn: Connection, key: int, packed: Packed, directory: str | None) -> InFlight:
    """Send the worker the part packed under key, without waiting for it to be taken: as a file
    in directory when given (and the file can be written there), else over conn. OSError:
    conn broke (no file left)."""
    path = None
    if directory is not None:
        with contextlib.suppress(OSError):
            path = packed.write_file(directory)
    if path is None:
        _send_inline(conn, key, packed)
        return InFlight(key, packed, None)
    try:
        conn.send_bytes(pickle.dumps(("file", key, packed.header, path), protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException:
        remove_file(path)
        raise
    return InFlight(key, packed, path)


def settle(conn: Connection, flight: InFlight, wait_reply: Callable[[Connection], tuple]) -> str:
    """Wait for the worker to take a part posted; its file removed. Returns how the part went:
    FILE; CONNECTION; or UNREADABLE, sent again over conn after the worker could not read the
    file (it sees another filesystem). ``wait_reply``: conn's next message, waited for while
    watching the worker (it raises when the worker is gone). OSError or EOFError: conn broke;
    PartRefused: the worker could not take the part sent over conn."""
    try:
        reply = wait_reply(conn)
    finally:
        if flight.path is not None:
            remove_file(flight.path)
    if reply[0] == "ok":
        return CONNECTION if flight.path is None else FILE
    if flight.path is None:
        raise PartRefused(reply[2] if len(reply) > 2 else repr(reply))
    _send_inline(conn, flight.key, flight.packed)
    settle(conn, InFlight(flight.key, flight.packed, None), wait_reply)
    return UNREADABLE


def _send_inline(conn: Connection, key: int, packed: Packed) -> None:
    conn.send_bytes(pickle.dumps(("inline", key, packed.header), protocol=pickle.HIGHEST_PROTOCOL))
    conn.send_bytes(packed.blob().numpy())


# the worker's side


def receive(conn: Connection) -> tuple[int, object]:
    """The next part rank 0 sends (key, object), replying to each message: a file the worker
    cannot read (or has no memory to hold), or a part it cannot rebuild, is answered "failed"
    (rank 0 then sends the file's part inline, or gives up). EOFError or OSError: rank 0 is gone."""
    while True:
        kind, key, header, *path = pickle.loads(conn.recv_bytes())
        try:
            size = blob_size(header)
            blob = read_file(path[0], size) if kind == "file" else None
        except Exception as exc:  # noqa: BLE001 - unreadable, or no memory to hold it: rank 0 is told why
            conn.send(("failed", key, f"{type(exc).__name__}: {exc}"))
            continue
        try:
            part = unpack(header, _receive_blob(conn, size) if blob is None else blob)
        except (EOFError, OSError):
            raise
        except Exception as exc:  # any part that cannot be rebuilt: rank 0 is told why
            conn.send(("failed", key, f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", key))
        return key, part


def _receive_blob(conn: Connection, size: int) -> torch.Tensor:
    blob = torch.empty(size, dtype=torch.uint8)
    got = conn.recv_bytes_into(blob.numpy())
    if got != size:
        raise ValueError(f"an adapter's blob arrived with {got} bytes where its header says {size}")
    return blob


def wait_reply_within(conn: Connection, timeout_s: float, alive: Callable[[], None]) -> tuple:
    """conn's next message, calling ``alive`` (which raises when the worker is gone) meanwhile;
    TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(_REPLY_POLL_S):
        alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no reply within {timeout_s:.0f} s")
    return conn.recv()
