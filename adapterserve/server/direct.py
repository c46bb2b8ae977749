"""Direct mode (setting `direct`, server/direct_settings.py): the generation engine inside the
ingress deployment, one hop from HAProxy to the replica that runs the request.

Each replica of the `Ingress` deployment is an Ingress (auth, quotas, admission, resolution,
tokenization, tracing, metrics, health, drain, uploads, the OpenAI routes: ingress.py,
unchanged) that owns an EngineReplica (replica.py: the engine child process, adapters,
pinned adapters, its own metrics and spans) and calls it through a LocalHandle
(local_handle.py) where the two-tier Ingress holds a Serve handle. Serve's health checks of
the deployment probe the engine as the EngineReplica deployment's do. The encoder stays a
deployment of its own, behind a Serve handle. With `replica_grpc.port` set, the replica also
serves gRPC on a listener of its own (replica_grpc.py), stopped when Serve stops the replica,
after the calls it holds finish (within `drain_grace_s`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from typing import Any

import grpc
from ray import serve
from ray.serve.handle import DeploymentHandle

from adapterserve.server.front.pool import FrontPool
from adapterserve.server.grpc_services import hold_pending_calls
from adapterserve.server.ingress import Ingress
from adapterserve.server.local_handle import LocalHandle
from adapterserve.server.prompts import start_loading_tokenizer
from adapterserve.server.replica import EngineReplica
from adapterserve.server.replica_grpc import start_listener
from adapterserve.server.replica_grpc_settings import SETTING

ENGINE_NAME = "EngineReplica"  # the local engine's name in health reports, as the two-tier deployment's
PREDECESSOR_SLACK_S = 10.0  # beyond drain_grace_s: until Serve has ended a replica that overran its grace
logger = logging.getLogger("adapterserve.server")


async def start_engine_replica(config: dict[str, Any], role: str, metrics_hub: Any | None) -> Any:
    """An EngineReplica object in this process (its engine started, adapters pinned)."""
    cls = EngineReplica.func_or_class
    replica = cls.__new__(cls)
    await replica.__init__(config, role, metrics_hub)
    return replica


def ingress_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` as the Ingress reads it here: its replicas are the generation replicas (for the
    tenants' per-replica share of their quotas)."""
    replicas = config["replica"]["num_replicas"]
    ingress = {**config["ingress"], "num_replicas": replicas if isinstance(replicas, int) else 1}
    return {**config, "ingress": ingress}


async def open_listener(servicer: Any, listen: Mapping[str, Any], wait_s: float) -> grpc.aio.Server | FrontPool:
    """The replica's own gRPC listener: a grpc.aio server on this loop, or `workers` front
    worker processes forwarding to it (front/pool.py)."""
    if not listen["workers"]:
        return await start_listener(servicer, listen["host"], listen["port"], wait_s=wait_s)
    pool = FrontPool(servicer, listen["host"], listen["port"], listen["workers"])
    await pool.start(wait_s)
    return pool


@serve.deployment
class DirectIngress(Ingress.func_or_class):
    async def __init__(self, config: dict[str, Any], encoder: DeploymentHandle | None = None,
                       metrics_hub: DeploymentHandle | None = None) -> None:
        hold_pending_calls()  # before Serve starts this replica's gRPC server, as the Ingress does
        start_loading_tokenizer(config["model"])  # the Ingress's, while the engine process starts
        self.engine_replica = await start_engine_replica(config, "model", metrics_hub)
        local = LocalHandle(ENGINE_NAME, self.engine_replica)
        await super().__init__(local, ingress_config(config), encoder, metrics_hub)
        self.listener: grpc.aio.Server | FrontPool | None = None
        self._grace_s = float(config["drain_grace_s"])
        listen = config[SETTING]
        if listen["port"] is not None:
            try:
                # Serve may start this replica while the one it replaces drains on the port
                self.listener = await open_listener(self, listen, wait_s=self._grace_s + PREDECESSOR_SLACK_S)
            except BaseException:  # Serve calls no __del__ for a replica that failed to start
                self._stop_engine()
                raise
            logger.info("serving gRPC on %s:%s too (%s, %s)", listen["host"], listen["port"], SETTING,
                        f"{listen['workers']} front workers" if listen["workers"] else "on the replica's loop")

    async def check_health(self) -> None:
        """Serve's health check: the engine's (replica.py); raises when this replica must be replaced."""
        await self.engine_replica.check_health()
        if isinstance(self.listener, FrontPool):
            self.listener.check()

    def __del__(self) -> Awaitable[None] | None:
        """Serve calls it on a graceful shutdown, on the replica's loop, and awaits what it returns:
        the listener's calls finish (within drain_grace_s), then the engine stops. At collection
        (no loop running here) the engine stops at once."""
        listener, self.listener = getattr(self, "listener", None), None
        if listener is not None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                return self._stop_after(listener)
        self._stop_engine()
        return None

    async def _stop_after(self, listener: grpc.aio.Server | FrontPool) -> None:
        self.admission.drain()  # new calls on the listener: UNAVAILABLE while its running ones finish
        try:
            await listener.stop(self._grace_s)
        finally:
            self._stop_engine()

    def _stop_engine(self) -> None:
        engine = getattr(self, "engine_replica", None)
        if engine is not None:
            engine.__del__()  # the engine goes with the replica (the Ingress itself has nothing to close)
