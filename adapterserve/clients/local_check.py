"""The upload's check before any byte is sent: is the adapter fit for the server's backbone?

Always: the file count and total size against the server's limits. Where the engine's
packages are installed (`pip install 'adapterserve[engine]'`: torch, safetensors), also
the adapter itself, read as the server will read it against the generation backbone:
its config, tensor names and shapes, rank and values. A client-only install leaves
that to the server, which refuses an unfit adapter with INVALID_ARGUMENT when the
upload arrives; nothing is published either way.
"""
from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Collection

from adapterserve.clients.client import Client
from adapterserve.errors import AdapterTooLarge

ENGINE_MODULES = ("torch", "safetensors")


def can_read_adapters() -> bool:
    """Whether this install can read adapter weights (the [engine] extra is present)."""
    return all(importlib.util.find_spec(m) is not None for m in ENGINE_MODULES)


def check_locally(client: Client, directory: str, name: str, total_bytes: int, num_files: int) -> None:
    """AdapterTooLarge past the server's limits; AdapterError if the adapter is unfit for the
    generation backbone (checked only where `can_read_adapters()`)."""
    info = client.server_info()
    if total_bytes > info.max_upload_bytes or num_files > info.max_upload_files:
        raise AdapterTooLarge(
            f"{directory!r} holds {num_files} files, {total_bytes} bytes; the server takes at most "
            f"{info.max_upload_files} files, {info.max_upload_bytes} bytes"
        )
    if not can_read_adapters():
        return  # the server reads it
    if info.encoder_id and not _targets_any(directory, info.linear_shapes):
        return  # made for the encoder, which ServerInfo does not describe: the server checks it
    from adapterserve.adapters_store.formats.peft_lora import read_peft_lora
    from adapterserve.adapters_store.formats.types import BackboneSpec

    spec = BackboneSpec(info.model_type, info.num_layers, info.hidden_size, info.linear_shapes)
    read_peft_lora(directory, spec, info.max_lora_rank, name=name)


def _targets_any(directory: str, modules: Collection[str]) -> bool:
    """Whether the PEFT config in `directory` targets any of `modules` (the generation backbone's)."""
    try:
        with open(os.path.join(directory, "adapter_config.json")) as f:
            targets = json.load(f).get("target_modules") or []
    except (OSError, ValueError, AttributeError):
        return False
    targets = [targets] if isinstance(targets, str) else targets
    return any(isinstance(t, str) and t.split(".")[-1] in modules for t in targets)
