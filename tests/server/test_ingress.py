"""The ingress stops a replica's request whenever its caller goes away, wherever the
cancellation lands: awaiting the next chunk, or right after one was relayed (its
generator suspended at `yield`, where Serve delivers a cancellation that arrives
before the next chunk is asked for)."""
from __future__ import annotations

import asyncio
from types import MethodType, SimpleNamespace

import pytest

from adapterserve.adapters_store.keys import ApiKeys
from adapterserve.proto import adapterserve_pb2 as pb
from adapterserve.server.admission import Admission
from adapterserve.server.quotas import TenantGate
from adapterserve.server.ingress import Ingress
from adapterserve.server.metrics.calls import CallMetrics
from adapterserve.server.settings import DEFAULTS
from adapterserve.server.tracing import Tracing


class _Response:
    """A streaming DeploymentHandle call: chunks until cancelled."""

    def __init__(self) -> None:
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        await asyncio.sleep(0)
        return {"request_id": "r", "token_ids": [7], "text": "x", "finish_reason": None, "prompt_tokens": 2}

    def cancel(self) -> None:
        self.cancelled = True


class _Finished(_Response):
    """A call whose stream ends after one chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.left = 1

    async def __anext__(self) -> dict:
        if not self.left:
            raise StopAsyncIteration
        self.left -= 1
        return {**await super().__anext__(), "finish_reason": "length"}


class _Handle:
    def __init__(self, response: _Response) -> None:
        self.response = response
        self.generate = SimpleNamespace(remote=lambda request: response)

    def options(self, **_) -> _Handle:
        return self


async def _ingress_and_handle(response=None):
    """Ingress's generation methods on stand-ins for what Serve gives it."""
    handle = _Handle(response or _Response())

    async def for_call(task, version):
        return handle

    async def static(backbone):
        return {"vocab_size": 512, "max_model_len": 1024}

    metrics = CallMetrics(None, DEFAULTS["metrics"])  # recorded, sent nowhere
    backends = SimpleNamespace(for_call=for_call, static=static, model_id="tiny")
    ingress = SimpleNamespace(backends=backends, keys=ApiKeys.open(), metrics=metrics, tokenizer=None,
                              max_prompt_chars=None, admission=Admission(max_in_flight=4, max_health_watches=1),
                              gate=TenantGate(),
                              tracing=Tracing(),  # off: ids only
                              _gc_task=asyncio.get_running_loop().create_future())  # no store collection here
    for name in ("Generate", "_generate", "_token_ids", "_count", "_ensure_gc"):
        setattr(ingress, name, MethodType(getattr(Ingress.func_or_class, name), ingress))
    return ingress, handle


def _call(ingress):
    trailing: list = []
    context = SimpleNamespace(invocation_metadata=lambda: (), trailing_metadata=lambda: list(trailing),
                              set_trailing_metadata=lambda pairs: trailing.__setitem__(slice(None), pairs))
    return ingress.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])), context)


@pytest.mark.parametrize("how", ["cancelled at yield", "closed", "cancelled awaiting"])
def test_a_caller_gone_mid_stream_cancels_the_replicas_request(how):
    async def scenario() -> bool:
        ingress, handle = await _ingress_and_handle()
        stream = _call(ingress)
        await stream.__anext__()
        if how == "cancelled at yield":
            with pytest.raises(asyncio.CancelledError):
                await stream.athrow(asyncio.CancelledError())
        elif how == "closed":
            await stream.aclose()
        else:
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)  # the next chunk is awaited
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        return handle.response.cancelled, ingress.admission.in_flight

    assert asyncio.run(scenario()) == (True, 0)  # and its admission place is given back


def test_a_stream_that_ends_is_not_cancelled():
    async def scenario() -> tuple[list[str], bool]:
        ingress, handle = await _ingress_and_handle(_Finished())
        got = [m.finish_reason async for m in _call(ingress)]
        return got, handle.response.cancelled

    assert asyncio.run(scenario()) == (["length"], False)
