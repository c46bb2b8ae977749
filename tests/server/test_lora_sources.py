"""Where load_lora_adapter may read (lora_sources.py) and its bodies (vllm_lora.py): real
directories and a real S3 server (moto's server mode on loopback); no Ray needed."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from adapterserve.adapters_store.staging import StoreLimits
from adapterserve.errors import AccessDenied, AdapterError, AdapterNotFound, AdapterTooLarge, RequestError
from adapterserve.server.lora_sources import AdapterSources, check_sources, parse_s3
from adapterserve.server.vllm_lora import parse_load, parse_unload
from tests.helpers.moto_s3 import start_moto

LIMITS = StoreLimits(max_total_bytes=1000, max_files=3)


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    allowed, store = tmp_path / "allowed", tmp_path / "store"
    (allowed / "sql").mkdir(parents=True)
    store.mkdir()
    return allowed, store


def test_local_paths_only_under_the_listed_directories(roots, tmp_path):
    allowed, store = roots
    sources = AdapterSources([str(allowed)], {}, str(store), {})
    assert sources.local(str(allowed / "sql")) == allowed / "sql"
    assert sources.local(str(allowed / "sql" / ".." / "sql")) == allowed / "sql"
    for outside in (tmp_path, allowed / ".." / "elsewhere", Path("/etc")):
        with pytest.raises(AccessDenied, match="is not under a directory this server may read adapters from"):
            sources.local(str(outside))
    with pytest.raises(RequestError, match="must be an absolute path on the server"):
        sources.local("allowed/sql")


def test_a_symbolic_link_out_of_a_listed_directory_is_refused(roots, tmp_path):
    allowed, store = roots
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", allowed / "link")
    with pytest.raises(AccessDenied, match="is not under a directory"):
        AdapterSources([str(allowed)], {}, str(store), {}).local(str(allowed / "link"))


def test_the_store_itself_is_never_a_source(roots, tmp_path):
    allowed, store = roots
    sources = AdapterSources([str(tmp_path)], {}, str(store), {})
    for inside in (store, store / "data" / "sql", tmp_path):
        with pytest.raises(AccessDenied, match="points into the adapter store"):
            sources.local(str(inside))


def test_without_sources_loading_by_path_is_off(roots):
    allowed, store = roots
    sources = AdapterSources([], {}, str(store), {})
    with pytest.raises(AccessDenied, match="loading by path is off on this server"):
        sources.local(str(allowed / "sql"))
    with pytest.raises(AccessDenied, match="loading by path is off"):
        sources.s3("s3://bucket/sql")


def test_s3_locations_under_the_listed_prefixes():
    sources = AdapterSources(["s3://team/adapters", "s3://open"], {}, "s3://team/store", {"endpoint_url": "http://e"})
    assert sources.s3("s3://team/adapters/sql") == parse_s3("s3://team/adapters/sql/")
    assert sources.s3("s3://open").prefix == ""
    for refused in ("s3://team/adapters-old/sql", "s3://team/other", "s3://elsewhere/adapters"):
        with pytest.raises(AccessDenied, match="is not under an S3 location"):
            sources.s3(refused)
    assert sources.s3_options == {"endpoint_url": "http://e"}  # the store's endpoint by default
    anywhere = AdapterSources(["s3://"], {"region_name": "x"}, "s3://team/store", {})
    assert anywhere.s3("s3://any/thing").bucket == "any" and anywhere.s3_options == {"region_name": "x"}
    for store_part in ("s3://team", "s3://team/store", "s3://team/store/data/sql"):
        with pytest.raises(AccessDenied, match="points into the adapter store"):
            anywhere.s3(store_part)
    with pytest.raises(RequestError, match="names no bucket"):
        anywhere.s3("s3:///x")


def test_config_sources_are_checked_and_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert check_sources(["adapters", "s3://b/p"]) == [str(tmp_path / "adapters"), "s3://b/p"]
    for bad in ("s3://b", [""], [3]):
        with pytest.raises(ValueError, match="lora_sources must be a list"):
            check_sources(bad)


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto.server")
    running, s3 = start_moto()
    yield s3
    running.stop()


def test_an_s3_adapter_is_downloaded_with_its_folder_and_without_hidden_files(s3, tmp_path):
    client = s3.client()
    for key, data in {"ok/adapter_config.json": b"{}", "ok/weights/a.safetensors": b"123",
                      "ok/.cache/x": b"skip", "ok/": b""}.items():
        client.put_object(Bucket=s3.bucket, Key=key, Body=data)
    sources = AdapterSources([f"s3://{s3.bucket}"], s3.options, "/nowhere", {})
    out = sources.download(sources.s3(f"s3://{s3.bucket}/ok"), tmp_path, LIMITS)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "adapter_config.json", "weights/a.safetensors"]


@pytest.mark.parametrize("keys, error, says", [
    ({"deep/a/b/c": b"x"}, AdapterError, "at most one folder down"),
    ({"odd/a b": b"x"}, AdapterError, "holds 'a b'"),
    ({f"many/{i}": b"x" for i in range(4)}, AdapterTooLarge, "more than 3 files or 1000 bytes"),
    ({"big/a": b"x" * 1001}, AdapterTooLarge, "more than 3 files or 1000 bytes"),
    ({}, AdapterNotFound, "holds no adapter files"),
])
def test_s3_sources_that_no_upload_could_hold_are_refused_before_any_download(s3, tmp_path, keys, error, says):
    client = s3.client()
    prefix = next(iter(keys), "empty/").split("/")[0]
    for key, data in keys.items():
        client.put_object(Bucket=s3.bucket, Key=key, Body=data)
    sources = AdapterSources([f"s3://{s3.bucket}"], s3.options, "/nowhere", {})
    with pytest.raises(error, match=says):
        sources.download(sources.s3(f"s3://{s3.bucket}/{prefix}"), tmp_path, LIMITS)
    assert not any(tmp_path.iterdir())


def test_a_missing_bucket_is_not_found(s3, tmp_path):
    sources = AdapterSources(["s3://"], s3.options, "/nowhere", {})
    with pytest.raises(AdapterNotFound, match="no such bucket"):
        sources.download(sources.s3("s3://no-such-bucket-here/x"), tmp_path, LIMITS)


# --- the vLLM bodies ---------------------------------------------------------------


def test_load_and_unload_bodies():
    call = parse_load({"lora_name": "sql", "lora_path": "s3://b/p", "public": True, "lora_int_id": 3})
    assert (call.name, call.path, call.public, call.on_s3) == ("sql", "s3://b/p", True, True)
    assert parse_load({"lora_name": "sql", "lora_path": "/srv/sql", "public": None}).public is False
    assert parse_unload({"lora_name": "sql"}) == ("sql", None)
    assert parse_unload({"lora_name": "sql@2"}) == ("sql", 2)


@pytest.mark.parametrize("parse, body, says", [
    (parse_load, {"lora_path": "/x"}, "'lora_name' is required"),
    (parse_load, {"lora_name": 5, "lora_path": "/x"}, "'lora_name' must be a string"),
    (parse_load, {"lora_name": "Bad Name", "lora_path": "/x"}, "'lora_name' is invalid: adapter name 'Bad Name'"),
    (parse_load, {"lora_name": "sql@2", "lora_path": "/x"}, "'lora_name' is invalid"),
    (parse_load, {"lora_name": "sql"}, "'lora_path' is required"),
    (parse_load, {"lora_name": "sql", "lora_path": ""}, "'lora_path' is empty"),
    (parse_load, {"lora_name": "sql", "lora_path": ["/x"]}, "'lora_path' must be a string"),
    (parse_load, {"lora_name": "sql", "lora_path": "/" + "x" * 5000}, "'lora_path' has 5001 characters"),
    (parse_load, {"lora_name": "sql", "lora_path": "https://hub/x"}, "'lora_path' 'https://hub/x' must be a directory"),
    (parse_load, {"lora_name": "sql", "lora_path": "/x", "public": "yes"}, "'public' must be true or false"),
    (parse_load, ["sql"], "the request body must be a JSON object"),
    (parse_unload, {}, "'lora_name' is required: NAME (every version) or NAME@VERSION"),
    (parse_unload, {"lora_name": "sql@0"}, "'lora_name' is invalid"),
    (parse_unload, {"lora_name": 1}, "'lora_name' must be a string"),
])
def test_bad_load_and_unload_bodies_name_the_field(parse, body, says):
    with pytest.raises(RequestError) as caught:
        parse(body)
    assert str(caught.value).startswith(says), str(caught.value)
