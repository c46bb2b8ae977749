"""Who is calling: the API key from gRPC metadata or HTTP headers, mapped to a tenant.

Clients send `authorization: Bearer <key>` (OpenAI style) or `x-api-key: <key>`.
Without a key file the server is open: every caller is tenant None.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from adapterserve.adapters_store.keys import ApiKeys


def load_keys(path: str | None) -> ApiKeys:
    return ApiKeys.from_file(path) if path else ApiKeys.open()


def key_from_pairs(pairs: Iterable[tuple[str, str]]) -> str | None:
    """The API key in gRPC metadata or HTTP headers (names compared case-insensitively)."""
    found = {k.lower(): v for k, v in pairs}
    bearer = found.get("authorization", "")
    if bearer[:7].lower() == "bearer ":
        return bearer[7:].strip() or None
    return found.get("x-api-key") or None


def grpc_tenant(keys: ApiKeys, context) -> str | None:
    """The tenant of a gRPC call (RayServegRPCContext); Unauthenticated if the key is wrong."""
    return keys.tenant_for(key_from_pairs(context.invocation_metadata()))


def http_tenant(keys: ApiKeys, headers: Mapping[str, str]) -> str | None:
    return keys.tenant_for(key_from_pairs(headers.items()))
