"""Bottleneck-adapter pools (Houlsby, Pfeiffer): every layer's two places, after
attention ("mh") and after the feed-forward block ("output"), one row per slot."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.layers.bottleneck import add_bottleneck_pools, load_bottleneck


class BottleneckPools:
    family = "bottleneck"

    def __init__(self, layers: Sequence[torch.nn.Module], dim: int, num_slots: int, max_rank: int,
                 max_tokens: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.layers = layers
        self.max_rank = max_rank
        add_bottleneck_pools(layers, dim, num_slots, max_rank, max_tokens, dtype, device)
        self._activations: tuple[str, ...] | None = None  # of the resident bottlenecks; None: to recount

    def rules(self) -> dict[str, Any]:
        return {"max_bottleneck_rank": self.max_rank}

    def place(self, slot: int, adapter: Adapter) -> bool:
        if adapter.bottleneck is not None:
            self._activations = None
            load_bottleneck(self.layers, slot, adapter.bottleneck)
        return True

    def clear(self, slot: int) -> None:
        self._activations = None
        load_bottleneck(self.layers, slot, None)

    def activations(self) -> tuple[str, ...]:
        """Activations of the bottlenecks now resident (they shape a decode graph); counted
        again only after a slot changed (every step asks)."""
        if self._activations is None:
            self._activations = tuple(sorted({act for layer in self.layers for place in ("mh", "output")
                                              for act in getattr(layer, f"bottleneck_{place}").activations()}))
        return self._activations
