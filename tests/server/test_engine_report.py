"""What an engine reports for metrics, on the tiny Llama without Ray: every request leaves the
queue once, steps and batches are counted, KV blocks and adapter slots are as the engine
holds them, an adapter that needs a slot held by an idle one evicts it; and the report
crosses the engine process's pipe."""
from __future__ import annotations

import asyncio

import pytest

from adapterserve import Engine, SamplingParams
from adapterserve.server.engine_process import EngineProcess, LocalEngine

ENGINE = {"max_lora_rank": 16, "max_loras": 2, "num_kv_blocks": 32}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_model, lora_dirs):
    engine = Engine.from_pretrained(tiny_model, **ENGINE)
    for name, path in lora_dirs.items():
        engine.load_adapter(name, path)
    return engine


def test_a_batch_of_requests_is_counted_once_each(engine):
    before = asyncio.run(LocalEngine(engine).stats())
    engine.generate(["one", "two", "three"], GREEDY, adapter_ids=["sql", None, "sql"])
    report = asyncio.run(LocalEngine(engine).stats())
    queued = report.stats.queue_seconds.minus(before.stats.queue_seconds)
    steps = report.stats.step_seconds.minus(before.stats.step_seconds)
    rows = report.stats.batch_requests.minus(before.stats.batch_requests)
    assert queued.count == 3
    assert steps.count == rows.count >= 6  # a prefill step, then a decode step per token
    assert rows.sum >= 3 * GREEDY.max_tokens  # every request is in a step for each of its tokens
    assert (report.running, report.waiting, report.kv_blocks, report.kv_blocks_used) == (0, 0, 32, 0)
    assert report.slots == 2 and "sql" in report.resident_adapters
    assert report.block_size == engine.blocks.block_size


def test_an_adapter_that_needs_a_slot_evicts_an_idle_one(engine):
    before = asyncio.run(LocalEngine(engine).stats())
    for adapter in ("sql", "chat", "poem"):  # two slots, three adapters: one must make room
        engine.generate(["x"], GREEDY, adapter_ids=[adapter])
    report = asyncio.run(LocalEngine(engine).stats())
    assert report.slot_evictions - before.slot_evictions >= 1
    assert report.slot_loads - before.slot_loads >= 2
    assert report.slots_used == 2 and len(report.resident_adapters) == 2


def test_the_report_crosses_the_engine_process_pipe(tiny_model):
    proc = EngineProcess(tiny_model, ENGINE)
    try:
        async def run():
            async for _ in proc.stream("hello", GREEDY):
                pass
            return await proc.stats(), await proc.stats()

        first, again = asyncio.run(run())
    finally:
        proc.close()
    assert first.engine_id == again.engine_id
    assert first.stats.queue_seconds.count == 1 and first.kv_blocks == 32
