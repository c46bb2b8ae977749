"""What an engine tells its replica for metrics: its load now and its counts so far.

The counts only grow while one engine lives; `engine_id` is new for every engine (a
restart, a replaced process), so the replica knows when they start again from zero.
"""
from __future__ import annotations

from dataclasses import dataclass

from adapterserve.engine.stats import StatsSnapshot


@dataclass(frozen=True)
class EngineReport:
    engine_id: str
    running: int  # requests (an encoder: calls) running
    waiting: int  # requests waiting to be scheduled
    kv_blocks: int  # KV-cache blocks, and those holding tokens (0 for an encoder)
    kv_blocks_used: int
    block_size: int
    slots: int  # adapter slots on the device, those holding an adapter, those pinned
    slots_used: int
    slots_pinned: int
    slot_loads: int  # adapters placed into slots so far
    slot_evictions: int  # idle adapters cleared to make room so far
    preemptions: int  # running requests sent back to wait so far (KV cache full)
    resident_adapters: tuple[str, ...]  # engine adapter ids in slots
    waiting_adapters: tuple[str, ...]  # engine adapter ids of waiting requests not in a slot yet
    stats: StatsSnapshot | None  # steps, batches and queue times (None for an encoder: no step loop)


def decoder_report(engine_id: str, engine) -> EngineReport:
    """The report of a decoder Engine. Reads its tables while its step may run in another thread:
    each is copied in one go first (a copy in C holds the interpreter lock throughout)."""
    waiting, running = list(engine.scheduler.waiting), len(engine.scheduler.running)
    slots, blocks = engine.slots, engine.blocks
    resident = slots.resident_ids()
    waiting_adapters = sorted({r.adapter_id for r in waiting if r.adapter_id is not None} - set(resident))
    return EngineReport(
        engine_id, running, len(waiting), blocks.num_blocks, blocks.num_blocks - blocks.num_free,
        blocks.block_size, slots.num_slots, slots.num_used, slots.num_pinned, slots.loads, slots.evictions,
        engine.scheduler.preemptions, tuple(sorted(resident)), tuple(waiting_adapters), engine.stats.snapshot(),
    )


def encoder_report(engine_id: str, engine, running_calls: int) -> EngineReport:
    """The report of an EncoderEngine: slots and the calls it runs now (it has no queue)."""
    slots = engine.slots
    return EngineReport(
        engine_id, running_calls, 0, 0, 0, 0, slots.num_slots, slots.num_used, slots.num_pinned, slots.loads,
        slots.evictions, 0, tuple(sorted(slots.resident_ids())), (), None,
    )
