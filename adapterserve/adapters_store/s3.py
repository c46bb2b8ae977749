"""The adapter store in an S3-compatible bucket (AWS S3, MinIO, Ceph, R2, ...).

Credentials come from boto3's usual chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY,
profiles, instance roles); the endpoint from `endpoint_url` or AWS_ENDPOINT_URL_S3.
The manifest is created with `If-None-Match: *`, so the server must support
conditional writes (AWS S3 since 2024, MinIO, recent Ceph). `fetch` downloads
a version into `cache_dir/<content hash>/`, checks it, and reuses it afterwards;
the download cache holds at most `cache_bytes`, evicting the least recently
fetched versions (but none fetched in the last `cache_grace_s`: a reader may still
be opening its files). Publishes stage their copy in `cache_dir/.staging/`.
This is the store to share between servers and nodes: every server sees the
same bucket (bare names within its resolve TTL, `name@N` at once).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.adapters_store.staging import (
    StoreLimits,
    remove_older_than,
    verify_dir,
)
from adapterserve.adapters_store.store import AdapterStore, StoredObject
from adapterserve.errors import AccessDenied, AdapterNotFound

_MISSING = {"404", "NoSuchKey", "NotFound"}
_TAKEN = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}


class S3Store(AdapterStore):
    _io_faults = (OSError, BotoCoreError, ClientError)

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int = 8 << 30,
        cache_grace_s: float = 60.0,
        limits: StoreLimits | None = None,
        client: Any = None,
    ) -> None:
        super().__init__(limits)
        if cache_bytes < 1 or cache_grace_s < 0:
            raise ValueError(f"S3 cache_bytes must be positive and cache_grace_s >= 0, got {cache_bytes}, "
                             f"{cache_grace_s}")
        self.cache_bytes, self.cache_grace_s = cache_bytes, cache_grace_s
        self.url = url
        self.bucket, self._prefix = _parse_url(url)
        self._client = client or boto3.client(
            "s3", endpoint_url=endpoint_url, config=Config(retries={"mode": "standard", "max_attempts": 5})
        )
        self.cache_dir = Path(cache_dir) if cache_dir else _default_cache_dir()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._staging = self.cache_dir / ".staging"
        self._staging.mkdir(exist_ok=True)
        self._check_bucket()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    def _list(self, prefix: str) -> list[StoredObject]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        skip = len(self._prefix)
        return [
            StoredObject(o["Key"][skip:], o["LastModified"].timestamp())
            for page in pages
            for o in page.get("Contents", [])
        ]

    def _get(self, key: str) -> bytes | None:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as e:
            if _code(e) in _MISSING:
                return None
            raise

    def _put(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def _put_new(self, key: str, data: bytes) -> bool:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
            return True
        except ClientError as e:
            if _code(e) in _TAKEN:
                return False
            raise

    def _store_file(self, key: str, staged: Path) -> None:
        self._client.upload_file(str(staged), self.bucket, self._key(key))  # multipart when large

    def _delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # the API takes at most 1000 per call
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            reply = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if errors := reply.get("Errors"):
                raise RuntimeError(f"could not delete {len(errors)} objects from {self.url}: {errors[0]}")

    def _materialize(self, v: AdapterVersion, prefix: str) -> Path:
        target = self.cache_dir / v.content_hash
        if target.is_dir():  # complete and checked: it was renamed into place only after that
            os.utime(target)  # its last use, for eviction
            return target
        self._download_all(v, prefix, target)
        evict_download_cache(self.cache_dir, self.cache_bytes, self.cache_grace_s, keep=target)
        return target

    def _download_all(self, v: AdapterVersion, prefix: str, target: Path) -> None:
        partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=self.cache_dir))
        try:
            for path in v.files:
                self._download(v, prefix + path, partial / path)
            verify_dir(partial, v.ref, dict(v.file_sha256), v.content_hash)
            os.replace(partial, target)
        except OSError:
            if not target.is_dir():  # another thread put it in place first: use that
                raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    def _staging_root(self) -> Path:
        return self._staging

    def _gc_staging(self, grace_s: float) -> None:
        remove_older_than(self._staging, grace_s)
        remove_older_than(self.cache_dir, grace_s, only_prefix=".partial-")

    def _download(self, v: AdapterVersion, key: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._client.download_file(self.bucket, self._key(key), str(dest))
        except ClientError as e:
            if _code(e) in _MISSING:
                raise AdapterNotFound(
                    f"the files of {v.ref} are no longer stored (deleted, then removed by gc)"
                ) from e
            raise

    def _check_bucket(self) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if _code(e) in _MISSING | {"NoSuchBucket"}:
                raise ValueError(f"S3 bucket {self.bucket!r} does not exist at this endpoint; create it first") from e
            if _code(e) in {"403", "AccessDenied"}:
                raise AccessDenied(f"no access to S3 bucket {self.bucket!r}; check the AWS credentials") from e
            raise

    def _key(self, key: str) -> str:
        return self._prefix + key


def evict_download_cache(cache_dir: Path, capacity_bytes: int, grace_s: float, keep: Path) -> list[Path]:
    """Remove cached versions, least recently used first, until at most `capacity_bytes` remain;
    never `keep` or one used in the last `grace_s`. Returns the removed directories."""
    entries = []
    for entry in cache_dir.iterdir():
        if entry.name.startswith(".") or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            entries.append((entry.stat().st_mtime, _dir_bytes(entry), entry))
        except FileNotFoundError:  # evicted by another thread meanwhile
            continue
    total, removed, now = sum(size for _, size, _ in entries), [], time.time()
    for used, size, entry in sorted(entries):
        if total <= capacity_bytes:
            break
        if entry == keep or now - used < grace_s:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        total -= size
        removed.append(entry)
    return removed


def _dir_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _parse_url(url: str) -> tuple[str, str]:
    """'s3://bucket/some/prefix' -> ('bucket', 'some/prefix/')."""
    scheme, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    if scheme != "s3" or not bucket:
        raise ValueError(f"S3 store URL {url!r} is invalid: use s3://bucket or s3://bucket/prefix")
    prefix = prefix.strip("/")
    return bucket, prefix + "/" if prefix else ""


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "adapterserve" / "s3"


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))
