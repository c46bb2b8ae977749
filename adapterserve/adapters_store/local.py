"""The adapter store in a local directory (the default, one machine).

Objects are files under `root`; `root/.tmp/` holds staging copies and
half-written objects. Atomic create is a hard link (fails if the manifest
exists); replacements go through `os.replace`. `fetch` returns the stored
directory itself, after checking it against the content hash: treat it as
read-only.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.adapters_store.staging import StoreLimits, remove_older_than, verify_dir
from adapterserve.adapters_store.store import AdapterStore, StoredObject
from adapterserve.errors import AdapterNotFound


class LocalStore(AdapterStore):
    def __init__(self, root_dir: str | os.PathLike, *, limits: StoreLimits | None = None) -> None:
        super().__init__(limits)
        self.root = Path(root_dir).expanduser().absolute()
        self._tmp = self.root / ".tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _list(self, prefix: str) -> list[StoredObject]:
        found = []
        for dirpath, _, filenames in os.walk(self.root / prefix):
            for f in filenames:
                path = Path(dirpath, f)
                try:
                    mtime = path.stat().st_mtime
                except FileNotFoundError:  # removed while we walked
                    continue
                found.append(StoredObject(path.relative_to(self.root).as_posix(), mtime))
        return found

    def _get(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def _put(self, key: str, data: bytes) -> None:
        tmp = self._write_tmp(data)
        self._place(key, lambda target: os.replace(tmp, target))

    def _put_new(self, key: str, data: bytes) -> bool:
        tmp = self._write_tmp(data)
        try:
            self._place(key, lambda target: os.link(tmp, target))
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def _store_file(self, key: str, staged: Path) -> None:
        self._place(key, lambda target: os.replace(staged, target))

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            (self.root / key).unlink(missing_ok=True)
            self._prune_dirs((self.root / key).parent)

    def _materialize(self, v: AdapterVersion, prefix: str) -> Path:
        directory = self.root / prefix
        if not directory.is_dir():
            raise AdapterNotFound(f"the files of {v.ref} are no longer stored (deleted, then removed by gc)")
        verify_dir(directory, v.ref, dict(v.file_sha256), v.content_hash)
        return directory

    def _staging_root(self) -> Path:
        return self._tmp

    def _gc_staging(self, grace_s: float) -> None:
        remove_older_than(self._tmp, grace_s)

    def _write_tmp(self, data: bytes) -> str:
        fd, tmp = tempfile.mkstemp(dir=self._tmp, prefix="obj-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _place(self, key: str, move: Callable[[Path], None]) -> None:
        """Run `move(target)` after creating the target's folder (again, if gc pruned it meanwhile)."""
        target = self.root / key
        for attempt in range(3):
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                return move(target)
            except FileNotFoundError:
                if attempt == 2:
                    raise

    def _prune_dirs(self, directory: Path) -> None:
        """Remove empty folders left by deletes, up to (not including) the top-level ones."""
        while directory.parent != self.root and directory != self.root:
            try:
                directory.rmdir()
            except OSError:  # not empty, or already gone
                return
            directory = directory.parent
