"""The upload's check before any byte is sent: is the adapter fit for the server's backbones?

Always (no torch needed): the file count and total size against the server's limits, and
each file against the upload rules (only an adapter's own files plus a README / LICENSE /
model card, each capped). Where the engine's packages are installed
(`pip install 'adapterserve[engine]'`: torch, safetensors), also the adapter itself, with
the server's own check (adapters_store/fit.py) against every backbone the server describes:
every format, shapes, ranks and the engine's pool limits. A client-only install leaves
that to the server, which refuses an unfit adapter with INVALID_ARGUMENT when the upload
arrives; nothing is published either way.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from adapterserve.adapters_store.staging import (
    StoreLimits,
    check_paths_distinct,
    check_upload_file,
)
from adapterserve.clients.client import Client
from adapterserve.errors import AdapterTooLarge

ENGINE_MODULES = ("torch", "safetensors")


def can_read_adapters() -> bool:
    """Whether this install can read adapter weights (the [engine] extra is present)."""
    return all(importlib.util.find_spec(m) is not None for m in ENGINE_MODULES)


def check_locally(client: Client, directory: str, name: str, files: Sequence[tuple[str, int]]) -> None:
    """AdapterTooLarge past the server's limits; AdapterError for a file an upload may not hold,
    or an adapter unfit for every served backbone (checked only where `can_read_adapters()`).
    `files`: (path, size) of each file the upload would send."""
    info = client.server_info()
    limits = StoreLimits(max_total_bytes=max(1, info.max_upload_bytes), max_files=max(1, info.max_upload_files))
    check_paths_distinct([path for path, _ in files])
    for path, size in files:  # first: a stray file is named, whatever its size
        check_upload_file(path, size, limits)
    total, count = sum(size for _, size in files), len(files)
    if total > info.max_upload_bytes or count > info.max_upload_files:
        raise AdapterTooLarge(
            f"{directory!r} holds {count} files, {total} bytes; the server takes at most "
            f"{info.max_upload_files} files, {info.max_upload_bytes} bytes"
        )
    if not can_read_adapters() or not info.backbones:
        return  # the server reads it (a server too old to describe its backbones, too)
    from adapterserve.adapters_store.fit import adapter_validator

    adapter_validator(info.backbones, name)(Path(directory))
