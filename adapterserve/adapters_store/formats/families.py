"""Adapters of every family, as the engine serves them under one id.

An ``Adapter`` holds what one PEFT (or AdapterHub) directory trained: one
mechanism (LoRA, (IA)^3, prompt, prefix, bottleneck) and optionally a
classification head. Readers produce these; the engine places them in slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from adapterserve.adapters_store.formats.types import ClassifierHead, LoraAdapter


@dataclass
class Ia3Adapter:
    """(IA)^3 scale vectors keyed by (layer, module kind).

    Kinds in ``feedforward`` scale the module's input [in_features]; the others
    scale its output [out_features] (bias included), as PEFT does.
    """

    scales: dict[tuple[int, str], torch.Tensor]
    feedforward: frozenset[str]


@dataclass
class PromptAdapter:
    """Prompt tuning or P-tuning: virtual-token embeddings put before the prompt."""

    embeddings: torch.Tensor  # [P, hidden] float32 (P-tuning: its encoder already applied)

    @property
    def num_virtual(self) -> int:
        return self.embeddings.shape[0]


@dataclass
class PrefixAdapter:
    """Prefix tuning: per-layer keys and values every request attends first."""

    keys: torch.Tensor  # [layers, P, kv_heads, head_dim] float32
    values: torch.Tensor  # [layers, P, kv_heads, head_dim] float32

    @property
    def num_virtual(self) -> int:
        return self.keys.shape[1]


@dataclass
class Adapter:
    """Everything served under one adapter id."""

    kind: str  # "lora", "ia3", "prompt_tuning", "p_tuning", "prefix_tuning", "bottleneck"
    lora: LoraAdapter | None = None
    ia3: Ia3Adapter | None = None
    prompt: PromptAdapter | None = None
    prefix: PrefixAdapter | None = None
    bottleneck: object | None = None  # BottleneckAdapter (AdapterHub format)
    head: ClassifierHead | None = None
    config: dict = field(default_factory=dict)
    staged: dict = field(default_factory=dict, repr=False)  # pools' host copies, ready to load

    @property
    def num_virtual(self) -> int:
        """Virtual tokens a request of this adapter carries in front of its prompt."""
        return self.prompt.num_virtual if self.prompt is not None else 0

    @property
    def prefix_len(self) -> int:
        return self.prefix.num_virtual if self.prefix is not None else 0
