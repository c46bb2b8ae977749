"""What only the S3 backend does: key layout, conditional manifest write, client
failures midway, the download cache. (test_store.py runs the shared contract.)"""
from __future__ import annotations

import pytest

from adapterserve.adapters_store.store import open_store
from adapterserve.errors import AdapterNotFound, StoreUnavailable

pytest.importorskip("boto3")

from adapterserve.adapters_store.s3 import S3Store  # noqa: E402


def _s3(url: str, endpoint: str, tmp_path, **kw) -> S3Store:
    return S3Store(url, endpoint_url=endpoint, cache_dir=tmp_path / "cache", **kw)


def _record(store: S3Store, operation: str, fail_on: int | None = None) -> list[dict]:
    """Record the parameters of each `operation` call the store's client makes; optionally fail one."""
    calls: list[dict] = []

    def hook(params, **_):
        calls.append(dict(params))
        if len(calls) == fail_on:
            raise ConnectionError("connection reset during upload")

    store._client.meta.events.register(f"before-parameter-build.s3.{operation}", hook)
    return calls


def test_open_store_gives_an_s3_store_under_the_prefix(s3_endpoint, s3_bucket, s3_client, tmp_path, adapter_dir):
    store = open_store(f"s3://{s3_bucket}/team/adapters/", endpoint_url=s3_endpoint, cache_dir=tmp_path / "c")
    assert isinstance(store, S3Store)
    v = store.publish("a", adapter_dir(0), tenant=None)
    keys = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert keys == [
        f"team/adapters/data/a/{v.content_hash}/adapter_config.json",
        f"team/adapters/data/a/{v.content_hash}/adapter_model.safetensors",
        "team/adapters/meta/a/1.json",
    ]


def test_manifest_is_written_last_and_only_if_absent(s3_endpoint, s3_bucket, tmp_path, adapter_dir):
    store = _s3(f"s3://{s3_bucket}", s3_endpoint, tmp_path)
    puts = _record(store, "PutObject")
    store.publish("a", adapter_dir(0), tenant=None)
    assert [p["Key"].rsplit("/", 1)[-1] for p in puts] == ["adapter_config.json", "adapter_model.safetensors", "1.json"]
    assert puts[-1].get("IfNoneMatch") == "*"
    assert all("IfNoneMatch" not in p for p in puts[:-1])


def test_client_failing_on_the_second_file_leaves_nothing_visible(
    s3_endpoint, s3_bucket, s3_client, tmp_path, adapter_dir
):
    store = _s3(f"s3://{s3_bucket}/p", s3_endpoint, tmp_path)
    _record(store, "PutObject", fail_on=2)
    with pytest.raises(StoreUnavailable, match="cannot store this adapter now") as refused:
        store.publish("a", adapter_dir(0), tenant=None)
    assert s3_bucket not in str(refused.value) and isinstance(refused.value.__context__, ConnectionError)
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert len(keys) == 1 and "/meta/" not in keys[0]
    fresh = _s3(f"s3://{s3_bucket}/p", s3_endpoint, tmp_path)
    assert fresh.list(tenant=None) == []
    with pytest.raises(AdapterNotFound):
        fresh.resolve("a", tenant=None)


def test_an_existing_manifest_is_never_overwritten(s3_endpoint, s3_bucket, tmp_path, adapter_dir):
    store = _s3(f"s3://{s3_bucket}", s3_endpoint, tmp_path)
    v = store.publish("a", adapter_dir(0), tenant=None)
    assert store._put_new("meta/a/1.json", b"{}") is False
    assert _s3(f"s3://{s3_bucket}", s3_endpoint, tmp_path).resolve("a@1", tenant=None) == v


def test_fetch_downloads_once_into_a_cache_keyed_by_content(s3_endpoint, s3_bucket, tmp_path, adapter_dir):
    store = _s3(f"s3://{s3_bucket}", s3_endpoint, tmp_path)
    v = store.publish("a", adapter_dir(0), tenant=None)
    gets = _record(store, "GetObject")
    first = store.fetch(v)
    assert first == tmp_path / "cache" / v.content_hash
    assert len(gets) == 2
    assert store.fetch(v) == first and len(gets) == 2
    assert sorted(p.name for p in first.iterdir()) == list(v.files)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".partial")]


def test_prefixes_in_one_bucket_are_separate_stores(s3_endpoint, s3_bucket, tmp_path, adapter_dir):
    one = _s3(f"s3://{s3_bucket}/one", s3_endpoint, tmp_path)
    two = _s3(f"s3://{s3_bucket}/two", s3_endpoint, tmp_path)
    one.publish("a", adapter_dir(0), tenant=None)
    assert two.list(tenant=None) == []
    assert two.publish("a", adapter_dir(1), tenant=None).version == 1


def test_missing_bucket_and_bad_urls_are_reported(s3_endpoint, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        _s3("s3://no-such-bucket-here", s3_endpoint, tmp_path)
    for url in ("s3://", "s3:///prefix"):
        with pytest.raises(ValueError, match="invalid"):
            _s3(url, s3_endpoint, tmp_path)
