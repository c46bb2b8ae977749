"""Adapter store: immutable, numbered adapter versions in a directory or an S3 bucket.

Layout (keys relative to the store root; the same for both backends):

    meta/<name>/<N>.json       manifest of version N, written last and exactly once
    meta/<name>/<N>.deleted    tombstone: version N is deleted
    data/<name>/<hash>/<file>  the files, keyed by content hash

Publishing copies the upload into a local staging directory (refusing unsafe
files, enforcing the size limits, hashing), runs the validator on that copy,
uploads the files under `data/`, and then creates the manifest with an atomic
create-if-absent (a hard link locally, `If-None-Match: *` on S3). Until the
manifest exists nothing is visible, so an interrupted publish leaves only
unreferenced data, which `gc` removes. Two publishers racing for version N:
one wins, the other retries with N+1. Republishing the newest version's exact
content (and visibility) returns that version instead of a new one.

Versions are numbered 1, 2, ... per name and never reused, even after delete,
so `name@N` always meant one content. `name` alone resolves to the newest
version the tenant may use.

Deleting is two-phase, because a version in use must finish its requests:
`delete` writes tombstones, and from then on `resolve`, `describe` and `list`
no longer see the version; its files stay, so a server that resolved it earlier
can still `fetch` it. `gc(grace_s=...)` removes the files of versions deleted
more than `grace_s` ago (and leftovers of interrupted publishes as old). A
server runs `gc` periodically with a grace longer than its longest request
(and upload); it may also call `gc(grace_s=0)` when its refcount for a deleted
version drops to zero and it is the only server on this store. Manifests and
tombstones are kept, which is what keeps version numbers and name ownership.

Tenancy: a name belongs to the tenant that first published it, for good
(like a package index: nobody else can take over a name that clients still
reference). Another tenant publishing that name gets AccessDenied. A tenant
sees and uses its own versions and public ones; only the owner deletes. Another
tenant's private versions look like none at all: resolve, describe and delete
answer AdapterNotFound with the message a name nobody has gets. Tenant None is
open mode (no API keys configured) and admin keys: it sees, publishes and deletes
everything, and names it creates have no owner, so once keys are configured
tenants see those only if they are public. `publish(quotas=...)` refuses a version
over the tenant's quotas (usage.py) before anything is stored.

Resolving a bare `name` lists `meta/<name>/` (the ingress caches resolutions:
server/resolutions.py); `name@N` reads its manifest and tombstone directly, so no
resolution lists the whole store. A manifest that cannot be read is
logged and skipped: the other adapters stay usable. A store fault (read-only or
full disk, unreachable bucket) raises StoreUnavailable naming no paths; the
server log has the details.

Calls block on I/O; async servers call them through `asyncio.to_thread`. A
store object is safe to share between threads.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from adapterserve.adapters_store.lookup import (
    Record,
    can_use,
    check_may_delete,
    exact,
    live,
    newest_usable,
    owner_for_publish,
    same_as_newest,
)
from adapterserve.adapters_store.records import (
    AdapterVersion,
    check_name,
    from_manifest,
    parse_ref,
    to_manifest,
)
from adapterserve.adapters_store.staging import (
    StagedFile,
    StoreLimits,
    content_hash,
    scan_source,
    stage_copy,
)
from adapterserve.adapters_store.tenants import Quotas
from adapterserve.adapters_store.usage import StoreUsage, check_publish, usage_of
from adapterserve.errors import (
    AccessDenied,
    AdapterIntegrityError,
    AdapterNotFound,
    StoreUnavailable,
)

logger = logging.getLogger("adapterserve.store")
Validator = Callable[[Path], Mapping[str, Any]]
_COMMIT_ATTEMPTS = 8
_HINT_NAMES = 20


class StoredObject(NamedTuple):
    key: str
    mtime: float  # seconds since the epoch


def _faults_unavailable(method: Callable) -> Callable:
    """Turn a backend's I/O fault inside `method` into StoreUnavailable (details in the log)."""

    @functools.wraps(method)
    def wrapped(self: AdapterStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except AccessDenied:
            raise
        except self._io_faults as e:
            logger.exception("adapter store %r failed in %s: %s", self, method.__name__, e)
            raise StoreUnavailable(
                f"the adapter store cannot {_VERBS.get(method.__name__, 'answer')} now (it is read-only, full or "
                "unreachable); retry later, and tell the operator if it persists"
            ) from None

    return wrapped


_VERBS = {"publish": "store this adapter", "delete": "record this delete", "fetch": "read this adapter"}


class AdapterStore(ABC):
    """The store's operations, written once over a few backend primitives."""

    _io_faults: tuple[type[BaseException], ...] = (OSError,)  # backend errors that mean "store unavailable"

    def __init__(self, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        self._manifests: dict[str, AdapterVersion] = {}  # manifests never change: cache them
        self._unreadable: set[str] = set()  # manifests already reported as unreadable

    # --- backend primitives -------------------------------------------------

    @abstractmethod
    def _list(self, prefix: str) -> list[StoredObject]:
        """Objects whose key starts with `prefix` ('' or ending in '/')."""

    @abstractmethod
    def _get(self, key: str) -> bytes | None:
        """An object's bytes, or None if it does not exist."""

    @abstractmethod
    def _put(self, key: str, data: bytes) -> None:
        """Write an object (replacing any)."""

    @abstractmethod
    def _put_new(self, key: str, data: bytes) -> bool:
        """Create an object atomically; False (and nothing written) if it already exists."""

    @abstractmethod
    def _store_file(self, key: str, staged: Path) -> None:
        """Store a staged local file under `key`; the staged file may be moved away."""

    @abstractmethod
    def _delete(self, keys: list[str]) -> None:
        """Remove objects; missing ones are ignored."""

    @abstractmethod
    def _materialize(self, v: AdapterVersion, prefix: str) -> Path:
        """A local directory with the verified files under `prefix`; AdapterNotFound if gone."""

    def _staging_root(self) -> Path | None:
        """Where publish stages its local copy (None: the system temp dir)."""
        return None

    def _gc_staging(self, grace_s: float) -> None:
        """Remove local staging leftovers older than `grace_s` (backends that have any)."""

    # --- public API ---------------------------------------------------------

    @_faults_unavailable
    def publish(
        self,
        name: str,
        src_dir: str | os.PathLike,
        *,
        tenant: str | None,
        public: bool = False,
        validator: Validator | None = None,
        quotas: Quotas | None = None,
    ) -> AdapterVersion:
        """Store the adapter in `src_dir` as the next version of `name` (or return the
        newest version if it has the same content and visibility). `quotas`: the tenant's,
        checked before anything is stored (QuotaExceeded)."""
        check_name(name)
        owner_for_publish(name, self._records(name), tenant)
        src = Path(src_dir)
        files = scan_source(src, self.limits)
        with tempfile.TemporaryDirectory(prefix="publish-", dir=self._staging_root()) as tmp:
            staged = stage_copy(src, files, Path(tmp), self.limits)
            digest = content_hash(staged)
            if same := same_as_newest(self._records(name), digest, public):
                return same
            if quotas is not None and tenant is not None:
                check_publish(name, tenant, quotas, self.usage(tenant), sum(f.size for f in staged))
            info = _run_validator(validator, Path(tmp))
            for f in staged:
                self._store_file(_data_prefix(name, digest) + f.path, Path(tmp) / f.path)
            return self._commit(_draft(name, tenant, public, digest, staged, info))

    @_faults_unavailable
    def resolve(self, ref: str, *, tenant: str | None) -> AdapterVersion:
        """`name@N` exactly (read directly), or `name` as its newest version this tenant may use."""
        name, number = parse_ref(ref)
        record = self._record(name, number) if number is not None else None
        if record and record.deleted_at is None and can_use(record.version, tenant):
            return record.version
        records = _usable(self._records(name), tenant)
        if not records:
            raise AdapterNotFound(f"no adapter named {name!r}; {self._names_hint(tenant)}")
        if number is None:
            return newest_usable(name, records, tenant)
        return exact(name, number, records, tenant)

    def describe(self, ref: str, *, tenant: str | None) -> AdapterVersion:
        """The record of one version (same lookup as `resolve`)."""
        return self.resolve(ref, tenant=tenant)

    @_faults_unavailable
    def list(self, *, tenant: str | None, name: str | None = None) -> list[AdapterVersion]:
        """Every live version this tenant may use (of one name if given), by name then version."""
        groups = {name: self._records(check_name(name))} if name else self._all_records()
        found = [r.version for rs in groups.values() for r in rs if r.deleted_at is None]
        return sorted((v for v in found if can_use(v, tenant)), key=lambda v: (v.name, v.version))

    @_faults_unavailable
    def delete(self, name: str, version: int | None = None, *, tenant: str | None) -> list[AdapterVersion]:
        """Tombstone one version (or every live one): gone for resolve/list at once; files stay until `gc`."""
        records = _usable(self._records(check_name(name)), tenant)
        if not records:
            raise AdapterNotFound(f"no adapter named {name!r}; {self._names_hint(tenant)}")
        check_may_delete(name, records, tenant)
        targets = live(records) if version is None else [exact(name, version, records, tenant)]
        if not targets:
            raise AdapterNotFound(f"adapter {name!r} has no live versions left to delete")
        stamp = json.dumps({"deleted_at": datetime.now(timezone.utc).isoformat(), "by": tenant}).encode()
        for v in targets:
            self._put(_meta_key(name, v.version, "deleted"), stamp)
        return targets

    @_faults_unavailable
    def usage(self, tenant: str | None) -> StoreUsage:
        """What `tenant` holds: bytes, adapter names and versions of its live versions."""
        return usage_of(self._all_records(), tenant)

    @_faults_unavailable
    def usages(self, tenants: list[str]) -> dict[str, StoreUsage]:
        """`usage` of each of `tenants`, from one listing."""
        groups = self._all_records()
        return {t: usage_of(groups, t) for t in tenants}

    @_faults_unavailable
    def fetch(self, version: AdapterVersion) -> Path:
        """A local directory holding `version`'s files, checked against its content hash.

        Works for a deleted version until `gc` removes its files."""
        return self._materialize(version, _data_prefix(version.name, version.content_hash))

    @_faults_unavailable
    def gc(self, *, grace_s: float = 3600.0) -> int:
        """Remove files of versions deleted over `grace_s` ago and leftovers of interrupted
        publishes as old; returns how many file sets were removed."""
        now = time.time()
        records = [r for rs in self._all_records().values() for r in rs]
        keep = {
            _data_prefix(r.version.name, r.version.content_hash)
            for r in records
            if r.deleted_at is None or now - r.deleted_at < grace_s
        }
        removed = 0
        for prefix, objects in _group_data(self._list("data/")).items():
            if prefix not in keep and now - max(o.mtime for o in objects) >= grace_s:
                self._delete([o.key for o in objects])
                removed += 1
        self._gc_staging(grace_s)
        return removed

    @_faults_unavailable
    def clean_staging(self, *, grace_s: float) -> None:
        """Remove what publishes interrupted by a crash left in local staging, older than `grace_s`."""
        self._gc_staging(grace_s)

    # --- internals ----------------------------------------------------------

    def _commit(self, draft: AdapterVersion) -> AdapterVersion:
        """Write the manifest as the next free version number; the manifest makes it visible."""
        for _ in range(_COMMIT_ATTEMPTS):
            records = self._records(draft.name)
            if same := same_as_newest(records, draft.content_hash, draft.public):
                return same
            owner = owner_for_publish(draft.name, records, draft.tenant)
            number = self._newest_number(draft.name) + 1
            v = replace(draft, version=number, tenant=owner)
            key = _meta_key(v.name, number, "json")
            if self._put_new(key, to_manifest(v)):
                self._manifests[key] = v
                return v
        raise RuntimeError(
            f"publishing {draft.name!r} lost the race for a version number {_COMMIT_ATTEMPTS} times "
            "to concurrent publishes; try again"
        )

    def _records(self, name: str) -> list[Record]:
        return self._scan(f"meta/{name}/").get(name, [])

    def _record(self, name: str, number: int) -> Record | None:
        """Version `number` of `name` from its manifest and tombstone (no listing); None if absent."""
        version = self._manifest(_meta_key(name, number, "json"))
        if version is None:
            return None
        tombstone = self._get(_meta_key(name, number, "deleted"))
        return Record(version, None if tombstone is None else _deleted_at(tombstone))

    def _newest_number(self, name: str) -> int:
        """The highest version number taken (unreadable manifests count: numbers are never reused)."""
        parsed = (_parse_meta_key(o.key) for o in self._list(f"meta/{name}/"))
        return max((p[1] for p in parsed if p and p[0] == name), default=0)

    def _all_records(self) -> dict[str, list[Record]]:
        return self._scan("meta/")

    def _scan(self, prefix: str) -> dict[str, list[Record]]:
        manifests, tombstones = {}, {}
        for obj in self._list(prefix):
            parsed = _parse_meta_key(obj.key)
            if parsed and parsed[2] == "json":
                manifests[parsed[:2]] = obj.key
            elif parsed:
                tombstones[parsed[:2]] = obj.mtime
        groups: dict[str, list[Record]] = {}
        for ident, key in sorted(manifests.items()):
            if v := self._manifest(key):
                groups.setdefault(ident[0], []).append(Record(v, tombstones.get(ident)))
        return groups

    def _manifest(self, key: str) -> AdapterVersion | None:
        """The manifest at `key`; None if absent or unreadable (logged once, then skipped)."""
        if key not in self._manifests:
            data = self._get(key)
            if data is None:
                return None
            try:
                self._manifests[key] = from_manifest(data, key)
            except AdapterIntegrityError as e:
                if key not in self._unreadable:
                    self._unreadable.add(key)
                    logger.error("skipping adapter manifest in %r: %s", self, e)
                return None
        return self._manifests[key]

    def _names_hint(self, tenant: str | None) -> str:
        names = sorted({v.name for v in self.list(tenant=tenant)})
        if not names:
            return "no adapters are stored that you can use; publish one first (adapterserve upload DIR --name NAME)"
        more = f" and {len(names) - _HINT_NAMES} more" if len(names) > _HINT_NAMES else ""
        return "adapters you can use: " + ", ".join(names[:_HINT_NAMES]) + more


def _usable(records: list[Record], tenant: str | None) -> list[Record]:
    """The records `tenant` may see: another tenant's private versions look like no version at
    all (NOT_FOUND with the same message as a name nobody has, never PERMISSION_DENIED)."""
    return [r for r in records if can_use(r.version, tenant)]


def _run_validator(validator: Validator | None, staged_dir: Path) -> dict[str, Any]:
    info = dict(validator(staged_dir)) if validator else {}
    json.dumps(info)  # a result the manifest cannot hold fails here, before anything is stored
    return info


def _draft(
    name: str, tenant: str | None, public: bool, digest: str, staged: list[StagedFile], info: dict[str, Any]
) -> AdapterVersion:
    """The version to commit; its number and owner are filled in by `_commit`."""
    return AdapterVersion(
        name=name,
        version=0,
        content_hash=digest,
        tenant=tenant,
        public=public,
        created_at=datetime.now(timezone.utc),
        size_bytes=sum(f.size for f in staged),
        files=tuple(f.path for f in staged),
        info=info,
        file_sha256={f.path: f.sha256 for f in staged},
    )


def _deleted_at(tombstone: bytes) -> float:
    """A tombstone's time (seconds since the epoch); now if it cannot be read (it still deletes)."""
    try:
        return datetime.fromisoformat(json.loads(tombstone)["deleted_at"]).timestamp()
    except (ValueError, KeyError, TypeError):
        return time.time()


def _meta_key(name: str, number: int, kind: str) -> str:
    return f"meta/{name}/{number}.{kind}"


def _parse_meta_key(key: str) -> tuple[str, int, str] | None:
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "meta":
        return None
    number, _, kind = parts[2].partition(".")
    if not number.isdigit() or kind not in ("json", "deleted"):
        return None
    return parts[1], int(number), kind


def _data_prefix(name: str, digest: str) -> str:
    return f"data/{name}/{digest}/"


def _group_data(objects: list[StoredObject]) -> dict[str, list[StoredObject]]:
    groups: dict[str, list[StoredObject]] = {}
    for o in objects:
        parts = o.key.split("/")
        if len(parts) >= 4:
            groups.setdefault("/".join(parts[:3]) + "/", []).append(o)
    return groups


def open_store(url_or_path: str | os.PathLike, **options: Any) -> AdapterStore:
    """`s3://bucket/prefix` -> S3Store; a directory path or `file://` URL -> LocalStore.

    `options` go to the backend (`limits`, and for S3 `endpoint_url`, `cache_dir`, ...)."""
    target = os.fspath(url_or_path)
    scheme, sep, rest = target.partition("://")
    if not sep:
        from adapterserve.adapters_store.local import LocalStore

        return LocalStore(target, **options)
    if scheme == "file":
        from adapterserve.adapters_store.local import LocalStore

        return LocalStore(rest, **options)
    if scheme == "s3":
        from adapterserve.adapters_store.s3 import S3Store

        return S3Store(target, **options)
    raise ValueError(f"unsupported adapter store {target!r}: use a directory path or s3://bucket/prefix")
