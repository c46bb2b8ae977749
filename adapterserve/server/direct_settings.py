"""The `direct` setting (settings.DEFAULTS): whether the generation engine runs inside the
ingress deployment (one hop from HAProxy to the engine's replica) or behind it (two tiers).

    direct: auto   # true | false

true: one deployment, `Ingress`, whose replicas do the ingress's work and own the generation
engine (server/direct.py); no Serve call between them. Each replica serves whatever HAProxy
sends it (least connections), so adapter-affinity routing (server/routing.py) plays no part.
false: the Ingress calls the EngineReplica deployment through a Serve handle, which routes by
adapter (routing settings). "auto" (the default): true when the generation deployment has one
replica and no autoscaling (where routing has nothing to choose), false otherwise.

`auto` decides from `replica` in the settings. A Serve config that scales the EngineReplica
deployment through its `deployments:` list (deploy/serve_config.yaml) sets `direct: false`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

AUTO = "auto"


def check_direct(value: Any) -> None:
    """ValueError naming the setting unless `value` is "auto", true or false."""
    if not (isinstance(value, bool) or (isinstance(value, str) and value == AUTO)):
        raise ValueError(f"direct must be \"auto\", true or false (the generation engine inside the ingress "
                         f"deployment, or behind it), got {value!r}")


def runs_direct(cfg: Mapping[str, Any]) -> bool:
    """Whether the app runs the generation engine inside the ingress deployment (setting checked)."""
    value = cfg["direct"]
    check_direct(value)
    if value == AUTO:
        replica = cfg["replica"]
        return replica["num_replicas"] == 1 and not replica["autoscaling_config"]
    return value
