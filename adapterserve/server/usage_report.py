"""A tenant's scopes, usage and quotas as the TenantUsage message (ListAdapters, ServerInfo,
GET /v1/models' `tenant` field)."""
from __future__ import annotations

from typing import Any

from google.protobuf.json_format import MessageToDict

from adapterserve.adapters_store.tenants import Caller, Quotas
from adapterserve.adapters_store.usage import StoreUsage
from adapterserve.proto import adapterserve_pb2 as pb
from adapterserve.server.quotas import TenantGate


def tenant_usage(tenant: str | None, scopes: list[str], quotas: Quotas, stored: StoreUsage,
                 gate: TenantGate) -> pb.TenantUsage:
    in_flight, tokens = gate.usage(tenant)
    return pb.TenantUsage(tenant=tenant or "", scopes=scopes, bytes_stored=stored.bytes_stored,
                          adapters=stored.adapters, tokens_last_minute=tokens, requests_in_flight=in_flight,
                          quotas=pb.TenantQuotas(**dict(quotas.items())))


def caller_usage(caller: Caller, stored: StoreUsage, gate: TenantGate) -> pb.TenantUsage:
    return tenant_usage(caller.tenant, caller.scope_list(), caller.quotas, stored, gate)


def usage_json(message: pb.TenantUsage) -> dict[str, Any]:
    """The JSON form (every field, numbers as numbers)."""
    found = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for key in ("bytes_stored", "tokens_last_minute"):
        found[key] = int(found.get(key, 0))
    found["quotas"] = {k: int(v) for k, v in found.get("quotas", {}).items()}
    return found
