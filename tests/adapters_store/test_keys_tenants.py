"""The tenants file (scopes per key, quotas per tenant), the old keys file read as tenants,
callers' scopes, and the store's usage and publish quotas (real local and S3 stores)."""
from __future__ import annotations

from pathlib import Path

import pytest

from adapterserve.adapters_store.keys import ApiKeys, hash_key
from adapterserve.adapters_store.tenants import LEGACY_SCOPES, SCOPE_OF, Caller, Quotas
from adapterserve.adapters_store.tenants_file import read_keys_file, read_tenants
from adapterserve.errors import AccessDenied, QuotaExceeded, Unauthenticated

TENANTS = f"""# two tenants
tenants:
  acme:
    keys:
      - key: "{hash_key('acme-writer')}"
        scopes: [use, publish]
      - key: acme-reader
        scopes: [use]
    quotas:
      bytes_stored: 1_000_000
      versions_per_adapter: 3
      adapters: 0x10
      concurrent_requests: 4
      tokens_per_minute: null
  ops:
    keys: [{{key: ops-admin, scopes: [admin]}}]
"""


def test_a_tenants_file_gives_each_key_its_scopes_and_its_tenants_quotas(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    keys = read_keys_file(path)
    acme = Quotas(bytes_stored=1_000_000, versions_per_adapter=3, adapters=16, concurrent_requests=4)
    assert keys.caller_for("acme-writer") == Caller("acme", frozenset({"use", "publish"}), acme)
    assert keys.caller_for("acme-reader") == Caller("acme", frozenset({"use"}), acme)
    assert keys.caller_for("ops-admin").is_admin and keys.caller_for("ops-admin").store_view is None
    assert keys.tenants == {"acme", "ops"} and keys.quotas()["ops"] == Quotas()
    for wrong in (None, "", "acme-writer ", "sha256:" + "0" * 64):
        with pytest.raises(Unauthenticated):
            keys.caller_for(wrong)
    assert "acme-writer" not in repr(keys) and "acme-reader" not in repr(keys)


def test_the_old_keys_file_reads_as_tenants_with_use_and_publish_and_no_quotas(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# old format\nk1 acme\nk2 dev\n")
    keys = read_keys_file(path)
    assert keys.caller_for("k1") == Caller("acme", LEGACY_SCOPES, Quotas())
    assert keys.tenant_for("k2") == "dev"


def test_scopes_decide_which_calls_a_key_may_make():
    reader, publisher = Caller("t", frozenset({"use"})), Caller("t", frozenset({"publish"}))
    admin = Caller("ops", frozenset({"admin"}))
    for call, scope in SCOPE_OF.items():
        assert reader.may(scope) is (scope == "use") and publisher.may(scope) is (scope == "publish")
        admin.require(call)
    with pytest.raises(AccessDenied, match="lacks the 'publish' scope, which UploadAdapter needs .the key's "
                                           "scopes: use."):
        reader.require("UploadAdapter")
    with pytest.raises(AccessDenied, match="'admin' scope"):  # a call no table names needs admin
        reader.require("SomethingNew")
    assert (reader.store_view, publisher.store_view) == ("t", "t")


# --- the store's usage and publish quotas ---------------------------------------------


def test_usage_counts_the_tenants_live_versions(store, adapter_dir):
    a1 = store.publish("a", adapter_dir(0), tenant="acme")
    a2 = store.publish("a", adapter_dir(1), tenant="acme")
    store.publish("b", adapter_dir(2), tenant="other", public=True)
    usage = store.usage("acme")
    assert (usage.bytes_stored, usage.adapters, usage.versions) == (a1.size_bytes + a2.size_bytes, 1, {"a": 2})
    store.delete("a", 1, tenant="acme")
    assert store.usage("acme").bytes_stored == a2.size_bytes
    assert store.usages(["acme", "nobody"])["nobody"].adapters == 0


@pytest.mark.parametrize("quota", ["versions_per_adapter", "adapters", "bytes_stored"])
def test_a_publish_over_a_quota_is_refused_with_nothing_stored(make_store, adapter_dir, quota):
    store = make_store()
    first = store.publish("a", adapter_dir(0), tenant="acme")
    limits = {"versions_per_adapter": Quotas(versions_per_adapter=1), "adapters": Quotas(adapters=1),
              "bytes_stored": Quotas(bytes_stored=first.size_bytes + 10)}[quota]
    name = "b" if quota == "adapters" else "a"
    before = store._list("")
    with pytest.raises(QuotaExceeded, match=f"^tenant acme: {quota} ") as info:
        store.publish(name, adapter_dir(1), tenant="acme", quotas=limits)
    assert info.value.quota == quota and info.value.retry_after_s is None
    assert store._list("") == before  # not a byte written
    assert store.publish("a", adapter_dir(0), tenant="acme", quotas=limits) == first  # a republish costs nothing
    assert make_store().list(tenant="acme") == [first]


def test_bytes_stored_names_the_limit_the_usage_and_the_upload(store, adapter_dir):
    first = store.publish("a", adapter_dir(0), tenant="acme")
    limit = first.size_bytes + 1
    with pytest.raises(QuotaExceeded) as info:
        store.publish("b", adapter_dir(1), tenant="acme", quotas=Quotas(bytes_stored=limit))
    assert str(info.value).startswith(f"tenant acme: bytes_stored {limit} would be exceeded ({first.size_bytes} "
                                      f"stored + ")
    assert store.publish("b", adapter_dir(1), tenant="acme", quotas=Quotas(bytes_stored=10 * limit)).version == 1


def test_an_empty_tenants_file_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="tenants lists no tenant"):
        read_tenants("tenants: {}\n", "t.yaml")
    with pytest.raises(ValueError, match="holds no API keys"):
        ApiKeys.from_file(_write(tmp_path, "# nothing\n"))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    return path
