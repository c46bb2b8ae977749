"""Classifier-head pool: each slot's head weights; label counts may differ."""
from __future__ import annotations

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.errors import AdapterError


class HeadPool:
    family = "head"

    def __init__(self, num_slots: int, max_labels: int, hidden: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.max_labels = max_labels
        self.weight = torch.zeros(num_slots, max_labels, hidden, dtype=dtype, device=device)
        self.bias = torch.zeros(num_slots, max_labels, dtype=torch.float32, device=device)
        self.num_labels = torch.zeros(num_slots, dtype=torch.long, device=device)

    def check_servable(self, adapter: Adapter, name: str) -> None:
        head = adapter.head
        if head is not None and head.num_labels > self.max_labels:
            raise AdapterError(
                f"adapter '{name}' has a head with {head.num_labels} labels; this server accepts at most "
                f"{self.max_labels} (EngineConfig.max_labels)"
            )

    def place(self, slot: int, adapter: Adapter) -> bool:
        head = adapter.head
        if head is not None:
            n = head.num_labels
            self.weight[slot, :n] = head.weight.to(self.weight.dtype)
            self.bias[slot] = 0
            if head.bias is not None:
                self.bias[slot, :n] = head.bias.float()
            self.num_labels[slot] = n
        return True

    def clear(self, slot: int) -> None:
        self.num_labels[slot] = 0

    def logits(self, pooled: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """pooled: [M, D], slots: [M] -> float32 [M, max_labels], -inf past each head's labels."""
        weight = self.weight[slots]  # [M, L, D]
        logits = torch.bmm(weight.float(), pooled.float().unsqueeze(-1)).squeeze(-1) + self.bias[slots]
        labels = torch.arange(self.max_labels, device=pooled.device)
        return logits.masked_fill(labels >= self.num_labels[slots].unsqueeze(1), float("-inf"))
