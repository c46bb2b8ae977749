"""The adapter store contract; every test here runs on LocalStore and on S3Store."""
from __future__ import annotations

import os
import threading
from datetime import timezone
from pathlib import Path

import pytest

from adapterserve.adapters_store.local import LocalStore
from adapterserve.adapters_store.staging import StoreLimits
from adapterserve.adapters_store.store import open_store
from adapterserve.errors import (
    AccessDenied,
    AdapterError,
    AdapterIntegrityError,
    AdapterNotFound,
    AdapterTooLarge,
    RequestError,
    StoreUnavailable,
)


def _info(path: Path) -> dict:
    return {"peft_type": "LORA", "files_seen": sorted(p.name for p in path.iterdir())}


def _raise_on_call(n: int, original):
    """Wrap `original` so that its n-th call raises (an upload dying midway)."""
    calls = iter(range(1, 1_000_000))

    def wrapped(*args, **kwargs):
        if next(calls) == n:
            raise ConnectionError("upload interrupted")
        return original(*args, **kwargs)

    return wrapped


# --- publish and resolve ----------------------------------------------------


def test_publish_records_the_version(store, adapter_dir):
    src = adapter_dir(0)
    v = store.publish("sentiment", src, tenant="acme", validator=_info)
    assert (v.name, v.version, v.ref, v.tenant, v.public) == ("sentiment", 1, "sentiment@1", "acme", False)
    assert len(v.content_hash) == 64
    assert v.files == ("adapter_config.json", "adapter_model.safetensors")
    assert v.size_bytes == sum(p.stat().st_size for p in src.iterdir())
    assert v.info == {"peft_type": "LORA", "files_seen": ["adapter_config.json", "adapter_model.safetensors"]}
    assert v.created_at.tzinfo == timezone.utc
    assert store.resolve("sentiment", tenant="acme") == v
    assert store.describe("sentiment@1", tenant="acme") == v


def test_versions_are_numbered_and_immutable(store, adapter_dir):
    srcs = [adapter_dir(seed) for seed in range(3)]
    versions = [store.publish("a", s, tenant=None) for s in srcs]
    assert [v.version for v in versions] == [1, 2, 3]
    assert len({v.content_hash for v in versions}) == 3
    assert store.resolve("a", tenant=None).version == 3
    assert store.resolve("a@2", tenant=None).content_hash == versions[1].content_hash
    fetched = store.fetch(store.resolve("a@1", tenant=None))
    for name in versions[0].files:
        assert (fetched / name).read_bytes() == (srcs[0] / name).read_bytes()


def test_republishing_the_newest_content_is_idempotent(store, adapter_dir):
    first = store.publish("a", adapter_dir(0), tenant="t")
    assert store.publish("a", adapter_dir(0), tenant="t") == first
    second = store.publish("a", adapter_dir(1), tenant="t")
    assert second.version == 2
    assert store.publish("a", adapter_dir(0), tenant="t").version == 3  # older content becomes newest again
    assert store.publish("a", adapter_dir(0), tenant="t", public=True).version == 4  # visibility changed
    assert [v.version for v in store.list(tenant="t")] == [1, 2, 3, 4]


def test_validator_sees_the_staged_copy_not_the_source(store, adapter_dir):
    src = adapter_dir(0)
    seen = []
    store.publish("a", src, tenant=None, validator=lambda p: seen.append(p) or {})
    assert seen and seen[0] != src and not seen[0].exists()  # a temporary copy, gone afterwards


def test_docs_are_kept_and_hidden_entries_skipped(store, adapter_dir):
    src = adapter_dir(0, extra={"README.md": b"# card", "LICENSE": b"MIT", ".cache/huggingface/x.lock": b""})
    v = store.publish("a", src, tenant=None)
    assert v.files == ("LICENSE", "README.md", "adapter_config.json", "adapter_model.safetensors")
    assert (store.fetch(v) / "README.md").read_bytes() == b"# card"


@pytest.mark.parametrize("extra", [{"optimizer.safetensors": b"x" * 100}, {"tokenizer.json": b"{}"},
                                   {"tokenizer/tokenizer.json": b"{}"}, {"notes.md": b"hi"}])
