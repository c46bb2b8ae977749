"""What every adapter reader produces: weights in a layout the engine can place.

Readers turn files (PEFT, AdapterHub) into these; the engine never sees files.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Projections of a Llama-family decoder layer that LoRA may target.
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterLimits:
    """The largest adapters the served pools take (formats/read.py checks them)."""

    max_lora_rank: int = 64
    max_virtual_tokens: int = 64
    max_bottleneck_rank: int = 64


@dataclass(frozen=True)
class BackboneSpec:
    """What an adapter is checked against: the served backbone's shapes."""

    model_type: str
    num_layers: int
    hidden_size: int
    linear_shapes: dict[str, tuple[int, int]]  # module kind -> (in_features, out_features)
    num_kv_heads: int = 0  # attention shape, for prefix tuning (0 = unknown)
    head_dim: int = 0
    layers_prefix: str = "model.layers"  # module path of the layer list in a Hugging Face model


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


# Projections of a BERT-family encoder layer, named by their Hugging Face module path
# below ``encoder.layer.<i>.``, so PEFT target names match them as they match BERT's.
ENCODER_LINEARS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)

# Where a bottleneck adapter sits in a layer: after attention, after the feed-forward block.
BOTTLENECK_POSITIONS = ("mh", "output")


@dataclass(frozen=True)
class BottleneckModule:
    """One bottleneck at one place: update = act(h @ down.T + down_bias) @ up + up_bias."""

    down: torch.Tensor  # [rank, D] float32, rows of W_down
    down_bias: torch.Tensor  # [rank]
    up: torch.Tensor  # [rank, D] rows of W_up^T, the config's scaling folded in
    up_bias: torch.Tensor  # [D], scaling folded in
    activation: str  # a name of kernels.reference.ACTIVATIONS: relu, gelu, gelu_new, silu, tanh

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass
class BottleneckAdapter:
    """A Houlsby or Pfeiffer adapter: bottlenecks keyed by (layer index, position).

    original_ln_before: the adapter reads norm(x + residual) (Pfeiffer) instead of
    the sublayer output x (Houlsby). Every other option is fixed to what both
    configurations use (residual_before_ln, original_ln_after, no own LayerNorm).
    """

    modules: dict[tuple[int, str], BottleneckModule]
    original_ln_before: bool
    config: dict = field(default_factory=dict)
    head: "ClassifierHead | None" = None

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())


@dataclass(frozen=True)
class HeadLayer:
    """One linear layer of a classifier head, then its activation (None: none)."""

    weight: torch.Tensor  # [out_features, in_features] float32
    bias: torch.Tensor | None  # [out_features]
    activation: str | None


@dataclass(frozen=True)
class ClassifierHead:
    """A task's classifier on the pooled output: logits = layers(pool(hidden)).

    pooling: "cls" (the first token's last hidden state), "pooler" (BERT's pooler on
    it), "mean" (masked mean), or "last" (a decoder's last token).
    """

    layers: tuple[HeadLayer, ...]
    pooling: str
    id2label: dict[int, str]

    @property
    def num_labels(self) -> int:
        return self.layers[-1].weight.shape[0]
