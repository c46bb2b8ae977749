"""A stream's output queue: a reader's pause ends when the stream's end arrives, at once if
it is already waiting, and pauses again once that end was read."""
import asyncio

import pytest

from adapterserve.engine.output_queue import OutputQueue
from adapterserve.engine.request import RequestOutput

HOUR = 3600.0  # a pause no test waits out: only an arriving end can finish it


def _chunk(finish: str | None = None, index: int = 0) -> RequestOutput:
    return RequestOutput("r", [7], "x", finish, index=index)


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_pause_ends_when_a_finishing_chunk_arrives_not_before():
    async def run():
        queue = OutputQueue()
        settling = asyncio.create_task(queue.settle(HOUR))
        await _turns()
        queue.put_nowait(_chunk())  # a token mid-stream: the pause goes on
        await _turns()
        assert not settling.done()
        queue.put_nowait(_chunk("length"))
        await asyncio.wait_for(settling, 10)
        return [queue.get_nowait().finish_reason for _ in range(queue.qsize())]

    assert asyncio.run(run()) == [None, "length"]


@pytest.mark.parametrize("end", [_chunk("stop"), RuntimeError("engine broke"),
                                 RequestOutput("r", [], "", "error", error=ValueError("bad"))])
def test_an_end_already_waiting_means_no_pause(end):
    async def run():
        queue = OutputQueue()
        queue.put_nowait(end)
        await asyncio.wait_for(queue.settle(HOUR), 10)
        return queue.get_nowait()

    assert asyncio.run(run()) is end


def test_after_one_choice_ends_and_is_read_the_next_pause_waits_again():
    async def run():
        queue = OutputQueue()
        queue.put_nowait(_chunk("length", index=0))
        queue.get_nowait()
        settling = asyncio.create_task(queue.settle(HOUR))
        await _turns()
        waited = not settling.done()
        queue.put_nowait(_chunk("length", index=1))
        await asyncio.wait_for(settling, 10)
        return waited

    assert asyncio.run(run())


def test_a_pause_runs_its_length_and_zero_is_none():
    async def run():
        queue = OutputQueue()
        await asyncio.wait_for(queue.settle(0.0), 10)
        await asyncio.wait_for(queue.settle(0.001), 10)  # nothing arrives: the timer ends it
        return queue.empty()

    assert asyncio.run(run())


def test_a_cancelled_pause_leaves_the_queue_usable():
    async def run():
        queue = OutputQueue()
        settling = asyncio.create_task(queue.settle(HOUR))
        await _turns()
        settling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await settling
        queue.put_nowait(_chunk("stop"))  # no waiter left to wake
        return (await queue.get()).finish_reason

    assert asyncio.run(run()) == "stop"
