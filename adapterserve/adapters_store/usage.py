"""What a tenant holds in the store, and the quotas a publish is checked against.

A tenant holds the live versions of the names it owns: their bytes (each version's
`size_bytes`, identical content counted once per version), their names, and each
name's versions. Deleted versions no longer count (their files go at the next `gc`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from adapterserve.adapters_store.lookup import Record
from adapterserve.adapters_store.tenants import Quotas
from adapterserve.errors import QuotaExceeded


@dataclass(frozen=True)
class StoreUsage:
    bytes_stored: int = 0
    versions: dict[str, int] = field(default_factory=dict)  # adapter name -> live versions

    @property
    def adapters(self) -> int:
        return len(self.versions)


def usage_of(groups: dict[str, list[Record]], tenant: str | None) -> StoreUsage:
    """`tenant`'s usage over every name's records (None: what no tenant owns)."""
    total, versions = 0, {}
    for name, records in groups.items():
        live = [r.version for r in records if r.deleted_at is None and r.version.tenant == tenant]
        if live:
            versions[name] = len(live)
            total += sum(v.size_bytes for v in live)
    return StoreUsage(total, versions)


def check_publish(name: str, tenant: str, quotas: Quotas, usage: StoreUsage, new_bytes: int) -> None:
    """QuotaExceeded (nothing stored yet) if one more version of `name`, `new_bytes` big, is over a quota."""
    have = usage.versions.get(name, 0)
    if quotas.versions_per_adapter is not None and have >= quotas.versions_per_adapter:
        raise QuotaExceeded(f"tenant {tenant}: versions_per_adapter {quotas.versions_per_adapter} reached "
                            f"({name!r} has {have} live versions); delete one first (adapterserve delete "
                            f"{name}@N)", "versions_per_adapter")
    if quotas.adapters is not None and have == 0 and usage.adapters >= quotas.adapters:
        raise QuotaExceeded(f"tenant {tenant}: adapters {quotas.adapters} reached ({usage.adapters} adapter names "
                            "hold live versions); delete an adapter first, or publish a new version of one of "
                            "them", "adapters")
    if quotas.bytes_stored is not None and usage.bytes_stored + new_bytes > quotas.bytes_stored:
        raise QuotaExceeded(f"tenant {tenant}: bytes_stored {quotas.bytes_stored} would be exceeded "
                            f"({usage.bytes_stored} stored + {new_bytes} in this upload); delete versions first",
                            "bytes_stored")
