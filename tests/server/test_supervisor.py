"""EngineSupervisor without Ray: an engine process that is killed or wedged fails its
requests with EngineDied at once and is restarted in place with its adapters; an engine
in the replica's own process that breaks or stalls fails the replica's health instead;
restarts that fail, run too long or come too often fail it too."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
from functools import partial

import pytest

from adapterserve import Engine, SamplingParams
from adapterserve.adapters_store.formats.read import read_adapter
from adapterserve.errors import EngineBroken, EngineDied
from adapterserve.server.engine_process import EngineSupervisor, LocalEngine, start_engine, supervisor

ENGINE = {"max_lora_rank": 16, "max_loras": 4, "num_kv_blocks": 32}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
PROMPT = "The lighthouse keeper"
WAIT_S = 120  # bounds on awaits that must not hang (never reached when the code is right)


def _supervised(tiny_model, **kwargs) -> EngineSupervisor:
    options = {"restartable": True, "stall_timeout_s": 30.0, "start_timeout_s": 120.0, **kwargs}
    return EngineSupervisor(partial(start_engine, tiny_model, ENGINE, True), **options)


async def _tokens(engine, adapter_id: str | None = None) -> list[int]:
    chunks = [c async for c in engine.stream(PROMPT, GREEDY, adapter_id)]
    return [t for c in chunks for t in c.token_ids]


async def _started_stream(engine):
    stream = engine.stream("A long story", LONG)
    await asyncio.wait_for(anext(stream), WAIT_S)
    return stream


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_a_killed_engine_fails_its_streams_at_once_and_restarts_with_its_adapters(tiny_model, lora_dirs):
    async def scenario():
        sup = _supervised(tiny_model)
        try:
            adapter = read_adapter(lora_dirs["chat"], sup.facts.backbone_spec, sup.facts.adapter_limits)
            await sup.add_adapter("chat", adapter)
            before = await _tokens(sup, "chat"), await _tokens(sup)
            stream, old_pid = await _started_stream(sup), sup.pid
            os.kill(old_pid, signal.SIGKILL)
            with pytest.raises(EngineDied, match="exit code -9"):
                await asyncio.wait_for(_drain(stream), WAIT_S)
            after = await asyncio.wait_for(_tokens(sup, "chat"), WAIT_S), await _tokens(sup)  # waits for the restart
            return before, after, old_pid, sup.pid, sup.restarts, await sup.check(), sup.failed
        finally:
            sup.close()

    before, after, old_pid, new_pid, restarts, problem, failed = asyncio.run(scenario())
    assert after == before and before[0] != before[1], "the adapter must be registered again, and change tokens"
    assert new_pid != old_pid and restarts == 1
    assert problem is None and failed is None


def test_a_wedged_engine_is_ended_by_the_health_probe_and_restarted(tiny_model, monkeypatch):
    monkeypatch.setattr(supervisor, "PROBE_TIMEOUT_S", 1.0)

    async def scenario():
        sup = _supervised(tiny_model)
        try:
            stream = await _started_stream(sup)
            os.kill(sup.pid, signal.SIGSTOP)  # its loop answers nothing any more
            problem = await sup.check()
            with pytest.raises(EngineDied, match="did not answer a health probe") as ended:
                await asyncio.wait_for(_drain(stream), WAIT_S)
            tokens = await asyncio.wait_for(_tokens(sup), WAIT_S)
            return problem, str(ended.value), tokens, sup.restarts, await sup.check()
        finally:
            sup.close()

    problem, ended, tokens, restarts, later = asyncio.run(scenario())
    assert "did not answer a health probe within 1 s" in problem
    assert tokens and restarts == 1 and later is None


def test_while_an_engine_restarts_health_says_why_and_requests_wait(tiny_model):
    gate, starts = threading.Event(), []

    def start(on_exit):
        starts.append(on_exit)
        if len(starts) > 1:
            assert gate.wait(WAIT_S)
        return start_engine(tiny_model, ENGINE, True, on_exit)

    async def scenario():
        sup = EngineSupervisor(start, restartable=True, stall_timeout_s=30.0, start_timeout_s=WAIT_S)
        try:
            os.kill(sup.pid, signal.SIGKILL)
            while not sup.restarting:
                await asyncio.sleep(0.01)
            waiting = asyncio.create_task(_tokens(sup))
            problem, failed = await sup.check(), sup.failed
            await asyncio.sleep(0.2)
            held = not waiting.done()
            gate.set()
            tokens = await asyncio.wait_for(waiting, WAIT_S)
            return problem, failed, held, tokens, await sup.check()
        finally:
            gate.set()
            sup.close()

    problem, failed, held, tokens, later = asyncio.run(scenario())
    assert "exit code -9" in problem and failed is None  # restarting: the replica is not replaced for it
    assert held and tokens and later is None


def test_a_restart_that_fails_or_runs_too_long_fails_the_replica(tiny_model):
    gate, starts = threading.Event(), []

    def start(on_exit):
        starts.append(on_exit)
        if len(starts) == 2:
            assert gate.wait(WAIT_S)
            raise RuntimeError("the checkpoint is gone")
        return start_engine(tiny_model, ENGINE, True, on_exit)

    async def scenario():
        sup = EngineSupervisor(start, restartable=True, stall_timeout_s=30.0, start_timeout_s=0.5)
        try:
            os.kill(sup.pid, signal.SIGKILL)
            while not sup.restarting:
                await asyncio.sleep(0.01)
            with pytest.raises(EngineDied, match="restarting"):
                await _tokens(sup)  # waits start_timeout_s, no longer
            slow = sup.failed
            gate.set()
            while sup.restarting:
                await asyncio.sleep(0.01)
            with pytest.raises(EngineDied, match="the checkpoint is gone"):
                await _tokens(sup)
            return slow, sup.failed, await sup.check()
        finally:
            gate.set()
            sup.close()

    slow, failed, problem = asyncio.run(scenario())
    assert "did not start within 0.5 s" in slow
    assert "starting a new engine failed (RuntimeError: the checkpoint is gone)" in failed and problem == failed


def test_an_engine_that_keeps_failing_fails_the_replica(tiny_model, monkeypatch):
    monkeypatch.setattr(supervisor, "MAX_RESTARTS", 1)

    async def scenario():
        sup = _supervised(tiny_model)
        try:
            os.kill(sup.pid, signal.SIGKILL)
            await asyncio.wait_for(_until(lambda: sup.restarts == 1 and not sup.restarting), WAIT_S)
            os.kill(sup.pid, signal.SIGKILL)
            await asyncio.wait_for(_until(lambda: sup.failed is not None), WAIT_S)
            with pytest.raises(EngineDied, match="must be replaced"):
                await _tokens(sup)
            return sup.restarts, sup.failed
        finally:
            sup.close()

    restarts, failed = asyncio.run(scenario())
    assert restarts == 1 and "the engine failed 2 times in 600 s" in failed


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.05)


def test_an_engine_in_the_replicas_process_that_stalls_or_breaks_fails_health(tiny_model):
    engine = Engine.from_pretrained(tiny_model, **ENGINE)

    async def scenario():
        sup = EngineSupervisor(lambda on_exit: LocalEngine(engine), restartable=False, stall_timeout_s=0.2,
                               start_timeout_s=WAIT_S)
        with engine._lock:  # the step loop cannot take a step while the request waits
            stream = sup.stream(PROMPT, GREEDY)
            first = asyncio.create_task(anext(stream))
            await asyncio.sleep(0.5)
            stalled = await sup.check(), sup.failed
        await asyncio.wait_for(first, WAIT_S)
        await _drain(stream)
        recovered = await sup.check(), sup.failed

        def device_fault(*args):  # what a sticky CUDA error looks like from the host
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        engine.runner.run = device_fault
        with pytest.raises(EngineBroken):
            await _tokens(sup)
        return stalled, recovered, (await sup.check(), sup.failed)

    stalled, recovered, broken = asyncio.run(scenario())
    assert "made no progress for" in stalled[0] and "stall_timeout_s 0.2" in stalled[0] and stalled[1] == stalled[0]
    assert recovered == (None, None)
    assert "the engine is broken (RuntimeError: CUDA error" in broken[0] and broken[1] == broken[0]


async def _until_load(sup: EngineSupervisor, load) -> bool:
    for _ in range(int(WAIT_S / 0.05)):
        if await sup.load() == load:
            return True
        await asyncio.sleep(0.05)
    return False


def test_a_stream_closed_early_aborts_its_request_while_serving_and_after_a_restart(tiny_model):
    async def scenario():
        sup = _supervised(tiny_model)
        try:
            idle = await sup.load()
            stream = await _started_stream(sup)  # the engine serves: its own stream
            busy = (await sup.load()).requests
            await stream.aclose()
            freed_serving = await _until_load(sup, idle)

            os.kill(sup.pid, signal.SIGKILL)
            while not sup.restarting:
                await asyncio.sleep(0.01)
            stream = await _started_stream(sup)  # made while restarting: it waits for the new engine
            restarted_busy = (await sup.load()).requests
            await stream.aclose()
            return busy, freed_serving, restarted_busy, await _until_load(sup, idle), sup.restarts
        finally:
            sup.close()

    busy, freed_serving, restarted_busy, freed_restarted, restarts = asyncio.run(scenario())
    assert busy == 1 and freed_serving
    assert restarts == 1 and restarted_busy == 1 and freed_restarted
