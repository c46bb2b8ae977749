"""What the store records about one adapter version, and how names and refs are spelled.

A manifest is the JSON form of an `AdapterVersion`; its existence is what makes a
version visible. Manifests are written once and never changed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping

from adapterserve.errors import AdapterIntegrityError, RequestError

MANIFEST_FORMAT = 1
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_NAME_RULE = "1-64 characters: lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"


@dataclass(frozen=True)
class AdapterVersion:
    """One immutable published version of a named adapter."""

    name: str
    version: int
    content_hash: str  # sha256 hex over the sorted file names and their bytes
    tenant: str | None  # owner; None when published in open mode (no API keys)
    public: bool
    created_at: datetime  # UTC
    size_bytes: int
    files: tuple[str, ...]  # paths relative to the adapter directory, sorted
    info: Mapping[str, Any] = field(default_factory=dict, hash=False)  # what the validator returned
    file_sha256: Mapping[str, str] = field(default_factory=dict, hash=False, repr=False)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


def check_name(name: str) -> str:
    """Return `name` if it is a valid adapter name, else raise RequestError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(f"adapter name {name!r} is invalid: use {_NAME_RULE}")
    return name


def parse_ref(ref: str) -> tuple[str, int | None]:
    """'name@3' -> ('name', 3); 'name' -> ('name', None)."""
    name, sep, number = ref.partition("@")
    check_name(name)
    if not sep:
        return name, None
    if not number.isdigit() or int(number) < 1:
        raise RequestError(
            f"adapter reference {ref!r} is invalid: after '@' comes a version number >= 1, e.g. '{name}@3'"
        )
    return name, int(number)


def to_manifest(v: AdapterVersion) -> bytes:
    doc = {
        "format": MANIFEST_FORMAT,
        "name": v.name,
        "version": v.version,
        "content_hash": v.content_hash,
        "tenant": v.tenant,
        "public": v.public,
        "created_at": v.created_at.isoformat(),
        "size_bytes": v.size_bytes,
        "files": [{"path": p, "sha256": v.file_sha256[p]} for p in v.files],
        "info": dict(v.info),
    }
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def from_manifest(data: bytes, where: str) -> AdapterVersion:
    """Parse a manifest; `where` names the object in errors."""
    try:
        doc = json.loads(data)
        if doc.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {MANIFEST_FORMAT}")
        files = doc["files"]
        return AdapterVersion(
            name=doc["name"],
            version=int(doc["version"]),
            content_hash=doc["content_hash"],
            tenant=doc["tenant"],
            public=bool(doc["public"]),
            created_at=datetime.fromisoformat(doc["created_at"]),
            size_bytes=int(doc["size_bytes"]),
            files=tuple(f["path"] for f in files),
            info=doc["info"],
            file_sha256={f["path"]: f["sha256"] for f in files},
        )
    except (ValueError, KeyError, TypeError) as e:
        raise AdapterIntegrityError(f"adapter manifest {where} is unreadable ({e}); restore or remove it") from e
