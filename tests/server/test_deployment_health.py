"""The engine deployments' health as the ingress reports it: each deployment's own answer,
or why none came; asked once for any number of callers, and again only when stale."""
from __future__ import annotations

import asyncio

from adapterserve.server.health import SERVING, DeploymentHealth


class _Response:
    """A DeploymentHandle call's response: awaitable, cancellable."""

    def __init__(self, answer) -> None:
        self.answer, self.cancelled = answer, False

    def __await__(self):
        return self._result().__await__()

    async def _result(self):
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer == "hang":
            await asyncio.sleep(3600)
        return self.answer

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    """A deployment handle whose health() answers `answer`; counts the calls."""

    def __init__(self, answer) -> None:
        self.answer, self.calls, self.responses = answer, 0, []
        self.health = self

    def remote(self) -> _Response:
        self.calls += 1
        self.responses.append(_Response(self.answer))
        return self.responses[-1]


def test_each_deployment_reports_its_own_state():
    handles = {"EngineReplica": _Handle(None), "EncoderReplica": _Handle("the engine is restarting"),
               "Other": _Handle(RuntimeError("no replica\nsecond line")), "Wedged": _Handle("hang")}
    health = DeploymentHealth(handles, timeout_s=0.2)

    async def scenario():
        return await health.report(), await health.serving()

    report, serving = asyncio.run(scenario())
    assert report == {"EngineReplica": SERVING, "EncoderReplica": "the engine is restarting",
                      "Other": "no replica answered (RuntimeError: no replica)",
                      "Wedged": "no replica answered within 0.2 s"}
    assert not serving and handles["Wedged"].responses[0].cancelled


def test_callers_share_one_question_and_get_the_latest_report_at_once():
    handle = _Handle(None)
    health = DeploymentHealth({"EngineReplica": handle}, max_age_s=0.3)

    async def scenario():
        together = await asyncio.gather(*(health.serving() for _ in range(50)))  # the first report
        calls = handle.calls
        handle.answer = "the engine is restarting"
        await asyncio.sleep(0.4)
        stale = await health.serving()  # the latest report at once; a new question asked meanwhile
        await asyncio.sleep(0.1)
        return together, calls, stale, await health.report(), handle.calls

    together, calls, stale, fresh, later_calls = asyncio.run(scenario())
    assert all(together) and calls == 1
    assert stale and fresh == {"EngineReplica": "the engine is restarting"} and later_calls == 2
