"""What an API key may do: its tenant, its scopes and the tenant's quotas.

Scopes:
    use       generate, classify, embed; list and describe adapters; server info
    publish   upload adapters and delete the tenant's own (publish does not imply use)
    admin     everything: every tenant's adapters (use, describe, delete) and usage

Quotas (per tenant, None = no limit): bytes_stored, versions_per_adapter, adapters,
concurrent_requests, tokens_per_minute. docs/tenancy.md explains each.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

from adapterserve.errors import AccessDenied

USE, PUBLISH, ADMIN = "use", "publish", "admin"
SCOPES = (USE, PUBLISH, ADMIN)
LEGACY_SCOPES = frozenset({USE, PUBLISH})  # every key of a 'KEY TENANT' keys file

# the scope each call needs (gRPC methods and HTTP routes, as the ingress names them)
SCOPE_OF = {
    "Generate": USE, "Classify": USE, "Embed": USE, "ListAdapters": USE, "GetAdapter": USE, "ServerInfo": USE,
    "UploadAdapter": PUBLISH, "DeleteAdapter": PUBLISH,
    "models": USE, "completions": USE, "chat_completions": USE, "embeddings": USE, "classify": USE,
    "load_lora_adapter": PUBLISH, "unload_lora_adapter": PUBLISH,
}
TOKEN_CALLS = frozenset({"Generate", "completions", "chat_completions"})  # counted in tokens_per_minute


@dataclass(frozen=True)
class Quotas:
    """A tenant's limits; None: no limit."""

    bytes_stored: int | None = None  # bytes of the tenant's live adapter versions
    versions_per_adapter: int | None = None  # live versions of one adapter name
    adapters: int | None = None  # adapter names with a live version
    concurrent_requests: int | None = None  # calls in flight at once
    tokens_per_minute: int | None = None  # prompt + generated tokens over the last 60 s

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def items(self) -> Iterator[tuple[str, int]]:
        """(quota, limit) for every quota that is set."""
        for name in self.names():
            if (limit := getattr(self, name)) is not None:
                yield name, limit


NO_QUOTAS = Quotas()


@dataclass(frozen=True)
class Caller:
    """Who is calling: the key's tenant (None: open mode), the key's scopes, the tenant's quotas."""

    tenant: str | None
    scopes: frozenset[str]
    quotas: Quotas = NO_QUOTAS

    @property
    def is_admin(self) -> bool:
        return self.tenant is None or ADMIN in self.scopes

    @property
    def store_view(self) -> str | None:
        """The tenant whose view of the store this caller gets (None: every adapter)."""
        return None if self.is_admin else self.tenant

    def may(self, scope: str) -> bool:
        return self.is_admin or scope in self.scopes

    def require(self, call: str) -> None:
        """AccessDenied (PERMISSION_DENIED) unless this key has the scope `call` needs."""
        scope = SCOPE_OF.get(call, ADMIN)
        if not self.may(scope):
            held = ", ".join(s for s in SCOPES if s in self.scopes)
            raise AccessDenied(f"this API key lacks the '{scope}' scope, which {call} needs (the key's scopes: "
                               f"{held}); ask the operator for a key with '{scope}'")

    def scope_list(self) -> list[str]:
        return list(SCOPES) if self.tenant is None else [s for s in SCOPES if s in self.scopes]


OPEN_CALLER = Caller(None, frozenset(SCOPES))
