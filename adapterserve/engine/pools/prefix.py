"""Prefix-tuning pool: an adapter's per-layer keys and values written once into
KV-cache blocks that every request of that adapter attends first. The blocks are
held while the adapter sits in its slot and freed when the slot is cleared.
Under tensor parallelism each rank writes its KV heads' part of the prefix (of a whole
adapter, or all of an AdapterShard cut for it)."""
from __future__ import annotations

from typing import Any

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.engine.adapter_shard import kv_part
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.layers.attention import PagedAttention


class PrefixPool:
    family = "prefix"

    def __init__(self, blocks: BlockManager, attention: list[PagedAttention]) -> None:
        self.blocks = blocks
        self.attention = attention
        self.pages: dict[int, list[int]] = {}  # slot -> KV blocks holding its prefix

    def place(self, slot: int, adapter: Adapter) -> bool:
        prefix = adapter.prefix
        if prefix is None:
            return True
        table: list[int] = []
        if not self.blocks.can_allocate(table, prefix.num_virtual):
            return False
        self.blocks.grow(table, prefix.num_virtual)
        # right-aligned in its blocks, so the request's own tokens start a fresh block
        skip = len(table) * self.blocks.block_size - prefix.num_virtual
        slots = [self.blocks.slot(table, skip + p) for p in range(prefix.num_virtual)]
        index = torch.tensor(slots, device=self.attention[0].k_cache.device)
        with torch.no_grad():
            for layer, attn in enumerate(self.attention):
                keys, values = (kv_part(attn, adapter, t[layer]) for t in (prefix.keys, prefix.values))
                attn.write(index, keys.to(index.device), values.to(index.device))
        self.pages[slot] = table
        return True

    def rules(self) -> dict[str, Any]:
        return {}

    def clear(self, slot: int) -> None:
        table = self.pages.pop(slot, None)
        if table is not None:
            self.blocks.release(table)