def test_files_outside_the_family_are_refused_by_name(store, adapter_dir, extra):
    name = next(iter(extra)).split("/")[0]
    with pytest.raises(AdapterError, match=f"{name}.*not part of an adapter"):
        store.publish("a", adapter_dir(0, extra=extra), tenant=None)
    _assert_empty(store)


def test_a_large_unrelated_file_is_refused_before_it_is_copied(make_store, adapter_dir):
    src = adapter_dir(0)
    with open(src / "checkpoint.tar", "wb") as f:
        f.truncate(2 << 30)  # 2 GiB, sparse: nothing read or copied
    store = make_store(StoreLimits(max_total_bytes=3 << 30))
    with pytest.raises(AdapterError, match="'checkpoint.tar' is not part of an adapter"):
        store.publish("a", src, tenant=None)
    _assert_empty(store)


def test_configs_and_docs_are_capped(make_store, adapter_dir):
    store = make_store(StoreLimits(max_text_file_bytes=100))
    with pytest.raises(AdapterTooLarge, match="'README.md' is 101 bytes, over the limit of 100"):
        store.publish("a", adapter_dir(0, extra={"README.md": b"x" * 101}), tenant=None)
    _assert_empty(store)


def test_restart_sees_the_same_adapters(make_store, adapter_dir):
    before = make_store()
    before.publish("a", adapter_dir(0), tenant="t")
    before.publish("b", adapter_dir(1), tenant="u", public=True)
    before.delete("b", 1, tenant="u")
    after = make_store()
    assert after.list(tenant=None) == before.list(tenant=None)
    assert after.resolve("a", tenant="t") == before.resolve("a", tenant="t")
    assert after.publish("b", adapter_dir(2), tenant="u").version == 2  # numbering survives


# --- refused uploads store nothing ------------------------------------------


def _assert_empty(store) -> None:
    assert store.list(tenant=None) == []
    with pytest.raises(AdapterNotFound):
        store.resolve("a", tenant=None)


@pytest.mark.parametrize("pickle_name", ["adapter_model.bin", "training_args.bin", "model.pt", "state.pkl"])
def test_pickle_files_are_refused(store, adapter_dir, pickle_name):
    with pytest.raises(AdapterError, match="pickle"):
        store.publish("a", adapter_dir(0, extra={pickle_name: b"\x80\x04."}), tenant=None)
    _assert_empty(store)


def test_symlinks_are_refused(store, adapter_dir, tmp_path):
    src = adapter_dir(0)
    (tmp_path / "outside.json").write_text("{}")
    os.symlink(tmp_path / "outside.json", src / "head_config.json")
    with pytest.raises(AdapterError, match="symbolic link"):
        store.publish("a", src, tenant=None)
    _assert_empty(store)


def test_nested_directories_are_refused(store, adapter_dir):
    with pytest.raises(AdapterError, match="folder 'sub/' is not part of an adapter"):
        store.publish("a", adapter_dir(0, extra={"sub/deeper/x.json": b"{}"}), tenant=None)
    _assert_empty(store)


def test_oversized_upload_is_refused(make_store, adapter_dir):
    store = make_store(StoreLimits(max_total_bytes=300))
    with pytest.raises(AdapterTooLarge, match="over the store's limit of 300 bytes"):
        store.publish("a", adapter_dir(0), tenant=None)
    _assert_empty(store)


def test_too_many_files_are_refused(make_store, adapter_dir):
    store = make_store(StoreLimits(max_files=3))
    extra = {"README.md": b"x", "LICENSE": b"x"}
    with pytest.raises(AdapterTooLarge, match="more than 3 files"):
        store.publish("a", adapter_dir(0, extra=extra), tenant=None)
    _assert_empty(store)


