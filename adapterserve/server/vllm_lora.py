"""vLLM-compatible adapter routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

    {"lora_name": "sql", "lora_path": "/srv/adapters/sql"}      -> publishes sql@N (the next version)
    {"lora_name": "sql", "lora_path": "s3://bucket/adapters/sql", "public": true}
    {"lora_name": "sql@2"}  (unload)                             -> deletes sql@2; "sql": every version

Loading validates the files against the served backbones and publishes them into the
store for the calling tenant, as an upload does; loading the newest version's exact
content again returns that version. Where `lora_path` may point is lora_sources.py's
business. Unloading deletes as DeleteAdapter does (running requests finish). Keys vLLM
also sends (`lora_int_id`, `load_inplace`) are ignored: every load is a new version.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapterserve import request_fields as check
from adapterserve.adapters_store.records import AdapterVersion, check_name, parse_ref
from adapterserve.errors import RequestError
from adapterserve.server import openai_common as common
from adapterserve.server.openai_models import adapter_entry

MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class LoadCall:
    name: str
    path: str
    public: bool

    @property
    def on_s3(self) -> bool:
        return self.path.startswith("s3://")


def parse_load(body: Any) -> LoadCall:
    body = common.check_body(body)
    name = _checked_name(body.get("lora_name"), "lora_name")
    if body.get("lora_path") is None:
        raise RequestError("'lora_path' is required: a directory on the server or s3://bucket/prefix")
    path = check.text("lora_path", body["lora_path"], MAX_PATH_CHARS)
    if "://" in path and not path.startswith("s3://"):
        raise RequestError(f"'lora_path' {check.short(path)} must be a directory on the server or an s3:// URI")
    return LoadCall(name, path, common.flag(body, "public"))


def parse_unload(body: Any) -> tuple[str, int | None]:
    """(name, version or None for every version) of the adapter to delete."""
    body = common.check_body(body)
    if body.get("lora_name") is None:
        raise RequestError("'lora_name' is required: NAME (every version) or NAME@VERSION")
    ref = check.text("lora_name", body["lora_name"], 200)
    try:
        return parse_ref(ref)
    except RequestError as exc:
        raise RequestError(f"'lora_name' is invalid: {exc}") from None


def _checked_name(value: Any, field: str) -> str:
    if value is None:
        raise RequestError(f"'{field}' is required: the adapter's name")
    try:
        return check_name(check.text(field, value, 64))
    except RequestError as exc:
        if str(exc).startswith(f"'{field}'"):
            raise
        raise RequestError(f"'{field}' is invalid: {exc}") from None


def loaded_body(version: AdapterVersion, default_backbone: str) -> dict[str, Any]:
    """The new version as a model object, with `lora_name` and `version`."""
    return {**adapter_entry(version, version.ref, default_backbone), "lora_name": version.name,
            "version": version.version}


def unloaded_body(deleted: list[AdapterVersion]) -> dict[str, Any]:
    return {"deleted": [v.ref for v in deleted]}
