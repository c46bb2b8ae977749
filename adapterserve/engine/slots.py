"""Adapter slots: which adapter sits in which slot, whatever its family.

A slot is one index into every family pool (LoRA rows, (IA)^3 scales, prompt
embeddings, prefix KV blocks). Placing an adapter writes its weights into each
pool, all or nothing; addresses never change. Slots in use by running requests
hold references; a pinned adapter holds one of its own until it is evicted
(unloaded). An idle slot is given up only when a new adapter needs the room (load
before evict), never while it holds an adapter the caller keeps (waiting requests
need it next), and the coldest goes first. Heat is a decayed count of acquires,
time counted in acquires (one per admitted request):

    heat = sum over the adapter's acquires i of 2 ** (-(now - t_i) / half_life)

Frequent use and recent use both keep an adapter resident; half_life -> 0 is LRU
(ties go to the longest idle), half_life -> inf least frequently used.

On a GPU, placing copies on a stream of its own (after the work already queued on
the compute stream, so nothing still reading a freed slot or block is overwritten).
``acquire`` refuses a slot until those copies have landed, counting nothing, so the
scheduler admits an adapter's requests only then (decode steps never queue behind a
load) and steps spent waiting do not make the adapter hot.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.engine.host_copy import on_copy_stream
from adapterserve.errors import CapacityError

_RETIRED = "\0retired:"  # prefix of slots whose adapter was unloaded while in use
HALF_LIFE_PER_SLOT = 8  # default half-life: 8 acquires per slot


class Pool(Protocol):
    family: str

    def place(self, slot: int, adapter: Adapter) -> bool: ...

    def clear(self, slot: int) -> None: ...

    def rules(self) -> dict[str, Any]:
        """This pool's fields of the engine's ServingRules (adapters_store/servable.py)."""
        ...


class SlotMirror(Protocol):
    """The other tensor-parallel ranks' pools: told of every placement and clear, in order."""

    def place(self, slot: int, adapter: Adapter) -> None: ...

    def clear(self, slot: int) -> None: ...


