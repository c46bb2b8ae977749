"""adapterserve: one frozen backbone, many adapters of every PEFT family, one batch.

The engine's names load on first use (PEP 562), so `import adapterserve` and the
client, the CLI and uploads never import torch, transformers, triton, numpy or ray.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]

_HOME = {  # public name -> the module that defines it
    "Engine": "adapterserve.engine.engine",
    "EngineConfig": "adapterserve.config",
    "RequestOutput": "adapterserve.engine.request",
    "SamplingParams": "adapterserve.engine.sampling_params",
}

if TYPE_CHECKING:
    from adapterserve.config import EngineConfig
    from adapterserve.engine.engine import Engine
    from adapterserve.engine.request import RequestOutput
    from adapterserve.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'adapterserve' has no attribute {name!r}")
    try:
        module = importlib.import_module(home)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"adapterserve.{name} needs the engine's packages ({e}): "
                                  "pip install 'adapterserve[engine]'", name=e.name) from e
    value = getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
