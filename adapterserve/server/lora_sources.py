"""Where /v1/load_lora_adapter (and `adapterserve upload s3://...`) may read an adapter from.

`lora_path` is read by the server, with the server's rights, so the config lists what
it may read (`lora_sources`, empty by default: loading by path is off):

- a local directory `/srv/adapters`: paths inside it (symbolic links resolved first);
- `s3://bucket/prefix`: keys under that prefix; `s3://bucket`: the whole bucket;
  `s3://`: any bucket the server's credentials reach.

A path into the adapter store itself is refused whatever the list says (it would hand
one tenant another's files). An S3 source is listed first: more files or bytes than an
upload may hold are refused before anything is downloaded; each key must be a name an
upload may hold (no `..`, at most one folder down). S3 is reached with boto3's
credential chain and `lora_s3_options` (boto3 client options such as endpoint_url;
by default the store's endpoint_url when the store is on S3).
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapterserve.adapters_store.staging import StoreLimits
from adapterserve.errors import AccessDenied, AdapterError, AdapterNotFound, AdapterTooLarge, RequestError

_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_S3 = "s3://"


@dataclass(frozen=True)
class S3Location:
    bucket: str  # "" = any bucket (a source only)
    prefix: str  # "" or ending in "/"

    def __str__(self) -> str:
        return _S3 + f"{self.bucket}/{self.prefix}".rstrip("/") if self.bucket else _S3

    def holds(self, other: S3Location) -> bool:
        return self.bucket in ("", other.bucket) and other.prefix.startswith(self.prefix)

    def overlaps(self, other: S3Location) -> bool:
        return self.holds(other) or other.holds(self)


def parse_s3(uri: str, what: str = "lora_path") -> S3Location:
    bucket, _, prefix = uri[len(_S3):].partition("/")
    if not bucket and what == "lora_path":
        raise RequestError(f"'{what}' {uri!r} names no bucket: use s3://bucket/prefix")
    prefix = prefix.strip("/")
    return S3Location(bucket, prefix + "/" if prefix else "")


def check_sources(value: Any) -> list[str]:
    """The config's `lora_sources`, local directories made absolute; ValueError if malformed."""
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"lora_sources must be a list of directories and s3:// URIs, got {value!r}")
    return [s if s.startswith(_S3) else str(Path(s).expanduser().absolute()) for s in value]


class AdapterSources:
    def __init__(self, sources: list[str], s3_options: Mapping[str, Any], store: str,
                 store_options: Mapping[str, Any]) -> None:
        self.dirs = [Path(os.path.realpath(s)) for s in sources if not s.startswith(_S3)]
        self.buckets = [parse_s3(s, "source") for s in sources if s.startswith(_S3)]
        self.store = store
        s3_store = store.startswith(_S3)
        self.s3_options = dict(s3_options) or ({"endpoint_url": store_options["endpoint_url"]}
                                               if s3_store and store_options.get("endpoint_url") else {})

    def local(self, path: str) -> Path:
        """The directory `path` names, if the config lets the server read it (else AccessDenied)."""
        if not os.path.isabs(path):
            raise RequestError(f"'lora_path' {path!r} must be an absolute path on the server, or s3://bucket/prefix")
        real = Path(os.path.realpath(path))
        if not any(real == d or d in real.parents for d in self.dirs):
            raise AccessDenied(f"'lora_path' {path!r} is not under a directory this server may read adapters "
                               f"from; {self._allowed()}")
        if not self.store.startswith(_S3) and _overlap(real, Path(os.path.realpath(self.store))):
            raise AccessDenied(f"'lora_path' {path!r} points into the adapter store; load adapters from elsewhere")
        return real

    def s3(self, uri: str) -> S3Location:
        """The S3 location `uri` names, if the config lets the server read it (else AccessDenied)."""
        location = parse_s3(uri)
        if not any(b.holds(location) for b in self.buckets):
            raise AccessDenied(f"'lora_path' {uri!r} is not under an S3 location this server may read adapters "
                               f"from; {self._allowed()}")
        if self.store.startswith(_S3) and parse_s3(self.store, "store").overlaps(location):
            raise AccessDenied(f"'lora_path' {uri!r} points into the adapter store; load adapters from elsewhere")
        return location

    def download(self, location: S3Location, dest: Path, limits: StoreLimits) -> Path:
        """The adapter's files under `location`, written into `dest` (blocking)."""
        import boto3
        from botocore.exceptions import ClientError

        client = boto3.client("s3", **self.s3_options)
        try:
            objects = _listed(client, location, limits)
            for key, relative in objects:
                (dest / relative).parent.mkdir(parents=True, exist_ok=True)
                client.download_file(location.bucket, key, str(dest / relative))
        except ClientError as exc:
            raise _s3_error(exc, location) from None
        return dest

    def _allowed(self) -> str:
        sources = [str(d) for d in self.dirs] + [str(b) for b in self.buckets]
        if not sources:
            return "loading by path is off on this server (config lora_sources is empty): upload the files instead"
        return f"this server reads adapters only from {', '.join(sources)} (config lora_sources)"


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def _listed(client: Any, location: S3Location, limits: StoreLimits) -> list[tuple[str, str]]:
    """(key, path inside the adapter) of every object under `location`, within `limits`."""
    found, total = [], 0
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=location.prefix)
    for page in pages:
        for obj in page.get("Contents", []):
            relative = obj["Key"][len(location.prefix):]
            if not relative or relative.endswith("/") or any(p.startswith(".") for p in relative.split("/")):
                continue  # folder markers and hidden files, as a local upload skips them
            _check_key(location, relative)
            found.append((obj["Key"], relative))
            total += obj["Size"]
            if len(found) > limits.max_files or total > limits.max_total_bytes:
                raise AdapterTooLarge(f"'lora_path' {location} holds more than {limits.max_files} files or "
                                      f"{limits.max_total_bytes} bytes, this server's upload limits")
    if not found:
        raise AdapterNotFound(f"'lora_path' {location} holds no adapter files")
    return found


def _check_key(location: S3Location, relative: str) -> None:
    parts = relative.split("/")
    if len(parts) > 2 or not all(_PART.fullmatch(p) for p in parts):
        raise AdapterError(f"'lora_path' {location} holds {relative!r}: an adapter holds files at most one folder "
                           "down, named with letters, digits, '.', '_', '+' or '-'")


def _s3_error(exc: Any, location: S3Location) -> Exception:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    if code in ("NoSuchBucket", "404", "NoSuchKey"):
        return AdapterNotFound(f"'lora_path' {location}: no such bucket")
    if code in ("AccessDenied", "403"):
        return AccessDenied(f"'lora_path' {location}: this server's credentials may not read it")
    return exc
