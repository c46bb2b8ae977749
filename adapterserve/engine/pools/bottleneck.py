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

    def rules(self) -> dict[str, Any]:
        return {"max_bottleneck_rank": self.max_rank}

    def place(self, slot: int, adapter: Adapter) -> bool:
        if adapter.bottleneck is not None:
            load_bottleneck(self.layers, slot, adapter.bottleneck)
        return True

    def clear(self, slot: int) -> None:
        load_bottleneck(self.layers, slot, None)
