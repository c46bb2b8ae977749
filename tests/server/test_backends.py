"""Backends.static: a backbone's fixed facts are asked once, however many calls arrive first."""
from __future__ import annotations

import asyncio

import pytest

from adapterserve.server.backends import Backends
from adapterserve.server.local_handle import LocalHandle

FACTS = {"tasks": ["generate"], "vocab_size": 512}


class _Replica:
    """An engine replica's describe(), counted; it fails while `failures` is above 0."""

    def __init__(self, failures: int = 0) -> None:
        self.asked, self.failures = 0, failures

    async def describe(self) -> dict:
        self.asked += 1
        await asyncio.sleep(0.01)  # the answer takes a while: other calls arrive meanwhile
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the replica is not ready")
        return {"static": dict(FACTS)}


def _backends(replica: _Replica) -> Backends:
    return Backends(LocalHandle("EngineReplica", replica), None, {"model_id": "m", "encoder_id": None})


def test_calls_that_arrive_while_it_is_asked_share_one_describe():
    replica = _Replica()
    backends = _backends(replica)

    async def run():
        return await asyncio.gather(*[backends.static("m") for _ in range(8)])

    assert asyncio.run(run()) == [FACTS] * 8
    assert replica.asked == 1
    assert asyncio.run(backends.static("m")) == FACTS and replica.asked == 1  # kept


def test_a_failed_describe_fails_its_waiters_and_the_next_call_asks_again():
    replica = _Replica(failures=1)
    backends = _backends(replica)

    async def run():
        return await asyncio.gather(*[backends.static("m") for _ in range(4)], return_exceptions=True)

    outcomes = asyncio.run(run())
    assert all(isinstance(o, RuntimeError) for o in outcomes) and replica.asked == 1
    assert asyncio.run(backends.static("m")) == FACTS and replica.asked == 2


def test_a_caller_that_goes_away_leaves_the_others_their_answer():
    replica = _Replica()
    backends = _backends(replica)

    async def run():
        first = asyncio.ensure_future(backends.static("m"))
        second = asyncio.ensure_future(backends.static("m"))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        return await second

    assert asyncio.run(run()) == FACTS and replica.asked == 1
