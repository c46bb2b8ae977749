"""GPU adapter slots: which adapter sits in which slot, and its rows in the pools.

Every adapter-aware linear owns a LoraSlices pool allocated once. Placing an
adapter copies its weights into free rows (one row range per projection kind,
shared by all layers) and writes the slot's row_start/rank entries; addresses
never change. Slots in use by running requests are pinned; others are evicted
least recently used first, only when a new adapter needs the room.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from adapterserve.adapters_store.formats.types import DECODER_LINEARS, LoraAdapter
from adapterserve.engine.layers import AdapterLinear
from adapterserve.engine.row_allocator import RowAllocator
from adapterserve.kernels import LoraSlices


_RETIRED = "\0retired:"  # prefix of slots whose adapter was unloaded while in use


class LoraSlots:
    def __init__(
        self,
        linears: list[tuple[int, AdapterLinear]],
        num_slots: int,
        pool_rows: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.linears = linears
        self.num_slots = num_slots
        for _, linear in linears:
            linear.lora = LoraSlices.allocate(
                linear.in_features, linear.slice_widths, pool_rows, num_slots, max_rank, dtype, device
            )
        self.allocators = {kind: RowAllocator(pool_rows) for kind in DECODER_LINEARS}
        self.slot_of: dict[str, int] = {}
        self.refs = [0] * num_slots
        self._rows: dict[int, dict[str, tuple[int, int]]] = {}  # slot -> kind -> (start, rows)
        self._idle: OrderedDict[int, str] = OrderedDict()  # resident, unreferenced; LRU first
        self._free_slots = list(range(num_slots))

    def acquire(self, adapter_id: str, adapter: LoraAdapter) -> int | None:
        """Slot holding the adapter (placing it if needed), pinned; None if no room now."""
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            slot = self._place(adapter_id, adapter)
            if slot is None:
                return None
        self._idle.pop(slot, None)
        self.refs[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            if self._adapter_in(slot).startswith(_RETIRED):
                self._clear(slot)
            else:
                self._idle[slot] = self._adapter_in(slot)

    def evict(self, adapter_id: str) -> None:
        """Free the adapter's slot now, or, while requests still use it, as soon as
        they finish; either way the id no longer maps to it (a new adapter loaded
        under the same id gets a fresh placement)."""
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            return
        if self.refs[slot] == 0:
            self._clear(slot)
        else:
            del self.slot_of[adapter_id]
            self.slot_of[f"{_RETIRED}{adapter_id}#{slot}"] = slot

    def is_resident(self, adapter_id: str) -> bool:
        return adapter_id in self.slot_of

    def _adapter_in(self, slot: int) -> str:
        return next(a for a, s in self.slot_of.items() if s == slot)

    def _place(self, adapter_id: str, adapter: LoraAdapter) -> int | None:
        need = {kind: adapter.kind_rank(kind) for kind in DECODER_LINEARS}
        while True:
            rows = self._try_alloc(need)
            if rows is not None and self._free_slots:
                slot = self._free_slots.pop(0)
                self._write(slot, adapter, rows)
                self.slot_of[adapter_id] = slot
                return slot
            if rows is not None:
                self._free_rows(rows)
            if not self._idle:
                return None
            lru_slot = next(iter(self._idle))
            self._clear(lru_slot)

    def _try_alloc(self, need: dict[str, int]) -> dict[str, tuple[int, int]] | None:
        got: dict[str, tuple[int, int]] = {}
        for kind, rows in need.items():
            start = self.allocators[kind].alloc(rows)
            if start is None:
                self._free_rows(got)
                return None
            got[kind] = (start, rows)
        return got

    def _free_rows(self, rows: dict[str, tuple[int, int]]) -> None:
        for kind, (start, n) in rows.items():
            self.allocators[kind].free(start, n)

    def _clear(self, slot: int) -> None:
        self._idle.pop(slot, None)
        del self.slot_of[self._adapter_in(slot)]
        self._free_rows(self._rows.pop(slot))
        for _, linear in self.linears:
            linear.lora.rank[:, slot] = 0
        self._free_slots.append(slot)

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoraAdapter, rows: dict[str, tuple[int, int]]) -> None:
        self._rows[slot] = rows
        for layer, linear in self.linears:
            _write_linear(linear, layer, slot, adapter, rows)


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
            lora.a[s, start : start + rank] = module.a.to(lora.a.dtype)
            lora.b[start : start + rank, cols] = (module.b * module.scaling).T.to(lora.b.dtype)
        starts.append(start)
        ranks.append(rank)
    lora.row_start[:, slot] = torch.tensor(starts, dtype=torch.int32)
    lora.rank[:, slot] = torch.tensor(ranks, dtype=torch.int32)
