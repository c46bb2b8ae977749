"""Who is calling: the API key from gRPC metadata or HTTP headers, mapped to a caller
(tenant, scopes, quotas: adapters_store/tenants.py).

Clients send `authorization: Bearer <key>` (OpenAI style) or `x-api-key: <key>`.
Without a keys file the server is open: every caller is tenant None with every scope.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from adapterserve.adapters_store.keys import ApiKeys
from adapterserve.adapters_store.tenants import Caller
from adapterserve.adapters_store.tenants_file import read_keys_file


def load_keys(path: str | None) -> ApiKeys:
    """A tenants file or a 'KEY TENANT' keys file; None: open mode."""
    return read_keys_file(path) if path else ApiKeys.open()


def key_from_pairs(pairs: Iterable[tuple[str, str]]) -> str | None:
    """The API key in gRPC metadata or HTTP headers (names compared case-insensitively)."""
    found = {k.lower(): v for k, v in pairs}
    bearer = found.get("authorization", "")
    if bearer[:7].lower() == "bearer ":
        return bearer[7:].strip() or None
    return found.get("x-api-key") or None


def grpc_caller(keys: ApiKeys, context) -> Caller:
    """The caller of a gRPC call (RayServegRPCContext); Unauthenticated if the key is wrong."""
    return keys.caller_for(key_from_pairs(context.invocation_metadata()))


def http_caller(keys: ApiKeys, headers: Mapping[str, str]) -> Caller:
    return keys.caller_for(key_from_pairs(headers.items()))


def grpc_tenant(keys: ApiKeys, context) -> str | None:
    return grpc_caller(keys, context).tenant


def http_tenant(keys: ApiKeys, headers: Mapping[str, str]) -> str | None:
    return http_caller(keys, headers).tenant
