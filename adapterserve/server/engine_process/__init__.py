"""The engine a replica drives: in a child process of its own (EngineProcess, the
default: the replica's event loop then only relays) or in the replica's process
(LocalEngine). Both offer the same async API."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adapterserve.server.engine_process.facts import EngineFacts, EngineLoad
from adapterserve.server.engine_process.local import LocalEngine
from adapterserve.server.engine_process.proxy import EngineProcess

__all__ = ["EngineFacts", "EngineLoad", "EngineProcess", "LocalEngine", "start_engine"]


def start_engine(model_dir: str | Path, engine_kwargs: Mapping[str, Any], own_process: bool) -> EngineProcess | LocalEngine:
    """Build the engine for `model_dir` (Engine.from_pretrained keyword arguments), in a child process or here."""
    if own_process:
        return EngineProcess(model_dir, engine_kwargs)
    return LocalEngine.from_pretrained(model_dir, engine_kwargs)
