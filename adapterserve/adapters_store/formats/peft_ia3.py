"""PEFT (IA)^3 adapters: one learned scale vector per targeted projection.

Keys look like ``base_model.model.model.layers.0.self_attn.k_proj.ia3_l``:
[out, 1] scales the projection's output (attention k, v), [1, in] its input
(feed-forward modules, listed in ``feedforward_modules``).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from adapterserve.adapters_store.formats.families import Adapter, Ia3Adapter
from adapterserve.adapters_store.formats.peft_head import check_modules_to_save, is_head_key
from adapterserve.adapters_store.formats.peft_common import WEIGHTS_FILE, read_config, read_weights
from adapterserve.adapters_store.formats.types import BackboneSpec
from adapterserve.adapters_store.validate import check_finite, check_kind, check_layer, module_name
from adapterserve.errors import AdapterError

_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<kind>\w+)\.ia3_l(?:\.\w+)?$")


def read_peft_ia3(path: str | Path, spec: BackboneSpec, *, name: str | None = None) -> Adapter:
    root = Path(path)
    name = name or root.name
    config = read_config(root, name)
    if str(config.get("peft_type", "")).upper() != "IA3":
        raise AdapterError(f"adapter '{name}': peft_type {config.get('peft_type')} is not IA3")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"adapter '{name}': fan_in_fan_out=true is not supported for (IA)^3 adapters")
    check_modules_to_save(name, config)
    feedforward = frozenset(_names(config.get("feedforward_modules")))
    scales = {}
    for key, tensor in read_weights(root, name).items():
        if is_head_key(key):
            continue
        layer, kind = _parse(name, key, spec)
        scales[(layer, kind)] = _vector(name, layer, kind, tensor, kind in feedforward, spec)
    if not scales:
        raise AdapterError(f"adapter '{name}' has no ia3_l tensors in {WEIGHTS_FILE}")
    return Adapter("ia3", ia3=Ia3Adapter(scales, feedforward), config=config)


def _names(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        raise AdapterError("feedforward_modules as a regular expression is not supported; list the module names")
    return [str(v).split(".")[-1] for v in value]


def _parse(name: str, key: str, spec: BackboneSpec) -> tuple[int, str]:
    match = _KEY.match(key)
    if match is None:
        raise AdapterError(f"adapter '{name}' has an unexpected tensor '{key}'; expected ...layers.<i>.<module>.ia3_l")
    layer, kind = int(match["layer"]), match["kind"]
    check_kind(name, kind, spec)
    check_layer(name, layer, kind, spec)
    return layer, kind


def _vector(name: str, layer: int, kind: str, tensor: torch.Tensor, feedforward: bool, spec: BackboneSpec) -> torch.Tensor:
    in_features, out_features = spec.linear_shapes[kind]
    expected = (1, in_features) if feedforward else (out_features, 1)
    where = module_name(layer, kind)
    if tuple(tensor.shape) != expected or not tensor.is_floating_point():
        role = "input (feed-forward)" if feedforward else "output"
        raise AdapterError(
            f"adapter '{name}': {where}.ia3_l has shape {tuple(tensor.shape)} ({tensor.dtype}); scaling its "
            f"{role} needs a floating-point {expected}; was it made for another model?"
        )
    check_finite(name, f"{where}.ia3_l", tensor)
    return tensor.reshape(-1).to(torch.float32)
