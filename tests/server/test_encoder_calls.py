"""An EncoderEngine's calls, timed for health: a running call's age is its time without
progress; an accelerator error breaks the encoder, any other error ends its call only."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from adapterserve.errors import EngineBroken, RequestError
from adapterserve.server.engine_process.encoder_calls import EncoderCalls


def test_a_running_call_counts_as_time_without_progress():
    calls, release = EncoderCalls(), threading.Event()

    async def scenario():
        running = asyncio.create_task(calls.run(release.wait, 60))
        while calls.busy_s() == 0.0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        busy = calls.busy_s()
        release.set()
        await running
        return busy, calls.busy_s()

    busy, after = asyncio.run(scenario())
    assert busy >= 0.2 and after == 0.0


def test_an_accelerator_error_breaks_the_encoder_and_others_do_not():
    calls = EncoderCalls()

    def refuse():
        raise RequestError("adapter 'x' has no head")

    def device_fault():
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RequestError):
        asyncio.run(calls.run(refuse))
    assert calls.broken is None and asyncio.run(calls.run(lambda: 7)) == 7
    with pytest.raises(EngineBroken, match="illegal memory access"):
        asyncio.run(calls.run(device_fault))
    with pytest.raises(EngineBroken, match="the encoder is broken"):
        asyncio.run(calls.run(lambda: 7))
    assert "AcceleratorError: CUDA error" in calls.broken and calls.busy_s() == 0.0
