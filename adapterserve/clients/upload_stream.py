"""Turning an adapter directory into the UploadAdapter message stream.

Files at the top level and one directory down are sent (names starting with '.'
are skipped; symbolic links are read through, as in a Hugging Face cache). The
server decides what it accepts; the header declares sizes and sha256 so it can
refuse a too-large upload at once and detect a truncated one.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from adapterserve.proto import adapterserve_pb2 as pb

CHUNK_BYTES = 1 << 20
Progress = Callable[[int], None]  # called with the bytes just sent


@dataclass(frozen=True)
class LocalFile:
    path: str  # relative, '/'-separated
    source: Path
    size: int
    sha256: str


def collect_files(directory: str | Path) -> list[LocalFile]:
    """The files an upload of `directory` sends, with sizes and sha256."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{str(root)!r} is not a directory")
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        children = sorted(entry.iterdir()) if entry.is_dir() else [entry]
        found += [_local(root, f) for f in children if f.is_file() and not f.name.startswith(".")]
    return found


def _local(root: Path, file: Path) -> LocalFile:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
    return LocalFile(file.relative_to(root).as_posix(), file, file.stat().st_size, digest.hexdigest())


def upload_messages(
    name: str, files: list[LocalFile], *, public: bool = False, progress: Progress | None = None
) -> Iterator[pb.UploadAdapterRequest]:
    """The header, then each file in CHUNK_BYTES pieces."""
    entries = [pb.FileEntry(path=f.path, size=f.size, sha256=f.sha256) for f in files]
    yield pb.UploadAdapterRequest(header=pb.UploadHeader(name=name, public=public, files=entries))
    for f in files:
        offset = 0
        with open(f.source, "rb") as data:
            while block := data.read(CHUNK_BYTES):
                yield pb.UploadAdapterRequest(chunk=pb.FileChunk(path=f.path, offset=offset, data=block))
                offset += len(block)
                if progress:
                    progress(len(block))
