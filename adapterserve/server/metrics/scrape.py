"""GET /metrics on the Ingress: its own counts sent to the hub first (so they are exact at
the scrape), then the hub's totals. Scrapes that arrive together share one render, so a
flood of scrapes costs the hub one render at a time."""
from __future__ import annotations

import asyncio
from typing import Any

from adapterserve.server.metrics.reporter import Reporter

SCRAPE_TIMEOUT_S = 10.0


class MetricsUnavailable(RuntimeError):
    """The hub did not answer (it is starting or being replaced)."""


class Scrapes:
    def __init__(self, reporter: Reporter, hub: Any | None, view: str) -> None:
        self._reporter, self._hub, self.view = reporter, hub, view
        self._render: asyncio.Task | None = None

    async def text(self) -> bytes:
        """The totals of `view`; MetricsUnavailable if the hub cannot give them now."""
        if self._hub is None:
            raise MetricsUnavailable("this server runs no metrics hub")
        if self._render is None or self._render.done():
            self._render = asyncio.get_running_loop().create_task(self._fetch())
        return await asyncio.shield(self._render)

    async def _fetch(self) -> bytes:
        await self._reporter.push()
        try:
            return await asyncio.wait_for(self._hub_render(), SCRAPE_TIMEOUT_S)
        except Exception as exc:
            raise MetricsUnavailable(f"the metrics hub did not answer ({type(exc).__name__}: {exc}); retry in a "
                                     "moment") from exc

    async def _hub_render(self) -> bytes:
        return await self._hub.render.remote(self.view)
