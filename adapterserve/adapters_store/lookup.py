"""Who may see, use, publish and delete which version, and how a ref picks one.

Pure functions over the records of one name (its versions, oldest first, each
with its tombstone time if deleted). The rules themselves are described in
`store.py`'s module docstring.
"""
from __future__ import annotations

from dataclasses import dataclass

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.errors import AccessDenied, AdapterNotFound


@dataclass(frozen=True)
class Record:
    version: AdapterVersion
    deleted_at: float | None  # tombstone time (seconds since the epoch), None while live


def can_use(v: AdapterVersion, tenant: str | None) -> bool:
    """Open mode sees everything; a tenant sees its own versions and public ones."""
    return tenant is None or v.public or v.tenant == tenant


def live(records: list[Record]) -> list[AdapterVersion]:
    return [r.version for r in records if r.deleted_at is None]


def owner_for_publish(name: str, records: list[Record], tenant: str | None) -> str | None:
    """The owner a new version of `name` gets; AccessDenied if `tenant` may not publish it."""
    if not records:
        return tenant
    owner = records[0].version.tenant
    if tenant is not None and owner != tenant:
        raise AccessDenied(f"adapter name {name!r} belongs to another tenant; publish under another name")
    return owner


def check_may_delete(name: str, records: list[Record], tenant: str | None) -> None:
    if tenant is not None and records[0].version.tenant != tenant:
        raise AccessDenied(f"adapter {name!r} belongs to another tenant; only its owner may delete it")


def same_as_newest(records: list[Record], digest: str, public: bool) -> AdapterVersion | None:
    """The newest live version if it has this content and visibility (republishing it is a no-op)."""
    newest = max(live(records), key=lambda v: v.version, default=None)
    if newest and newest.content_hash == digest and newest.public == public:
        return newest
    return None


def newest_usable(name: str, records: list[Record], tenant: str | None) -> AdapterVersion:
    versions = live(records)
    usable = [v for v in versions if can_use(v, tenant)]
    if usable:
        return max(usable, key=lambda v: v.version)
    if versions:
        raise AccessDenied(f"adapter {name!r} belongs to another tenant and has no public version")
    raise AdapterNotFound(f"every version of adapter {name!r} was deleted")


def exact(name: str, number: int, records: list[Record], tenant: str | None) -> AdapterVersion:
    match = next((r for r in records if r.version.version == number), None)
    if match is None:
        raise AdapterNotFound(f"adapter {name!r} has no version {number}; {_versions_hint(records, tenant)}")
    if match.deleted_at is not None:
        raise AdapterNotFound(f"{name}@{number} was deleted; {_versions_hint(records, tenant)}")
    if not can_use(match.version, tenant):
        raise AccessDenied(f"{name}@{number} belongs to another tenant and is not public")
    return match.version


def _versions_hint(records: list[Record], tenant: str | None) -> str:
    usable = [str(v.version) for v in live(records) if can_use(v, tenant)]
    return f"versions you can use: {', '.join(usable)}" if usable else "no version of it is available to you"
