"""Checks a Serve config (serveConfigV2) the way Ray and adapterserve will read it.

Ray's ServeDeploySchema silently drops fields it does not know, so a typo such as
`max_ongoing_request` would pass unnoticed: fields that do not survive parsing are
reported here. The adapterserve application's `args` are checked by the server's
own settings merge (unknown keys refused) and EngineConfig.
"""
from __future__ import annotations

from typing import Any, Iterable

import yaml

APP_BUILDER = "adapterserve.server.app:app_builder"


def check_serve_config(text: str, where: str) -> list[str]:
    """Problems of a serve config text, each 'WHERE: field.path: problem'."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return [f"{where}: not YAML: {exc}"]
    if not isinstance(raw, dict):
        return [f"{where}: expected a mapping (ServeDeploySchema), got {type(raw).__name__}"]
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        parsed = ServeDeploySchema.model_validate(raw)
    except ValidationError as exc:
        return [f"{where}: {_loc(e['loc'])}: {e['msg']}" for e in exc.errors()]
    kept = parsed.model_dump(exclude_unset=True)
    problems = [f"{where}: {path}: unknown field (Ray ignores it)" for path in dropped(raw, kept)]
    for i, app in enumerate(raw.get("applications", [])):
        for j, dep in enumerate(app.get("deployments") or []):
            if isinstance(dep.get("autoscaling_config"), dict):
                at = f"applications[{i}].deployments[{j}].autoscaling_config"
                problems += [f"{where}: {p}" for p in check_autoscaling(dep["autoscaling_config"], at)]
        if app.get("import_path") == APP_BUILDER:
            problems += [f"{where}: applications[{i}].args: {p}" for p in check_app_args(app.get("args") or {})]
    return problems


def check_autoscaling(config: dict[str, Any], at: str) -> list[str]:
    """ServeDeploySchema leaves autoscaling_config a plain dict: check it as Serve will."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig

    try:
        parsed = AutoscalingConfig.model_validate(config)
    except ValidationError as exc:
        return [f"{at}.{_loc(e['loc'])}: {e['msg']}" for e in exc.errors()]
    kept = parsed.model_dump(exclude_unset=True)
    return [f"{path}: unknown field (Ray ignores it)" for path in dropped(config, kept, at)]


def dropped(raw: Any, kept: Any, path: str = "") -> Iterable[str]:
    """Paths of mapping keys in `raw` that are missing from `kept`."""
    if isinstance(raw, dict) and isinstance(kept, dict):
        for key, value in raw.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in kept:
                yield where
            else:
                yield from dropped(value, kept[key], where)
    elif isinstance(raw, list) and isinstance(kept, list):
        for i, (a, b) in enumerate(zip(raw, kept, strict=False)):
            yield from dropped(a, b, f"{path}[{i}]")


def check_app_args(args: dict[str, Any]) -> list[str]:
    """What adapterserve's build_app would refuse in `args`, short of reading the model."""
    from adapterserve.config import EngineConfig
    from adapterserve.server.settings import merge_config

    try:
        EngineConfig(**merge_config(args)["engine"])
    except (TypeError, ValueError) as exc:
        return [str(exc)]
    return []


def _loc(loc: tuple) -> str:
    text = ""
    for part in loc:
        text = f"{text}[{part}]" if isinstance(part, int) else (f"{text}.{part}" if text else str(part))
    return text
