"""One loaded decoder shared by successive engines.

An Engine binds its KV caches and adapter pools onto the model's modules. Before
the next engine is built, every module is put back as it was after loading
(attributes, submodules, parameters and buffers), so the last engine's device
memory is freed first, whatever the engine attached.
"""
from __future__ import annotations

import argparse
import gc

import torch

from adapterserve.config import EngineConfig
from adapterserve.engine.engine import Engine
from adapterserve.models.decoder import DecoderModel
from adapterserve.models.loader import load_decoder
from benchmarks.checkpoints import SHAPES, ModelShape, scratch_dir, write_random_checkpoint

_REGISTRIES = ("_parameters", "_buffers", "_modules")


class Backbone:
    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        self._state = [(m, dict(vars(m)), {r: dict(vars(m)[r]) for r in _REGISTRIES}) for m in model.modules()]

    def engine(self, config: EngineConfig) -> Engine:
        """A fresh engine (tokenizer-less: prompts are token ids) on the backbone as loaded."""
        self.reset()
        return Engine(self.model, None, config)

    def reset(self) -> None:
        """Detach whatever the last engine bound, and free its device memory."""
        for module, attrs, registries in self._state:
            for name in set(vars(module)) - set(attrs):
                del module.__dict__[name]
            for name, value in attrs.items():
                if name not in _REGISTRIES:
                    module.__dict__[name] = value
            for name, content in registries.items():
                vars(module)[name].clear()
                vars(module)[name].update(content)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def random_backbone(name: str, device: str, dtype: str) -> tuple[Backbone, ModelShape]:
    """A random-weight checkpoint of the named shape, written once to scratch and loaded
    (bfloat16 or float32) through the normal loader."""
    shape = SHAPES[name]
    ckpt = write_random_checkpoint(shape, scratch_dir(shape.checkpoint_bytes()) / "model", device)
    model, _ = load_decoder(ckpt, torch.bfloat16 if dtype == "bfloat16" else torch.float32, device, max_positions=8192)
    return Backbone(model), shape


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model (a GPU shape) and --smoke (CPU, float32, the tiny shape, a small workload)."""
    parser.add_argument("--model", default="1b", choices=["1b", "8b"])
    parser.add_argument("--smoke", action="store_true", help="CPU, float32, tiny model, a small workload")


def model_target(args: argparse.Namespace) -> tuple[str, str, str]:
    """(shape name, device, dtype) the arguments of add_model_arguments ask for."""
    return ("tiny", "cpu", "float32") if args.smoke else (args.model, "cuda", "bfloat16")
