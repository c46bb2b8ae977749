"""The engine deployments' health as one ingress replica sees it.

Each engine deployment (the generation backbone's, the encoder's) is asked `health()`
(replica.py): None while it serves, else why not (no answer within `timeout_s` is an
answer too). Callers get the latest report at once; one older than `max_age_s` is
asked again in the background, one question at a time. So health calls (gRPC Check
and Watch, GET /health; unauthenticated) cost the engines almost nothing and hold no
ingress place for long: only the first one waits, for the first report.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

SERVING = "ok"


class DeploymentHealth:
    def __init__(self, handles: Mapping[str, Any], timeout_s: float = 5.0, max_age_s: float = 1.0) -> None:
        """`handles`: deployment name -> its DeploymentHandle."""
        self.handles = dict(handles)
        self.timeout_s, self.max_age_s = timeout_s, max_age_s
        self._report: dict[str, str] = {}
        self._asked_at = float("-inf")
        self._asking: asyncio.Task | None = None

    async def report(self) -> dict[str, str]:
        """Deployment name -> "ok", or why it does not serve (as of at most max_age_s ago, give
        or take one question)."""
        stale = time.monotonic() - self._asked_at > self.max_age_s
        if stale and (self._asking is None or self._asking.done()):
            self._asking = asyncio.get_running_loop().create_task(self._ask_all())
        if not self._report:  # nothing known yet: wait for the first answers
            await asyncio.shield(self._asking)  # a caller that goes away leaves the question to the others
        return dict(self._report)

    async def serving(self) -> bool:
        return all(state == SERVING for state in (await self.report()).values())

    async def _ask_all(self) -> None:
        names = list(self.handles)
        answers = await asyncio.gather(*(self._ask(name) for name in names))
        self._report = dict(zip(names, answers, strict=True))
        self._asked_at = time.monotonic()

    async def _ask(self, name: str) -> str:
        response = self.handles[name].health.remote()
        try:
            why = await asyncio.wait_for(response, self.timeout_s)
        except TimeoutError:
            response.cancel()
            return f"no replica answered within {self.timeout_s:g} s"
        except Exception as exc:
            return f"no replica answered ({type(exc).__name__}: {_first_line(exc)})"
        return SERVING if why is None else why


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]
