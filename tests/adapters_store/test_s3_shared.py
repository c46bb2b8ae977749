"""One S3 bucket shared by servers: resolution that never lists per request, a publish on
one store seen by another within the TTL, and a download cache bounded in bytes."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from adapterserve.adapters_store.s3 import S3Store
from adapterserve.errors import AdapterNotFound


def _store(bucket: str, endpoint: str, cache: Path, **options) -> S3Store:
    return S3Store(f"s3://{bucket}/adapters", endpoint_url=endpoint, cache_dir=cache, **options)


def _count_requests(store: S3Store) -> Counter:
    """HTTP requests the store's client sends ("list", "get", ...), seen as they leave (botocore's
    send hook): a listing is a GET with `list-type=2` on the bucket."""
    sent: Counter = Counter()

    def seen(request, **_) -> None:
        sent["list" if "list-type=2" in request.url else request.method.lower()] += 1

    store._client.meta.events.register("before-send.s3", seen)
    return sent


def test_a_version_ref_never_lists_and_a_name_lists_only_its_own_prefix(s3_endpoint, s3_bucket, tmp_path,
                                                                         adapter_dir):
    """The store keeps no resolution cache (the ingress does: server/resolutions.py): a bare
    name lists its own manifests each time, name@N reads its tombstone and nothing else."""
    server = _store(s3_bucket, s3_endpoint, tmp_path / "c")
    server.publish("a", adapter_dir(0), tenant=None)
    server.publish("b", adapter_dir(1), tenant=None)
    sent = _count_requests(server)
    prefixes = []
    server._client.meta.events.register(
        "before-send.s3", lambda request, **_: prefixes.append(request.url) if "list-type=2" in request.url else None)
    for _ in range(5):
        assert server.resolve("b@1", tenant=None).name == "b"
    assert sent["list"] == 0 and sent["get"] == 5  # b@1's tombstone check: one small read each
    for _ in range(3):
        assert server.resolve("a", tenant=None).version == 1
    assert sent["list"] == 3
    assert all("meta%2Fa%2F" in url or "meta/a/" in url for url in prefixes), prefixes


def test_a_publish_or_delete_on_one_server_is_seen_by_another_at_once(s3_endpoint, s3_bucket, tmp_path,
                                                                      adapter_dir):
    one = _store(s3_bucket, s3_endpoint, tmp_path / "one")
    two = _store(s3_bucket, s3_endpoint, tmp_path / "two")
    with pytest.raises(AdapterNotFound):
        two.resolve("a", tenant=None)
    v1 = one.publish("a", adapter_dir(0), tenant=None)
    assert two.resolve("a@1", tenant=None) == v1
    assert two.fetch(two.resolve("a", tenant=None)).is_dir()
    v2 = one.publish("a", adapter_dir(1), tenant=None)
    assert two.resolve("a", tenant=None) == v2
    one.delete("a", 2, tenant=None)
    with pytest.raises(AdapterNotFound, match="deleted"):
        two.resolve("a@2", tenant=None)
    assert two.resolve("a", tenant=None) == v1


def test_the_download_cache_stays_within_its_bytes(s3_endpoint, s3_bucket, tmp_path, adapter_dir):
    publisher = _store(s3_bucket, s3_endpoint, tmp_path / "pub")
    versions = [publisher.publish(f"a{i}", adapter_dir(i, rank=8), tenant=None) for i in range(6)]
    size = versions[0].size_bytes
    server = _store(s3_bucket, s3_endpoint, tmp_path / "c", cache_bytes=int(2.5 * size), cache_grace_s=0)
    for v in versions:  # a registry larger than the budget
        assert server.fetch(v).is_dir()
        assert _cached_bytes(server.cache_dir) <= int(2.5 * size)
    cached = sorted(p.name for p in server.cache_dir.iterdir() if not p.name.startswith("."))
    assert cached == sorted(v.content_hash for v in versions[-2:])  # the most recent stay
    again = server.fetch(versions[0])  # evicted: downloaded and checked again
    assert (again / "adapter_model.safetensors").stat().st_size > 0


def test_a_version_used_within_the_grace_is_not_evicted(s3_endpoint, s3_bucket, tmp_path, adapter_dir):
    publisher = _store(s3_bucket, s3_endpoint, tmp_path / "pub")
    versions = [publisher.publish(f"a{i}", adapter_dir(i), tenant=None) for i in range(3)]
    server = _store(s3_bucket, s3_endpoint, tmp_path / "c", cache_bytes=1, cache_grace_s=3600)
    paths = [server.fetch(v) for v in versions]
    assert all(p.is_dir() for p in paths)  # over budget for now, but a reader may still open them


def test_staging_leftovers_of_a_crash_are_cleaned(s3_endpoint, s3_bucket, tmp_path):
    server = _store(s3_bucket, s3_endpoint, tmp_path / "c")
    left = server.cache_dir / ".staging" / "publish-crashed"
    left.mkdir(parents=True)
    (left / "adapter_model.safetensors").write_bytes(b"x" * 10)
    server.clean_staging(grace_s=3600)
    assert left.exists()  # might be a publish in progress
    server.clean_staging(grace_s=0)
    assert not left.exists()


def _cached_bytes(cache: Path) -> int:
    return sum(f.stat().st_size for d in cache.iterdir() if not d.name.startswith(".") for f in d.rglob("*")
               if f.is_file())


def test_an_s3_store_fits_a_multi_node_cluster(s3_endpoint, s3_bucket, tmp_path):
    from adapterserve.server.store_fit import check_store_fits

    check_store_fits(_store(s3_bucket, s3_endpoint, tmp_path / "c"), 8)
