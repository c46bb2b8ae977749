"""Prompt-tuning and P-tuning pool: each slot's virtual-token embeddings."""
from __future__ import annotations

from typing import Any

import torch

from adapterserve.adapters_store.formats.families import Adapter


class PromptPool:
    family = "prompt"

    def __init__(self, num_slots: int, max_virtual: int, hidden: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.embeddings = torch.zeros(num_slots, max_virtual, hidden, dtype=dtype, device=device)

    def place(self, slot: int, adapter: Adapter) -> bool:
        if adapter.prompt is not None:
            rows = adapter.prompt.embeddings
            self.embeddings[slot, : rows.shape[0]] = rows.to(self.embeddings.device, self.embeddings.dtype)
        return True

    def rules(self) -> dict[str, Any]:
        return {}

    def clear(self, slot: int) -> None:
        pass
