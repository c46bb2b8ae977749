"""Adapter slots: which adapter sits in which slot, whatever its family.

A slot is one index into every family pool (LoRA rows, (IA)^3 scales, prompt
embeddings, prefix KV blocks). Placing an adapter writes its weights into each
pool, all or nothing; addresses never change. Slots in use by running requests
are pinned; idle ones are evicted least recently used first, and only when a new
adapter needs the room (load before evict).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from adapterserve.adapters_store.formats.families import Adapter

_RETIRED = "\0retired:"  # prefix of slots whose adapter was unloaded while in use


class Pool(Protocol):
    family: str

    def place(self, slot: int, adapter: Adapter) -> bool: ...

    def clear(self, slot: int) -> None: ...


class AdapterSlots:
    def __init__(self, num_slots: int, pools: list[Pool]) -> None:
        self.num_slots = num_slots
        self.pools = pools
        self.slot_of: dict[str, int] = {}
        self.refs = [0] * num_slots
        self.adapter_in: dict[int, Adapter] = {}
        self._idle: OrderedDict[int, str] = OrderedDict()  # resident, unreferenced; LRU first
        self._free_slots = list(range(num_slots))
        self.loads = 0  # placements so far (a metric)

    def acquire(self, adapter_id: str, adapter: Adapter) -> int | None:
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
            if self._id_in(slot).startswith(_RETIRED):
                self._clear(slot)
            else:
                self._idle[slot] = self._id_in(slot)

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

    def _id_in(self, slot: int) -> str:
        return next(a for a, s in self.slot_of.items() if s == slot)

    def _place(self, adapter_id: str, adapter: Adapter) -> int | None:
        while True:
            if self._free_slots:
                slot = self._free_slots.pop(0)
                if self._place_in(slot, adapter):
                    self.slot_of[adapter_id] = slot
                    self.adapter_in[slot] = adapter
                    self.loads += 1
                    return slot
                self._free_slots.insert(0, slot)
            if not self._idle:
                return None
            self._clear(next(iter(self._idle)))

    def _place_in(self, slot: int, adapter: Adapter) -> bool:
        placed: list[Pool] = []
        for pool in self.pools:
            if not pool.place(slot, adapter):
                for done in placed:
                    done.clear(slot)
                return False
            placed.append(pool)
        return True

    def _clear(self, slot: int) -> None:
        self._idle.pop(slot, None)
        del self.slot_of[self._id_in(slot)]
        del self.adapter_in[slot]
        for pool in self.pools:
            pool.clear(slot)
        self._free_slots.append(slot)
