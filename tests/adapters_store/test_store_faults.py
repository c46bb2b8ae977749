"""The store under faults: an unreadable manifest beside good ones, a store that cannot be
written, and resolution that reads `name@N` directly and caches `name` for a short TTL."""
from __future__ import annotations

import logging

import pytest

from adapterserve.adapters_store.local import LocalStore
from adapterserve.errors import AdapterNotFound, StoreUnavailable


def test_an_unreadable_manifest_is_logged_and_skipped(make_store, adapter_dir, caplog):
    store = make_store()
    store.publish("good", adapter_dir(0), tenant="t")
    store.publish("secret", adapter_dir(1), tenant="u")
    store.publish("later", adapter_dir(2), tenant="t")
    store._put("meta/secret/1.json", b"{not json")
    fresh = make_store()  # a restart: nothing cached
    with caplog.at_level(logging.ERROR, logger="adapterserve.store"):
        assert [v.name for v in fresh.list(tenant=None)] == ["good", "later"]
        assert [v.name for v in fresh.list(tenant="t")] == ["good", "later"]
        assert fresh.resolve("good", tenant="t").version == 1
        with pytest.raises(AdapterNotFound) as missing:
            fresh.resolve("nope", tenant="t")
    assert "secret" not in str(missing.value)
    logged = [r for r in caplog.records if "skipping adapter manifest" in r.getMessage()]
    assert len(logged) == 1 and "meta/secret/1.json" in logged[0].getMessage()  # once, in the server log


def test_a_version_number_behind_an_unreadable_manifest_is_never_reused(make_store, adapter_dir):
    store = make_store()
    store.publish("a", adapter_dir(0), tenant=None)
    store._put("meta/a/1.json", b"garbage")
    assert make_store().publish("a", adapter_dir(1), tenant=None).version == 2


def test_a_store_that_cannot_be_written_is_unavailable_without_paths(tmp_path, adapter_dir, caplog):
    root = tmp_path / "private-root"
    store = LocalStore(root)
    (root / "data").write_bytes(b"")  # data/ cannot be created: the filesystem refuses every file
    with caplog.at_level(logging.ERROR, logger="adapterserve.store"), \
            pytest.raises(StoreUnavailable, match="cannot store this adapter now") as refused:
        store.publish("a", adapter_dir(0), tenant=None)
    assert "private-root" not in str(refused.value) and "/" not in str(refused.value)
    assert any("private-root" in r.getMessage() for r in caplog.records)  # the operator sees where
    assert store.list(tenant=None) == []


def test_name_at_n_is_read_without_listing(make_store, adapter_dir):
    store = make_store()
    v1 = store.publish("a", adapter_dir(0), tenant=None)
    store.publish("a", adapter_dir(1), tenant=None)
    store._list = _refuse_listing
    assert store.resolve("a@1", tenant=None) == v1


def test_a_deleted_version_is_refused_when_read_directly(make_store, adapter_dir):
    store = make_store()
    store.publish("a", adapter_dir(0), tenant=None)
    make_store().delete("a", 1, tenant=None)
    with pytest.raises(AdapterNotFound, match="a@1 was deleted"):
        store.resolve("a@1", tenant=None)


def _refuse_listing(prefix: str):
    raise AssertionError(f"the store was listed ({prefix!r})")
