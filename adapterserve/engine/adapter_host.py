"""The adapter registry every engine shares: load, check, register, unload, and
place into slots. Subclasses say which pools they have and what the backbone is."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

from adapterserve.adapters_store.cache import host_copy_bytes, tensor_nbytes
from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.adapters_store.formats.read import AdapterLimits, read_adapter
from adapterserve.adapters_store.formats.types import BackboneSpec, LoraAdapter
from adapterserve.adapters_store.servable import ServingRules, check_servable
from adapterserve.config import EngineConfig
from adapterserve.engine.slots import AdapterSlots
from adapterserve.engine.staging import stage, trim_staged
from adapterserve.errors import (
    AdapterError,
    AdapterInUse,
    AdapterNotFound,
    CapacityError,
)

# Families whose tokens the kernels group per step (others act once per request).
TOKEN_FAMILIES = ("lora", "ia3", "bottleneck")
_UNLOAD_POLL_S = 0.01


def family_slots(slots: list[int], families_of: Callable[[int], frozenset[str]]) -> np.ndarray:
    """[len(TOKEN_FAMILIES), len(slots)]: each entry's slot in each family, -1 where its
    adapter has none (or it has no adapter)."""
    held = {slot for slot in slots if slot >= 0}
    if not held:
        return np.full((len(TOKEN_FAMILIES), len(slots)), -1, dtype=np.int32)
    # per family, each slot's entry, and a last one (-1) that entries without an adapter index
    by_slot = [[-1] * (max(held) + 2) for _ in TOKEN_FAMILIES]
    for slot in held:
        families = families_of(slot)
        for row, family in zip(by_slot, TOKEN_FAMILIES):
            if family in families:
                row[slot] = slot
    entries = np.array(slots, dtype=np.intp)
    entries[entries < 0] = -1
    return np.array(by_slot, dtype=np.int32)[:, entries]


class AdapterHost:
    config: EngineConfig
    slots: AdapterSlots
    serves_virtual_tokens = True  # prompt and prefix tuning (decoders)

    def __init__(self) -> None:
        self.adapters: dict[str, Adapter] = {}  # host copies of loaded adapters
        self._staged: OrderedDict[str, Adapter] = OrderedDict()  # adapters holding loading copies
        self._lock = threading.RLock()

    @property
    def backbone_spec(self) -> BackboneSpec:
        raise NotImplementedError

    @property
    def adapter_limits(self) -> AdapterLimits:
        cfg = self.config
        return AdapterLimits(cfg.max_lora_rank, cfg.max_virtual_tokens, cfg.max_bottleneck_rank)

    @property
    def serving_rules(self) -> ServingRules:
        """What this engine's pools can hold: checked here on load, and by the store on upload."""
        fields: dict = {"virtual_tokens": self.serves_virtual_tokens}
        for pool in self.slots.pools:
            fields.update(pool.rules())
        return ServingRules(**fields)

    def check_servable(self, adapter: Adapter, adapter_id: str) -> None:
        """Refuse what this engine's pools cannot hold (AdapterError)."""
        check_servable(adapter, adapter_id, self.serving_rules)

    def load_adapter(self, adapter_id: str, path: str | Path, pinned: bool = False) -> None:
        """Read and check an adapter directory (PEFT: LoRA, (IA)^3, prompt tuning,
        P-tuning, prefix tuning, heads; AdapterHub: Houlsby, Pfeiffer); the engine
        is unchanged if it is refused. ``pinned``: as for add_adapter."""
        if not isinstance(adapter_id, str) or not adapter_id:
            raise AdapterError("adapter id must be a non-empty string")
        with self._lock:
            self._refuse_loaded(adapter_id)
        adapter = read_adapter(path, self.backbone_spec, self.adapter_limits, name=adapter_id,
                               dtype=self.config.torch_dtype)
        self.add_adapter(adapter_id, adapter, pinned)

    def add_adapter(self, adapter_id: str, adapter: Adapter | LoraAdapter, pinned: bool = False) -> None:
        """Register an adapter already read and checked (e.g. from the host cache).
        ``pinned``: place it in a slot now and keep it there, never evicted, until it
        is unloaded; CapacityError (and nothing registered) if that would pin every
        slot or no slot can be freed now."""
        if isinstance(adapter, LoraAdapter):
            adapter = Adapter("lora", lora=adapter, config=adapter.config)
        self.check_servable(adapter, adapter_id)
        with self._lock:
            self._refuse_loaded(adapter_id)
        self._stage(adapter_id, adapter)
        with self._lock:
            try:
                self._refuse_loaded(adapter_id)
                if pinned:
                    self.slots.pin(adapter_id, adapter)
            except (AdapterError, CapacityError):
                self._unstage(adapter_id, adapter)
                raise
            self.adapters[adapter_id] = adapter

    def _refuse_loaded(self, adapter_id: str) -> None:
        if adapter_id in self.adapters:
            raise AdapterError(f"an adapter with id {adapter_id!r} is already loaded; unload it first")

    def _stage(self, adapter_id: str, adapter: Adapter) -> None:
        """Prepare the adapter's loading copies (pinned on a GPU) for the most recently
        added adapters; older ones drop theirs and restage when next placed."""
        stage(self.slots.pools, adapter)
        with self._lock:
            self._staged[adapter_id] = adapter
            self._trim_staged()

    def _trim_staged(self) -> None:
        """Drop loading copies past max_staged_adapters or max_staged_bytes: those of adapters
        in a slot first, so that placing many adapters in one pass, each restaged as the newest,
        does not drop the copies of the ones still to place (the newest is kept even alone over
        the bytes: it is being placed)."""
        trim_staged(self._staged, self.config.max_staged_adapters, self.config.max_staged_bytes,
                    self.slots.is_resident)

    def _count_restaged(self, adapter_id: str, adapter: Adapter) -> None:
        """Placing an adapter whose loading copies were dropped makes them again (the pools'
        `place`): count them, as the newest, towards max_staged_adapters / max_staged_bytes."""
        if adapter.staged and self._staged.get(adapter_id) is not adapter and self.adapters.get(adapter_id) is adapter:
            self._staged[adapter_id] = adapter
            self._trim_staged()

    @property
    def registered_bytes(self) -> int:
        """Host bytes of the registered adapters' copies (without their loading copies)."""
        with self._lock:
            return sum(host_copy_bytes(a) for a in self.adapters.values())

    @property
    def staged_bytes(self) -> int:
        """Host bytes of the adapters' ready-to-copy loading copies."""
        with self._lock:
            return sum(tensor_nbytes(a.staged) for a in self._staged.values())

    def unload_adapter(self, adapter_id: str, *, wait_s: float = 0.0, fail_queued: bool = False) -> None:
        """Forget (and unpin) an adapter. New requests for it are refused; requests running
        with it finish, and its slot is freed when they do. Requests still queued for it
        (not started): waits up to `wait_s` for them to start (another thread steps the
        engine), then raises AdapterInUse and unloads nothing if some still wait;
        ``fail_queued=True`` ends them instead (each with AdapterNotFound)."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                if adapter_id not in self.adapters:
                    raise AdapterNotFound(f"no adapter {adapter_id!r} is loaded")
                queued = 0 if fail_queued else self._queued_for(adapter_id)
                if not queued:
                    adapter = self.adapters.pop(adapter_id)
                    self._unstage(adapter_id, adapter)
                    self.slots.evict(adapter_id)
                    return
            if time.monotonic() >= deadline:
                raise AdapterInUse(
                    f"adapter {adapter_id!r} has {queued} queued requests that have not started; unload it "
                    "once they finish, wait for them to start (wait_s=...), or end them (fail_queued=True)"
                )
            time.sleep(_UNLOAD_POLL_S)

    def _queued_for(self, adapter_id: str) -> int:
        """Requests queued for `adapter_id` that hold no slot yet (none in an engine without a queue)."""
        return 0

    def _unstage(self, adapter_id: str, adapter: Adapter) -> None:
        """Drop the adapter's loading copies (only its own, not those of another adapter
        staged under the same id)."""
        if self._staged.get(adapter_id) is adapter:
            del self._staged[adapter_id]
        adapter.staged.clear()

    def list_adapters(self) -> list[str]:
        return sorted(self.adapters)

    def close(self) -> None:
        """Release what the engine holds outside this process (tensor-parallel workers); nothing here."""

    def _acquire_slot(self, adapter_id: str, keep: Collection[str] = ()) -> int | None:
        """The adapter's slot (placed if needed); ``keep``: adapter ids not to evict for it.
        AdapterNotFound if it was unloaded while its request waited."""
        adapter = self.adapters.get(adapter_id)
        if adapter is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} was unloaded while the request waited")
        slot = self.slots.acquire(adapter_id, adapter, keep)
        self._count_restaged(adapter_id, adapter)
        return slot

    def _families_of(self, slot: int) -> frozenset[str]:
        adapter = self.slots.adapter_in[slot]
        return frozenset(f for f in TOKEN_FAMILIES if getattr(adapter, f) is not None)
