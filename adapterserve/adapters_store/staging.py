"""Reading an adapter directory safely: which files are accepted, copying, hashing.

Accepted: regular files at the top level or one directory down (for example
`adapter_config.json`, `adapter_model.safetensors`, `tokenizer/tokenizer.json`).
Entries whose name starts with '.' (`.cache/`, `.gitattributes`) are skipped.
Refused: symbolic links, deeper directories, pickle files (`.bin`, `.pt`, ...),
special files, names outside [A-Za-z0-9._+-], and uploads over the size limits.

The content hash is sha256 over, for each file in sorted path order,
`path + "\\0" + sha256(bytes).hexdigest() + "\\n"`.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from adapterserve.errors import AdapterError, AdapterIntegrityError, AdapterTooLarge

PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib"})
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class StoreLimits:
    """What one upload may hold."""

    max_total_bytes: int = 2 << 30
    max_files: int = 32

    def __post_init__(self) -> None:
        if self.max_total_bytes < 1 or self.max_files < 1:
            raise ValueError(f"store limits must be positive, got {self}")


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative, '/'-separated
    size: int


@dataclass(frozen=True)
class StagedFile:
    path: str
    size: int
    sha256: str


def scan_source(src: Path, limits: StoreLimits) -> list[SourceFile]:
    """List the files an upload of `src` would store, refusing anything unsafe or too big."""
    if not src.is_dir():
        raise AdapterError(f"adapter directory {str(src)!r} does not exist or is not a directory")
    found: list[SourceFile] = []
    for entry in _entries(src):
        if entry.is_dir(follow_symlinks=False):
            _check_part(entry.name, entry.name + "/")
            found += [_accept(src, sub, f"{entry.name}/") for sub in _entries(Path(entry.path), nested=True)]
        else:
            found.append(_accept(src, entry, ""))
        _check_limits(src, found, limits)
    if not found:
        raise AdapterError(f"adapter directory {str(src)!r} holds no files")
    return sorted(found, key=lambda f: f.path)


def _entries(directory: Path, nested: bool = False) -> list[os.DirEntry]:
    with os.scandir(directory) as it:
        entries = sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    for e in entries:
        if nested and e.is_dir(follow_symlinks=False):
            raise AdapterError(
                f"{e.path!r} is a directory two levels down; adapters may hold files at most one directory deep"
            )
    return entries


def _accept(root: Path, entry: os.DirEntry, prefix: str) -> SourceFile:
    rel = prefix + entry.name
    if entry.is_symlink():
        raise AdapterError(f"adapter file {rel!r} is a symbolic link; copy the real file into {str(root)!r}")
    if not entry.is_file(follow_symlinks=False):
        raise AdapterError(f"adapter entry {rel!r} is not a regular file")
    _check_part(entry.name, rel)
    if Path(entry.name).suffix.lower() in PICKLE_SUFFIXES:
        raise AdapterError(
            f"adapter file {rel!r} is a pickle file, which is never loaded (loading it can run code); "
            "save the adapter as safetensors (PEFT: save_pretrained(dir, safe_serialization=True)) "
            "and leave the pickle out"
        )
    return SourceFile(rel, entry.stat(follow_symlinks=False).st_size)


def _check_part(part: str, rel: str) -> None:
    if not _PART.fullmatch(part):
        raise AdapterError(f"adapter file name {rel!r} is not accepted: use letters, digits, '.', '_', '+' or '-'")


def _check_limits(src: Path, files: list[SourceFile], limits: StoreLimits) -> None:
    if len(files) > limits.max_files:
        raise AdapterTooLarge(
            f"adapter directory {str(src)!r} holds more than {limits.max_files} files, the store's limit"
        )
    total = sum(f.size for f in files)
    if total > limits.max_total_bytes:
        raise AdapterTooLarge(
            f"adapter directory {str(src)!r} holds at least {total} bytes, over the store's limit "
            f"of {limits.max_total_bytes} bytes"
        )


def stage_copy(src: Path, files: list[SourceFile], dest: Path, limits: StoreLimits) -> list[StagedFile]:
    """Copy `files` from `src` into `dest`, hashing as it goes; the size limit holds even if files grow."""
    staged, total = [], 0
    for f in files:
        target = dest / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size = _copy_file(src / f.path, target, limits.max_total_bytes - total, f.path)
        total += size
        staged.append(StagedFile(f.path, size, digest))
    return staged


def _copy_file(src: Path, dst: Path, budget: int, rel: str) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    fd = os.open(src, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # a file swapped for a link is refused
    with os.fdopen(fd, "rb") as fin, open(dst, "wb") as fout:
        if not stat.S_ISREG(os.fstat(fin.fileno()).st_mode):
            raise AdapterError(f"adapter file {rel!r} is not a regular file")
        while chunk := fin.read(_CHUNK):
            size += len(chunk)
            if size > budget:
                raise AdapterTooLarge(f"adapter file {rel!r} grew while copying; the upload is over the size limit")
            h.update(chunk)
            fout.write(chunk)
    return h.hexdigest(), size


def content_hash(files: list[StagedFile]) -> str:
    """sha256 over the sorted file paths and their bytes (via each file's own sha256)."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        h.update(f"{f.path}\0{f.sha256}\n".encode())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fin:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_dir(directory: Path, ref: str, expected: dict[str, str], expected_hash: str) -> None:
    """Check that `directory` holds exactly the published bytes of `ref`."""
    for path, want in expected.items():
        p = directory / path
        got = file_sha256(p) if p.is_file() else "missing"
        if got != want:
            raise AdapterIntegrityError(
                f"stored file {path!r} of {ref} does not match its recorded sha256 ({got} != {want}); "
                "the store copy is damaged: publish the adapter again"
            )
    if content_hash([StagedFile(p, 0, d) for p, d in expected.items()]) != expected_hash:
        raise AdapterIntegrityError(f"stored files of {ref} do not match content hash {expected_hash}")
