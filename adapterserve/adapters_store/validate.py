"""Checks an adapter against the backbone it will serve, before anything is stored.

Format readers (PEFT LoRA now; IA3, bottleneck, ... later) parse files into the
types of ``formats.types``; these checks need no files and raise ``AdapterError``
with the module, the shapes and the limit in the message.
"""
from __future__ import annotations

import math

import torch

from adapterserve.adapters_store.formats.types import BackboneSpec, LoraAdapter, LoraModule
from adapterserve.errors import AdapterError

# Which sublayer of a decoder layer holds each projection (for names in messages).
_PARENT = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}


def module_name(layer: int, kind: str) -> str:
    """Hugging Face name of a decoder projection, e.g. ``layers.0.self_attn.o_proj``."""
    parent = _PARENT.get(kind)
    return f"layers.{layer}.{parent}.{kind}" if parent else f"layers.{layer}.{kind}"


def parent_of(kind: str) -> str | None:
    """``self_attn`` or ``mlp`` for a known decoder projection, else None."""
    return _PARENT.get(kind)


def check_kind(name: str, kind: str, spec: BackboneSpec) -> None:
    if kind not in spec.linear_shapes:
        raise AdapterError(
            f"adapter '{name}' targets '{kind}' which {spec.model_type} backbones do not have "
            f"(they have {', '.join(spec.linear_shapes)})"
        )


def check_layer(name: str, layer: int, kind: str, spec: BackboneSpec) -> None:
    if not 0 <= layer < spec.num_layers:
        raise AdapterError(
            f"adapter '{name}' targets {module_name(layer, kind)} but the backbone has "
            f"{spec.num_layers} layers (0..{spec.num_layers - 1}); was it made for another model?"
        )


def check_finite(name: str, where: str, tensor: torch.Tensor) -> None:
    if not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise AdapterError(f"adapter '{name}' has {bad} NaN or Inf values in {where}; retrain or re-export it")


def check_lora_module(name: str, layer: int, kind: str, module: LoraModule, spec: BackboneSpec, max_rank: int) -> None:
    """Shapes, rank limit and finiteness of one adapted projection."""
    where = module_name(layer, kind)
    a, b = module.a, module.b
    if a.dim() != 2 or b.dim() != 2:
        raise AdapterError(
            f"adapter '{name}' has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} at {where}; "
            "both must be 2-D matrices"
        )
    if a.shape[0] != b.shape[1]:
        raise AdapterError(
            f"adapter '{name}' has lora_A of rank {a.shape[0]} but lora_B of rank {b.shape[1]} at {where} "
            f"(shapes {tuple(a.shape)} and {tuple(b.shape)})"
        )
    in_features, out_features = spec.linear_shapes[kind]
    for what, got, want in (("in_features", a.shape[1], in_features), ("out_features", b.shape[0], out_features)):
        if got != want:
            raise AdapterError(
                f"adapter '{name}' targets {where} with {what} {got} but the backbone has {want}; "
                "was it made for another model?"
            )
    if module.rank > max_rank:
        raise AdapterError(
            f"adapter '{name}' has rank {module.rank} at {where}, above the maximum rank {max_rank} "
            "this engine was started with; restart it with a larger max_lora_rank or use a smaller rank"
        )
    if module.rank < 1:
        raise AdapterError(f"adapter '{name}' has rank 0 at {where}")
    if not math.isfinite(module.scaling):
        raise AdapterError(f"adapter '{name}' has a non-finite scaling {module.scaling} at {where}")
    check_finite(name, f"{where}.lora_A", a)
    check_finite(name, f"{where}.lora_B", b)


def check_lora_adapter(name: str, adapter: LoraAdapter, spec: BackboneSpec, max_rank: int) -> None:
    """Every module of a LoRA adapter fits the backbone and the engine's rank limit."""
    if not adapter.modules:
        raise AdapterError(f"adapter '{name}' holds no LoRA weights")
    for (layer, kind), module in sorted(adapter.modules.items()):
        check_kind(name, kind, spec)
        check_layer(name, layer, kind, spec)
        check_lora_module(name, layer, kind, module, spec, max_rank)
