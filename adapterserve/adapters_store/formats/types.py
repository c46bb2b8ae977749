"""What every adapter reader produces: weights in a layout the engine can place.

Readers turn files (PEFT, AdapterHub) into these; the engine never sees files.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Projections of a Llama-family decoder layer that LoRA may target.
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class BackboneSpec:
    """What an adapter is checked against: the served backbone's shapes."""

    model_type: str
    num_layers: int
    hidden_size: int
    linear_shapes: dict[str, tuple[int, int]]  # module kind -> (in_features, out_features)


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear layer: delta_W = scaling * b @ a."""

    a: torch.Tensor  # [rank, in_features] float32
    b: torch.Tensor  # [out_features, rank] float32
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoraAdapter:
    """A LoRA adapter: the adapted modules keyed by (layer index, module kind)."""

    modules: dict[tuple[int, str], LoraModule]
    config: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    def kind_rank(self, kind: str) -> int:
        """Largest rank over layers for one module kind (0 if never targeted)."""
        return max((m.rank for (_, k), m in self.modules.items() if k == kind), default=0)
