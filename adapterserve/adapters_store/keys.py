"""API keys and the tenants they belong to.

Key file format: one `KEY TENANT` pair per line; blank lines and lines starting
with '#' are ignored. KEY is either the key itself or `sha256:<64 hex digits>`,
the sha256 of the key (prefer that: the file then holds no secret). Make one with

    python -c "from adapterserve.adapters_store.keys import hash_key as h; print(h('KEY'))"

Example:

    # tenant acme
    sha256:<the 64 hex digits hash_key printed> acme
    local-dev-key-123 dev

A tenant may have several keys. TENANT is 1-64 letters, digits, '.', '_' or '-'.
Every key of this file has the scopes use and publish and its tenant no quotas; a
tenants file (tenants_file.py) sets scopes per key and quotas per tenant. Without keys
(`ApiKeys.open()`) every caller is tenant None: open mode, for the embedded default on
loopback.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path
from typing import Mapping

from adapterserve.adapters_store.tenants import LEGACY_SCOPES, OPEN_CALLER, Caller, Quotas
from adapterserve.errors import Unauthenticated

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HASHED = re.compile(r"sha256:([0-9a-fA-F]{64})")


def hash_key(key: str) -> str:
    """The `sha256:<hex>` form of an API key, for key files."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """Maps API keys to callers (tenant, scopes, quotas); holds only sha256 digests of the keys."""

    def __init__(self, digests: list[tuple[bytes, Caller]], *, open_mode: bool = False) -> None:
        self._digests = digests  # (sha256 digest of a key, the caller it makes)
        self.is_open = open_mode

    @classmethod
    def open(cls) -> ApiKeys:
        """No keys configured: every caller is tenant None and sees everything."""
        return cls([], open_mode=True)

    @classmethod
    def from_mapping(cls, keys: Mapping[str, str]) -> ApiKeys:
        """From `{key or 'sha256:<hex>': tenant}`."""
        return cls._build([(k, t, f"key #{i + 1}") for i, (k, t) in enumerate(keys.items())], "the key mapping")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ApiKeys:
        """Read a key file (format in the module docstring)."""
        entries = []
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            if len(fields) != 2:
                raise ValueError(f"{path}, line {number}: expected 'KEY TENANT', found {len(fields)} fields")
            entries.append((fields[0], fields[1], f"line {number}"))
        return cls._build(entries, str(path))

    @classmethod
    def _build(cls, entries: list[tuple[str, str, str]], source: str) -> ApiKeys:
        keys = KeyList(source)
        for key, tenant, where in entries:
            keys.add(key, Caller(check_tenant(tenant, f"{source}, {where}"), LEGACY_SCOPES), where)
        if not keys.digests:
            raise ValueError(f"{source} holds no API keys; add 'KEY TENANT' lines, or run without keys (open mode)")
        return cls(keys.digests)

    def caller_for(self, key: str | None) -> Caller:
        """Who `key` makes the caller (everyone is tenant None in open mode); Unauthenticated if no
        tenant owns it."""
        if self.is_open:
            return OPEN_CALLER
        if not key:
            raise Unauthenticated("an API key is required; pass one with --api-key or ADAPTERSERVE_API_KEY")
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for d, caller in self._digests:  # compare against every entry, in constant time each
            if hmac.compare_digest(digest, d):
                found = caller
        if found is None:
            raise Unauthenticated("the API key is not recognised; check it for typos or ask for a new one")
        return found

    def tenant_for(self, key: str | None) -> str | None:
        """The tenant owning `key` (None in open mode); Unauthenticated if no tenant does."""
        return self.caller_for(key).tenant

    @property
    def tenants(self) -> set[str]:
        return {c.tenant for _, c in self._digests if c.tenant is not None}

    def quotas(self) -> dict[str, Quotas]:
        """Every tenant's quotas."""
        return {c.tenant: c.quotas for _, c in self._digests if c.tenant is not None}

    def __repr__(self) -> str:  # never shows keys or digests
        return "ApiKeys(open)" if self.is_open else f"ApiKeys({len(self._digests)} keys, {len(self.tenants)} tenants)"


class KeyList:
    """Digests of keys being read from `source`, refusing one listed twice."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.digests: list[tuple[bytes, Caller]] = []

    def add(self, key: str, caller: Caller, where: str) -> None:
        digest = _digest(key, f"{self.source}, {where}")
        if any(hmac.compare_digest(digest, d) for d, _ in self.digests):
            raise ValueError(f"{self.source}, {where}: this key is listed twice")
        self.digests.append((digest, caller))


def check_tenant(tenant: object, where: str) -> str:
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
        raise ValueError(f"{where}: tenant {tenant!r} is invalid: use 1-64 letters, digits, '.', '_' or '-'")
    return tenant


def _digest(entry: str, where: str) -> bytes:
    if entry.startswith("sha256:"):
        match = _HASHED.fullmatch(entry)
        if not match:
            raise ValueError(f"{where}: a hashed key is 'sha256:' followed by 64 hex digits")
        return bytes.fromhex(match.group(1))
    return hashlib.sha256(entry.encode()).digest()
