"""OpenAI-compatible model objects: GET /v1/models and GET /v1/models/{model}.

The list holds the generation backbone, the encoder (when the server runs one), and the
adapters the caller may use: for each name one entry `name` (its newest version; `root`
says which) followed by one entry per version `name@N`. An adapter's `parent` is the
backbone the store recorded when it validated the upload; `owned_by` its tenant.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from adapterserve.adapters_store.records import AdapterVersion


def backbone_entry(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "adapterserve", "root": model_id,
            "parent": None}


def adapter_entry(version: AdapterVersion, shown_id: str, default_backbone: str) -> dict[str, Any]:
    """`version` listed as `shown_id` (its ref, or its bare name for the newest version)."""
    return {"id": shown_id, "object": "model", "created": int(version.created_at.timestamp()),
            "owned_by": version.tenant or "adapterserve", "root": version.ref,
            "parent": parent_of(version, default_backbone)}


def parent_of(version: AdapterVersion, default_backbone: str) -> str:
    return (version.info or {}).get("backbone") or default_backbone  # older records: the generation backbone


def models_body(model_id: str, encoder_id: str | None, versions: Sequence[AdapterVersion]) -> dict[str, Any]:
    data = [backbone_entry(model_id)] + ([backbone_entry(encoder_id)] if encoder_id else [])
    by_name: dict[str, list[AdapterVersion]] = {}
    for version in versions:
        by_name.setdefault(version.name, []).append(version)
    for name, group in by_name.items():
        data.append(adapter_entry(max(group, key=lambda v: v.version), name, model_id))
        data += [adapter_entry(v, v.ref, model_id) for v in sorted(group, key=lambda v: v.version)]
    return {"object": "list", "data": data}
