"""Classifier-head pool: each slot's head; label counts may differ between slots.

A head is one linear layer (decoders' ``score``, BERT's ``classifier``) or a
hidden layer with its activation and then the output layer (RoBERTa, AdapterHub
heads); the hidden-layer pool exists only when ``max_head_layers`` is 2.
"""
from __future__ import annotations

from typing import Any

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.adapters_store.formats.types import ClassifierHead
from adapterserve.kernels.reference import ACTIVATIONS


class HeadPool:
    family = "head"

    def __init__(self, num_slots: int, max_labels: int, max_layers: int, hidden: int, poolings: tuple[str, ...],
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.max_labels, self.max_layers, self.poolings = max_labels, max_layers, poolings
        self.weight = torch.zeros(num_slots, max_labels, hidden, dtype=dtype, device=device)
        self.bias = torch.zeros(num_slots, max_labels, dtype=torch.float32, device=device)
        self.num_labels = torch.zeros(num_slots, dtype=torch.long, device=device)
        if max_layers >= 2:
            self.hidden_weight = torch.zeros(num_slots, hidden, hidden, dtype=dtype, device=device)
            self.hidden_bias = torch.zeros(num_slots, hidden, dtype=torch.float32, device=device)
        self.heads: dict[int, ClassifierHead] = {}  # host view: slot -> head

    def rules(self) -> dict[str, Any]:
        return {"max_labels": self.max_labels, "max_head_layers": self.max_layers,
                "head_poolings": tuple(self.poolings), "hidden_size": self.weight.shape[-1]}

    def place(self, slot: int, adapter: Adapter) -> bool:
        head = adapter.head
        if head is None:
            return True
        *hidden, out = head.layers
        n = out.weight.shape[0]
        dev = self.weight.device
        self.weight[slot, :n] = out.weight.to(dev, self.weight.dtype)
        self.bias[slot] = 0
        if out.bias is not None:
            self.bias[slot, :n] = out.bias.to(dev)
        if hidden:
            self.hidden_weight[slot] = hidden[0].weight.to(dev, self.hidden_weight.dtype)
            self.hidden_bias[slot] = 0 if hidden[0].bias is None else hidden[0].bias.to(dev)
        self.num_labels[slot] = n
        self.heads[slot] = head
        return True

    def clear(self, slot: int) -> None:
        self.num_labels[slot] = 0
        self.heads.pop(slot, None)

    def logits(self, pooled: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """pooled: [M, D] -> float32 [M, max_labels], -inf past each head's labels."""
        index = torch.tensor(slots, device=pooled.device)
        x = pooled.float()
        for activation, rows in self._hidden_groups(slots).items():
            sel = torch.tensor(rows, device=pooled.device)
            h = torch.bmm(self.hidden_weight[index[sel]].float(), x[sel].unsqueeze(-1)).squeeze(-1)
            h = h + self.hidden_bias[index[sel]]
            x[sel] = ACTIVATIONS[activation](h) if activation else h
        logits = torch.bmm(self.weight[index].float(), x.unsqueeze(-1)).squeeze(-1) + self.bias[index]
        labels = torch.arange(self.max_labels, device=pooled.device)
        return logits.masked_fill(labels >= self.num_labels[index].unsqueeze(1), float("-inf"))

    def _hidden_groups(self, slots: list[int]) -> dict[str | None, list[int]]:
        """Rows whose head has a hidden layer, grouped by that layer's activation."""
        groups: dict[str | None, list[int]] = {}
        for row, slot in enumerate(slots):
            layers = self.heads[slot].layers
            if len(layers) == 2:
                groups.setdefault(layers[0].activation, []).append(row)
        return groups
