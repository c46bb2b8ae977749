"""The engine a replica drives: in a child process of its own (EngineProcess, the
default: the replica's event loop then only relays) or in the replica's process
(LocalEngine), watched and restarted by an EngineSupervisor. All offer the same async API."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from adapterserve.errors import EngineDied
from adapterserve.server.engine_process.facts import EngineFacts, EngineLoad
from adapterserve.server.engine_process.local import LocalEngine
from adapterserve.server.engine_process.placement import child_placement
from adapterserve.server.engine_process.proxy import EngineProcess
from adapterserve.server.engine_process.supervisor import EngineSupervisor

__all__ = ["EngineFacts", "EngineLoad", "EngineProcess", "EngineSupervisor", "LocalEngine", "start_engine"]


def start_engine(model_dir: str | Path, engine_kwargs: Mapping[str, Any], own_process: bool,
                 on_exit: Callable[[EngineDied], None] | None = None) -> EngineProcess | LocalEngine:
    """Build the engine for `model_dir` (Engine.from_pretrained keyword arguments), in a child
    process (`on_exit` is called if it dies) or here."""
    if own_process:  # a tensor-parallel child places its workers in the replica's placement group
        return EngineProcess(model_dir, {**engine_kwargs, **child_placement(engine_kwargs)}, on_exit=on_exit)
    return LocalEngine.from_pretrained(model_dir, engine_kwargs)
