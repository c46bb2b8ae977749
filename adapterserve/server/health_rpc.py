"""grpc.health.v1 on the ingress: Check and Watch report whether every engine deployment
serves (health.py asks them) and the ingress is not draining.

Both need no API key (load balancers and probes call them), so neither may hold the
ingress for long: Check answers from the shared, recent report; Watch streams are
few (Admission.watch(): `max_health_watches` per ingress replica, the rest refused
with RESOURCE_EXHAUSTED) and each ends after WATCH_LIFETIME_S, with status OK (a
health client watches again).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

from adapterserve.errors import Overloaded, RequestError
from adapterserve.server.grpc_services import Undecodable, refuse_undecodable
from adapterserve.server.status import grpc_error

SERVICE_NAME = "adapterserve.v1.AdapterServe"
WATCH_INTERVAL_S = 1.0  # how often a watch looks at the report (sent only when it changes)
WATCH_LIFETIME_S = 300.0
Status = health_pb2.HealthCheckResponse


class HealthRpc:
    """Mixed into the Ingress: needs `health` (DeploymentHealth) and `admission` (Admission)."""

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context) -> health_pb2.HealthCheckResponse:
        if isinstance(request, Undecodable):
            grpc_error(grpc_context, request.refuse())
            return Status()
        if request.service not in ("", SERVICE_NAME):
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}; this server has {SERVICE_NAME!r}")
            return Status()
        return Status(status=await self._serving_status())

    async def Watch(self, request: health_pb2.HealthCheckRequest, grpc_context) -> AsyncIterator[Status]:
        """Sends the status now, then whenever it changes, for up to WATCH_LIFETIME_S."""
        try:
            refuse_undecodable(request)
            with self.admission.watch():
                if request.service not in ("", SERVICE_NAME):
                    yield Status(status=Status.SERVICE_UNKNOWN)  # the protocol: say so, keep the stream
                    await asyncio.sleep(WATCH_LIFETIME_S)
                    return
                async for status in self._changes(time.monotonic() + WATCH_LIFETIME_S):
                    yield Status(status=status)
        except (Overloaded, RequestError) as exc:
            grpc_error(grpc_context, exc)

    async def _changes(self, until: float) -> AsyncIterator[int]:
        last = None
        while time.monotonic() < until:
            status = await self._serving_status()
            if status != last:
                yield status
                last = status
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _serving_status(self) -> int:
        if self.admission.draining or not await self.health.serving():
            return Status.NOT_SERVING
        return Status.SERVING
