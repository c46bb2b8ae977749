"""Reading an adapter directory safely: which files are accepted, copying, hashing.

Accepted: the files an adapter family consists of (`ADAPTER_FILES`: PEFT's
`adapter_config.json` + `adapter_model.safetensors`, AdapterHub's `adapter.safetensors`
and head files) and a README / LICENSE / model card, at the top level, regular files
only. A config or a document is capped at `max_text_file_bytes`; the whole upload at
`max_total_bytes`. Entries whose name starts with '.' (`.cache/`, `.gitattributes`)
are skipped. Anything else (a pickle, a checkpoint, a tokenizer folder, a symbolic
link) is refused with its name, before any byte is copied.

The content hash is sha256 over, for each file in sorted path order,
`path + "\\0" + sha256(bytes).hexdigest() + "\\n"`.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from adapterserve.errors import AdapterError, AdapterIntegrityError, AdapterTooLarge

PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib"})
WEIGHT_FILES = frozenset({"adapter_model.safetensors", "adapter.safetensors", "model_head.safetensors"})
CONFIG_FILES = frozenset({"adapter_config.json", "head_config.json"})
ADAPTER_FILES = WEIGHT_FILES | CONFIG_FILES
_DOC = re.compile(r"(readme|license|licence|notice|model_card|modelcard)(\.(md|txt|rst))?", re.IGNORECASE)
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class StoreLimits:
    """What one upload may hold."""

    max_total_bytes: int = 2 << 30
    max_files: int = 32
    max_text_file_bytes: int = 1 << 20  # each config, README, LICENSE

    def __post_init__(self) -> None:
        if self.max_total_bytes < 1 or self.max_files < 1 or self.max_text_file_bytes < 1:
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


def check_upload_file(path: str, size: int, limits: StoreLimits) -> None:
    """Refuse a file an adapter upload may not hold (AdapterError naming it), or one over its cap."""
    if path not in ADAPTER_FILES and not _DOC.fullmatch(path):
        if Path(path).suffix.lower() in PICKLE_SUFFIXES:
            raise AdapterError(
                f"adapter file {path!r} is a pickle file, which is never loaded (loading it can run code); "
                "save the adapter as safetensors (PEFT: save_pretrained(dir, safe_serialization=True)) "
                "and leave the pickle out"
            )
        raise AdapterError(
            f"adapter file {path!r} is not part of an adapter: an upload holds only "
            f"{', '.join(sorted(ADAPTER_FILES))} and a README, LICENSE or model card at the top level; "
            "leave the other files out"
        )
    if path not in WEIGHT_FILES and size > limits.max_text_file_bytes:
        raise AdapterTooLarge(
            f"adapter file {path!r} is {size} bytes, over the limit of {limits.max_text_file_bytes} bytes "
            "for a config or document"
        )


def check_paths_distinct(paths: list[str]) -> None:
    """Refuse a file whose path is also a folder of another (`x` beside `x/y`)."""
    folders = {p.rsplit("/", 1)[0] for p in paths if "/" in p}
    if clash := sorted(folders & set(paths)):
        raise AdapterError(f"upload lists {clash[0]!r} both as a file and as a folder of other files")


def scan_source(src: Path, limits: StoreLimits) -> list[SourceFile]:
    """List the files an upload of `src` would store, refusing anything unsafe or too big."""
    if not src.is_dir():
        raise AdapterError(f"adapter directory {str(src)!r} does not exist or is not a directory")
    found: list[SourceFile] = []
    for entry in _entries(src):
        if entry.is_dir(follow_symlinks=False):
            _check_part(entry.name, entry.name + "/")
            raise AdapterError(
                f"adapter folder {entry.name + '/'!r} is not part of an adapter: an upload holds only files at "
                "the top level; leave the folder out"
            )
        found.append(_accept(src, entry))
        check_upload_file(found[-1].path, found[-1].size, limits)
        _check_limits(src, found, limits)
    if not found:
        raise AdapterError(f"adapter directory {str(src)!r} holds no files")
    return sorted(found, key=lambda f: f.path)


def _entries(directory: Path) -> list[os.DirEntry]:
    with os.scandir(directory) as it:
        return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)


def _accept(root: Path, entry: os.DirEntry) -> SourceFile:
    if entry.is_symlink():
        raise AdapterError(f"adapter file {entry.name!r} is a symbolic link; copy the real file into {str(root)!r}")
    if not entry.is_file(follow_symlinks=False):
        raise AdapterError(f"adapter entry {entry.name!r} is not a regular file")
    _check_part(entry.name, entry.name)
    return SourceFile(entry.name, entry.stat(follow_symlinks=False).st_size)


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


def remove_older_than(directory: Path, grace_s: float, only_prefix: str = "") -> None:
    """Remove entries of `directory` (whose name starts with `only_prefix`) untouched for `grace_s`."""
    for entry in directory.iterdir():
        if entry.name.startswith(only_prefix):
            remove_if_stale(entry, grace_s)


def remove_if_stale(entry: Path, grace_s: float) -> bool:
    """Remove `entry` (a file or a folder) if nothing in it changed for `grace_s`; True if removed."""
    try:
        if time.time() - _newest_mtime(entry) < grace_s:
            return False
    except FileNotFoundError:  # removed meanwhile
        return False
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)
    return not entry.exists()


def _newest_mtime(entry: Path) -> float:
    """The latest change to `entry` or anything under it (a staging copy still being written is fresh)."""
    newest = entry.lstat().st_mtime
    if entry.is_dir() and not entry.is_symlink():
        for f in entry.rglob("*"):
            newest = max(newest, f.lstat().st_mtime)
    return newest