class AdapterSlots:
    def __init__(self, num_slots: int, pools: list[Pool], half_life: float | None = None,
                 copy_stream: torch.cuda.Stream | None = None, mirror: SlotMirror | None = None) -> None:
        self.num_slots = num_slots
        self.pools = pools
        self.mirror = mirror  # placements and clears repeated on the other ranks (None: one rank)
        self.copy_stream = copy_stream  # placements copy on it (None: on the current stream, at once)
        self._landing: dict[int, torch.cuda.Event] = {}  # slot -> event of its placement's copies
        self.half_life = HALF_LIFE_PER_SLOT * num_slots if half_life is None else half_life  # in acquires
        self.slot_of: dict[str, int] = {}
        self.refs = [0] * num_slots
        self.adapter_in: dict[int, Adapter] = {}
        self.pinned: set[str] = set()
        self._idle: OrderedDict[int, str] = OrderedDict()  # resident, unreferenced; longest idle first
        self._free_slots = list(range(num_slots))
        self._heat: dict[str, tuple[float, int]] = {}  # adapter id -> (heat at its last acquire, that time)
        self._clock = 0  # acquires so far
        self.loads = 0  # placements so far (a metric)
        self.evictions = 0  # idle adapters cleared to make room for another, so far (a metric)

    @property
    def num_pinned(self) -> int:
        return len(self.pinned)

    @property
    def num_used(self) -> int:
        """Slots holding an adapter (idle, in use or pinned)."""
        return self.num_slots - len(self._free_slots)

    def resident_ids(self) -> list[str]:
        """Ids of the adapters in slots (not those unloaded while still in use)."""
        return [adapter_id for adapter_id in list(self.slot_of) if not adapter_id.startswith(_RETIRED)]

    def acquire(self, adapter_id: str, adapter: Adapter, keep: Collection[str] = ()) -> int | None:
        """Slot holding the adapter, referenced for one admitted request; None if there is
        no room now, or if its copies into the slot are still landing (placed then, but
        neither referenced nor counted: ask again). ``keep``: adapter ids not to evict for
        the room (waiting requests need them)."""
        slot = self._resident(adapter_id, adapter, keep)
        if slot is None or not self.is_ready(slot):
            return None
        self._hold(slot)
        self._clock += 1
        self._heat[adapter_id] = (self.heat(adapter_id) + 1.0, self._clock)
        return slot

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            if self._id_in(slot).startswith(_RETIRED):
                self._clear(slot)
            else:
                self._idle[slot] = self._id_in(slot)

    def pin(self, adapter_id: str, adapter: Adapter) -> int:
        """Place the adapter now and keep it resident until it is evicted. CapacityError
        if that would pin every slot, or if no slot can be freed now."""
        if adapter_id in self.pinned:
            return self.slot_of[adapter_id]
        if self.num_pinned + 1 >= self.num_slots:
            raise CapacityError(
                f"cannot pin adapter {adapter_id!r}: {self.num_pinned} of {self.num_slots} adapter slots are "
                "pinned and at least one must stay free for unpinned adapters; raise max_loras or unload a "
                "pinned adapter"
            )
        slot = self._resident(adapter_id, adapter, ())
        if slot is None:
            raise CapacityError(
                f"cannot pin adapter {adapter_id!r} now: every adapter slot (or the LoRA pool rows it needs) is "
                "held by running requests or pinned adapters; retry when requests finish, or raise max_loras "
                "or lora_pool_rows"
            )
        self._hold(slot)
        self.pinned.add(adapter_id)
        return slot

    def evict(self, adapter_id: str) -> None:
        """Unpin the adapter and free its slot now, or, while requests still use it, as soon
        as they finish; either way the id no longer maps to it (a new adapter loaded
        under the same id gets a fresh placement and starts cold)."""
        self._heat.pop(adapter_id, None)
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            return
        if adapter_id in self.pinned:
            self.pinned.discard(adapter_id)
            self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self._clear(slot)
        else:
            del self.slot_of[adapter_id]
            self.slot_of[f"{_RETIRED}{adapter_id}#{slot}"] = slot

    def is_resident(self, adapter_id: str) -> bool:
        return adapter_id in self.slot_of

    def heat(self, adapter_id: str) -> float:
        """The adapter's decayed acquire count now (0 if never acquired)."""
        value, at = self._heat.get(adapter_id, (0.0, self._clock))
        if at == self._clock:
            return value
        return value * 0.5 ** ((self._clock - at) / self.half_life) if self.half_life > 0 else 0.0

    def is_ready(self, slot: int) -> bool:
        """Whether the slot's placement copies have landed (always, without a copy stream)."""
        event = self._landing.get(slot)
        if event is not None and not event.query():
            return False
        self._landing.pop(slot, None)
        return True

    def _id_in(self, slot: int) -> str:
        return next(a for a, s in self.slot_of.items() if s == slot)

    def _resident(self, adapter_id: str, adapter: Adapter, keep: Collection[str]) -> int | None:
        """The adapter's slot, placed there (idle) if it has none; None if no room now."""
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            slot = self._place(adapter_id, adapter, keep)
            if slot is not None:
                self._idle[slot] = adapter_id
        return slot

    def _hold(self, slot: int) -> None:
        self._idle.pop(slot, None)
        self.refs[slot] += 1

    def _place(self, adapter_id: str, adapter: Adapter, keep: Collection[str]) -> int | None:
        while True:
            if self._free_slots:
                slot = self._free_slots.pop(0)
                if self._place_in(slot, adapter):
                    self.slot_of[adapter_id] = slot
                    self.adapter_in[slot] = adapter
                    self.loads += 1
                    return slot
                self._free_slots.insert(0, slot)
            victim = self._victim(keep)
            if victim is None:
                return None
            self._clear(victim)
            self.evictions += 1

    def _victim(self, keep: Collection[str]) -> int | None:
        """The idle slot of least heat, not kept; ties go to the longest idle."""
        candidates = [slot for slot, adapter_id in self._idle.items() if adapter_id not in keep]
        return min(candidates, key=lambda slot: self.heat(self._idle[slot]), default=None)

    def _place_in(self, slot: int, adapter: Adapter) -> bool:
        placed: list[Pool] = []
        with self._copying(slot):
            for pool in self.pools:
                if not pool.place(slot, adapter):
                    for done in placed:
                        done.clear(slot)
                    return False
                placed.append(pool)
        if self.mirror is not None:
            self.mirror.place(slot, adapter)
        return True

    @contextmanager
    def _copying(self, slot: int) -> Iterator[None]:
        """Pool writes inside run on the copy stream; the slot's requests wait for their event."""
        landed: list[torch.cuda.Event] = []
        with on_copy_stream(self.copy_stream, landed):
            yield
        if landed:
            self._landing[slot] = landed[0]

    def _clear(self, slot: int) -> None:
        self._idle.pop(slot, None)
        del self.slot_of[self._id_in(slot)]
        del self.adapter_in[slot]
        for pool in self.pools:
            pool.clear(slot)
        if self.mirror is not None:
            self.mirror.clear(slot)
        self._free_slots.append(slot)
