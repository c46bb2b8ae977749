"""LoRA pools: every adapter-aware linear's LoraSlices, and the row allocators.

An adapter takes one row range per projection kind (shared by all layers), as
long as its largest rank for that kind; kinds it does not target take nothing.
"""
from __future__ import annotations

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.adapters_store.formats.types import LoraAdapter
from adapterserve.engine.layers import AdapterLinear
from adapterserve.engine.row_allocator import RowAllocator
from adapterserve.kernels import LoraSlices


class LoraPool:
    family = "lora"

    def __init__(self, linears: list[tuple[int, AdapterLinear]], num_slots: int, pool_rows: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.linears = linears
        kinds = sorted({kind for _, linear in linears for kind in linear.slice_kinds})
        for _, linear in linears:
            linear.lora = LoraSlices.allocate(
                linear.in_features, linear.slice_widths, pool_rows, num_slots, max_rank, dtype, device
            )
        self.allocators = {kind: RowAllocator(pool_rows) for kind in kinds}
        self._rows: dict[int, dict[str, tuple[int, int]]] = {}  # slot -> kind -> (start, rows)

    def place(self, slot: int, adapter: Adapter) -> bool:
        if adapter.lora is None:
            return True
        need = {kind: adapter.lora.kind_rank(kind) for kind in self.allocators}
        rows = self._alloc(need)
        if rows is None:
            return False
        self._rows[slot] = rows
        with torch.no_grad():
            for layer, linear in self.linears:
                _write_linear(linear, layer, slot, adapter.lora, rows)
        return True

    def clear(self, slot: int) -> None:
        rows = self._rows.pop(slot, None)
        if rows is None:
            return
        self._free(rows)
        for _, linear in self.linears:
            linear.lora.rank[:, slot] = 0

    def _alloc(self, need: dict[str, int]) -> dict[str, tuple[int, int]] | None:
        got: dict[str, tuple[int, int]] = {}
        for kind, rows in need.items():
            start = self.allocators[kind].alloc(rows)
            if start is None:
                self._free(got)
                return None
            got[kind] = (start, rows)
        return got

    def _free(self, rows: dict[str, tuple[int, int]]) -> None:
        for kind, (start, n) in rows.items():
            self.allocators[kind].free(start, n)


def _write_linear(
    linear: AdapterLinear, layer: int, slot: int, adapter: LoraAdapter, rows: dict[str, tuple[int, int]]
) -> None:
    lora = linear.lora
    starts, ranks = [], []
    for s, kind in enumerate(linear.slice_kinds):
        module = adapter.modules.get((layer, kind))
        start = rows[kind][0]
        rank = module.rank if module is not None else 0
        if module is not None:
            cols = slice(lora.out_offsets[s], lora.out_offsets[s + 1])
            lora.a[s, start : start + rank] = module.a.to(lora.a.device, lora.a.dtype)
            lora.b[start : start + rank, cols] = (module.b * module.scaling).T.to(lora.b.device, lora.b.dtype)
        starts.append(start)
        ranks.append(rank)
    lora.row_start[:, slot] = torch.tensor(starts, dtype=torch.int32, device=lora.row_start.device)
    lora.rank[:, slot] = torch.tensor(ranks, dtype=torch.int32, device=lora.rank.device)