def test_missing_or_empty_directory_is_refused(store, tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        store.publish("a", tmp_path / "nope", tenant=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no files"):
        store.publish("a", tmp_path / "empty", tenant=None)
    _assert_empty(store)


@pytest.mark.parametrize("name", ["Upper", "-dash", "", "a/b", "a@1", "x" * 65, "sp ace"])
def test_bad_names_are_refused(store, adapter_dir, name):
    with pytest.raises(RequestError, match="invalid"):
        store.publish(name, adapter_dir(0), tenant=None)
    _assert_empty(store)


@pytest.mark.parametrize("ref", ["a@", "a@x", "a@0", "a@-1", "A@1"])
def test_bad_refs_are_refused(store, ref):
    with pytest.raises(RequestError, match="invalid"):
        store.resolve(ref, tenant=None)


# --- interrupted publishes leave nothing visible ----------------------------


def test_validator_error_stores_nothing(store, adapter_dir):
    def refuse(path: Path) -> dict:
        raise AdapterError("adapter targets o_proj with in_features 512 but the backbone has 384")

    with pytest.raises(AdapterError, match="in_features 512"):
        store.publish("a", adapter_dir(0), tenant=None, validator=refuse)
    _assert_empty(store)
    assert store._list("data/") == [] and store._list("meta/") == []


def test_validator_result_the_manifest_cannot_hold_stores_nothing(store, adapter_dir):
    with pytest.raises(TypeError):
        store.publish("a", adapter_dir(0), tenant=None, validator=lambda p: {"rank": object()})
    _assert_empty(store)
    assert store._list("data/") == []


def test_upload_dying_midway_leaves_only_garbage_that_gc_removes(make_store, adapter_dir):
    store = make_store()
    store._store_file = _raise_on_call(2, store._store_file)
    with pytest.raises(StoreUnavailable, match="retry later"):
        store.publish("a", adapter_dir(0), tenant=None)
    _assert_empty(store)
    assert len(store._list("data/")) == 1  # the first file made it
    assert store.gc(grace_s=3600) == 0  # might still be an upload in progress
    assert store.gc(grace_s=0) == 1
    assert store._list("data/") == []
    assert make_store().publish("a", adapter_dir(0), tenant=None).version == 1


def test_losing_the_race_for_a_version_number_takes_the_next(make_store, adapter_dir):
    store, rival = make_store(), make_store()
    original = store._put_new

    def put_new_after_rival(key: str, data: bytes) -> bool:
        if not rival.list(tenant=None):
            rival.publish("a", adapter_dir(1), tenant=None)  # takes version 1 first
        return original(key, data)

    store._put_new = put_new_after_rival
    mine = store.publish("a", adapter_dir(0), tenant=None)
    assert mine.version == 2
    assert [v.version for v in make_store().list(tenant=None)] == [1, 2]
    assert make_store().resolve("a@2", tenant=None).content_hash == mine.content_hash


# --- tenants ------------------------------------------------------------------


def _not_found_message(call) -> str:
    with pytest.raises(AdapterNotFound) as info:
        call()
    return str(info.value)


def test_other_tenants_cannot_see_use_delete_or_take_a_private_adapter(store, adapter_dir):
    v = store.publish("a", adapter_dir(0), tenant="alice")
    nobody = _not_found_message(lambda: store.resolve("zz", tenant="bob")).replace("'zz'", "'a'")
    for call in (lambda: store.resolve("a", tenant="bob"), lambda: store.resolve("a@1", tenant="bob"),
                 lambda: store.describe("a@1", tenant="bob"), lambda: store.delete("a", tenant="bob"),
                 lambda: store.delete("a", 1, tenant="bob")):
        assert _not_found_message(call) == nobody  # the same as for a name nobody has: no existence leak
    assert store.list(tenant="bob") == []
    assert store.list(tenant="bob", name="a") == []
    with pytest.raises(AccessDenied, match="another name"):
        store.publish("a", adapter_dir(1), tenant="bob")
    assert store.list(tenant="alice") == [v]
    assert store.list(tenant=None) == [v]  # open mode sees everything


def test_public_adapters_are_usable_by_all_but_deletable_by_the_owner_only(store, adapter_dir):
    v = store.publish("shared", adapter_dir(0), tenant="alice", public=True)
    assert store.resolve("shared", tenant="bob") == v
    assert store.list(tenant="bob") == [v]
    with pytest.raises(AccessDenied, match="only its owner"):
        store.delete("shared", tenant="bob")
    assert store.delete("shared", tenant="alice") == [v]
    assert store.list(tenant=None) == []


def test_name_alone_resolves_to_the_newest_version_the_tenant_may_use(store, adapter_dir):
    public = store.publish("a", adapter_dir(0), tenant="alice", public=True)
    store.publish("a", adapter_dir(1), tenant="alice")  # private draft
    assert store.resolve("a", tenant="bob") == public
    assert store.resolve("a", tenant="alice").version == 2
    with pytest.raises(AdapterNotFound, match="'a' has no version 2; versions you can use: 1$"):
        store.resolve("a@2", tenant="bob")


def test_open_mode_publishes_into_an_owned_name_as_the_owner(store, adapter_dir):
    store.publish("a", adapter_dir(0), tenant="alice")
    v = store.publish("a", adapter_dir(1), tenant=None)
    assert v.tenant == "alice"
    assert store.resolve("a", tenant="alice") == v


# --- not found, delete, gc ----------------------------------------------------


def test_not_found_messages_list_what_exists(store, adapter_dir):
    store.publish("mine", adapter_dir(0), tenant="t")
    store.publish("theirs", adapter_dir(1), tenant="u")
    with pytest.raises(AdapterNotFound, match="adapters you can use: mine$"):
        store.resolve("nope", tenant="t")
    store.publish("mine", adapter_dir(2), tenant="t")
    with pytest.raises(AdapterNotFound, match="no version 7; versions you can use: 1, 2"):
        store.resolve("mine@7", tenant="t")


def test_deleted_versions_are_gone_but_numbers_are_never_reused(store, adapter_dir):
    for seed in range(3):
        store.publish("a", adapter_dir(seed), tenant="t")
    assert [v.version for v in store.delete("a", 2, tenant="t")] == [2]
    with pytest.raises(AdapterNotFound, match="a@2 was deleted; versions you can use: 1, 3"):
        store.resolve("a@2", tenant="t")
    with pytest.raises(AdapterNotFound):
        store.delete("a", 2, tenant="t")
    assert store.resolve("a", tenant="t").version == 3
    assert [v.version for v in store.delete("a", tenant="t")] == [1, 3]
    with pytest.raises(AdapterNotFound, match="every version"):
        store.resolve("a", tenant="t")
    assert store.list(tenant="t") == []
    assert store.publish("a", adapter_dir(0), tenant="t").version == 4


def test_a_deleted_version_can_be_fetched_until_gc_removes_its_files(make_store, adapter_dir):
    store = make_store()
    v = store.publish("a", adapter_dir(0), tenant=None)
    keep = store.publish("b", adapter_dir(0), tenant=None)  # same content, other name
    store.delete("a", tenant=None)
    assert (store.fetch(v) / "adapter_config.json").exists()  # in-flight requests still load it
    assert store.gc(grace_s=3600) == 0
    assert store.gc(grace_s=0) == 1
    with pytest.raises(AdapterNotFound, match="no longer stored"):
        make_store().fetch(v)  # a fresh store object: no download cache to fall back on
    assert make_store().fetch(keep).is_dir()


def test_gc_keeps_versions_that_share_content(store, adapter_dir):
    v1 = store.publish("a", adapter_dir(0), tenant=None)
    store.publish("a", adapter_dir(1), tenant=None)
    v3 = store.publish("a", adapter_dir(0), tenant=None)
    store.delete("a", 1, tenant=None)
    store.gc(grace_s=0)
    assert v3.content_hash == v1.content_hash
    assert store.fetch(v3).is_dir()


def test_fetch_verifies_the_content_hash(store, adapter_dir):
    v = store.publish("a", adapter_dir(0), tenant=None)
    key = f"data/a/{v.content_hash}/adapter_model.safetensors"
    store._put(key, b"tampered")
    with pytest.raises(AdapterIntegrityError, match="adapter_model.safetensors"):
        store.fetch(v)


# --- backend-specific -----------------------------------------------------------


def test_concurrent_publishes_get_distinct_versions(tmp_path, adapter_dir):
    store = LocalStore(tmp_path / "store")
    srcs = [adapter_dir(seed) for seed in range(8)]
    threads = [threading.Thread(target=store.publish, args=("a", s), kwargs={"tenant": None}) for s in srcs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    versions = store.list(tenant=None)
    assert [v.version for v in versions] == list(range(1, 9))
    assert len({v.content_hash for v in versions}) == 8
    assert list((tmp_path / "store" / ".tmp").iterdir()) == []  # staging cleaned up


def test_open_store_chooses_the_backend(tmp_path):
    assert isinstance(open_store(tmp_path / "s"), LocalStore)
    assert open_store(f"file://{tmp_path}/t").root == tmp_path / "t"
    with pytest.raises(ValueError, match="unsupported adapter store"):
        open_store("gs://bucket/x")
