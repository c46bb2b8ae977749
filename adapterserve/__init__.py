"""adapterserve: one frozen backbone, many adapters of every PEFT family, one batch."""
from adapterserve.config import EngineConfig
from adapterserve.engine.engine import Engine
from adapterserve.engine.request import RequestOutput
from adapterserve.engine.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
