"""Receiving an adapter upload: a header, then every file's bytes in chunks.

The header declares each file's path, size and sha256, so an upload over the
store's limits is refused before any byte is written, and a truncated or
corrupted transfer is caught before the store sees it. Files land in a
temporary directory (`upload_dir`) that the caller publishes; it is removed on
every way out (an error, a cancelled stream), and `remove_stale_uploads` removes
at start what a crashed server left: only folders marked as ours, untouched for a
while (another server on the host may be receiving one).
"""
from __future__ import annotations

import hashlib
import logging
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapterserve.adapters_store.records import check_name
from adapterserve.adapters_store.staging import (
    StoreLimits,
    check_paths_distinct,
    check_upload_file,
    remove_if_stale,
)
from adapterserve.errors import (
    AccessDenied,
    AdapterError,
    AdapterTooLarge,
    RequestError,
    StoreUnavailable,
    Unauthenticated,
)
from adapterserve.proto import adapterserve_pb2 as pb
from adapterserve.server.grpc_services import refuse_undecodable

_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
UPLOAD_PREFIX = "adapterserve-upload-"
_MARKER = ".adapterserve-upload"  # in every folder we made (an upload's paths never start with '.')
logger = logging.getLogger("adapterserve.server")


@contextmanager
def upload_dir(parent: str | Path | None = None) -> Iterator[Path]:
    """A fresh marked folder for one upload, removed however the block ends; a local disk
    fault (full, read-only) inside the block becomes StoreUnavailable, its path only logged."""
    path = Path(tempfile.mkdtemp(prefix=UPLOAD_PREFIX, dir=parent))
    try:
        (path / _MARKER).touch()
        yield path
    except (AccessDenied, Unauthenticated):  # ours, though PermissionErrors: they pass through
        raise
    except OSError:
        logger.exception("receiving an upload in %s failed", path)
        raise StoreUnavailable("the server cannot receive this upload now (its disk is full or read-only); "
                               "retry later, and tell the operator if it persists") from None
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_uploads(grace_s: float, parent: str | Path | None = None) -> int:
    """Remove our upload folders (marked) untouched for `grace_s`: what a crash left. Returns how many."""
    root = Path(parent or tempfile.gettempdir())
    stale = [p for p in root.glob(UPLOAD_PREFIX + "*")
             if p.is_dir() and not p.is_symlink() and (p / _MARKER).is_file()]
    return sum(remove_if_stale(path, grace_s) for path in stale)


@dataclass
class _File:
    path: str
    size: int
    sha256: str
    received: int = 0
    digest: Any = field(default_factory=hashlib.sha256)


async def receive_upload(
    messages: AsyncIterator[pb.UploadAdapterRequest], dest: Path, limits: StoreLimits
) -> pb.UploadHeader:
    """Write the upload's files under `dest`; return its header once every file is complete."""
    first = await anext(messages, None)
    refuse_undecodable(first)
    if first is None or first.WhichOneof("part") != "header":
        raise RequestError("an upload starts with a header message (name and file list)")
    header = first.header
    files = _check_header(header, limits)
    for path in files:
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).touch()
    async for message in messages:
        refuse_undecodable(message)
        if message.WhichOneof("part") != "chunk":
            raise RequestError("only file chunks may follow the upload header")
        _write(dest, files, message.chunk)
    _check_complete(header.name, files)
    return header


def _check_header(header: pb.UploadHeader, limits: StoreLimits) -> dict[str, _File]:
    check_name(header.name)
    if not header.files:
        raise AdapterError(f"upload of {header.name!r} lists no files")
    if len(header.files) > limits.max_files:
        raise AdapterTooLarge(
            f"upload of {header.name!r} has {len(header.files)} files; this server takes at most {limits.max_files}"
        )
    check_paths_distinct([entry.path for entry in header.files])
    files: dict[str, _File] = {}
    for entry in header.files:
        _check_path(entry.path)
        if entry.path in files:
            raise RequestError(f"upload lists file {entry.path!r} twice")
        check_upload_file(entry.path, entry.size, limits)
        if not re.fullmatch(r"[0-9a-f]{64}", entry.sha256):
            raise RequestError(f"upload gives no valid sha256 for {entry.path!r} (64 lowercase hex digits)")
        files[entry.path] = _File(entry.path, entry.size, entry.sha256)
    total = sum(f.size for f in header.files)
    if total > limits.max_total_bytes:
        raise AdapterTooLarge(
            f"upload of {header.name!r} is {total} bytes, over this server's limit of {limits.max_total_bytes} bytes"
        )
    return files


def _check_path(path: str) -> None:
    parts = path.split("/")
    if len(parts) > 2 or not all(_PART.fullmatch(p) for p in parts):
        raise AdapterError(
            f"upload file path {path!r} is not accepted: use at most one directory level and names of "
            "letters, digits, '.', '_', '+' or '-' (not starting with '.')"
        )


def _write(dest: Path, files: dict[str, _File], chunk: pb.FileChunk) -> None:
    f = files.get(chunk.path)
    if f is None:
        raise RequestError(f"upload sent bytes for {chunk.path!r}, which its header does not list")
    if chunk.offset != f.received:
        raise RequestError(f"upload of {chunk.path!r} skipped or repeated bytes: offset {chunk.offset}, "
                           f"expected {f.received}")
    if f.received + len(chunk.data) > f.size:
        raise AdapterTooLarge(f"upload sent more than the declared {f.size} bytes for {chunk.path!r}")
    with open(dest / chunk.path, "ab") as out:
        out.write(chunk.data)
    f.received += len(chunk.data)
    f.digest.update(chunk.data)


def _check_complete(name: str, files: dict[str, _File]) -> None:
    for f in files.values():
        if f.received != f.size:
            raise AdapterError(
                f"upload of {name!r} is truncated: {f.path!r} arrived with {f.received} of {f.size} bytes; "
                "upload it again"
            )
        if f.digest.hexdigest() != f.sha256:
            raise AdapterError(f"upload of {name!r}: {f.path!r} does not match its sha256; upload it again")
