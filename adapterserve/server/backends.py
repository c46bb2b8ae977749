"""The engine deployments behind the ingress, and which one serves a call.

The generation backbone (`model`) answers Generate; the encoder (`encoder`, when
configured) answers Classify and Embed. An adapter is recorded at upload with the
backbone it was validated for, so a call that names one goes to that backbone;
a call the chosen backbone cannot serve is refused with FAILED_PRECONDITION.
In direct mode (server/direct.py) the generation backbone's handle is a LocalHandle,
to the engine replica in the ingress's own process.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping
from functools import partial
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.server.local_handle import LocalHandle

Handle = DeploymentHandle | LocalHandle  # a Serve handle, or one to a replica in this process (direct mode)
_HINTS = {
    "generate": "use `adapterserve generate` with an adapter made for the generation backbone",
    "classify": "use `adapterserve classify` with an adapter made for the encoder",
    "embed": "use `adapterserve embed` with an adapter made for the encoder, or none",
}


class NotServed(Exception):
    """The call needs a backbone (or a task) this server does not run for it."""


def own_handle(bound: Handle) -> Handle:
    """A handle to the same deployment with this process's Serve options (a LocalHandle, to a
    replica in this process, as it is). A bound handle carries the options of the driver that
    built the app, and a driver that imported Serve before SERVE_ENV was set calls by object
    reference, not over Serve's gRPC transport."""
    if isinstance(bound, LocalHandle):
        return bound
    return serve.get_deployment_handle(bound.deployment_name, bound.app_name, _check_exists=False)


class Backends:
    def __init__(self, model: Handle, encoder: DeploymentHandle | None, config: Mapping[str, Any]) -> None:
        self.model_id: str = config["model_id"]
        self.encoder_id: str | None = config["encoder_id"] if encoder is not None else None
        self._handles = {self.model_id: own_handle(model)}
        if encoder is not None:
            self._handles[self.encoder_id] = own_handle(encoder)
        self._static: dict[str, dict[str, Any]] = {}
        self._asking: dict[str, asyncio.Future] = {}  # a describe() in flight, shared by the calls that wait

    @property
    def model(self) -> Handle:
        return self._handles[self.model_id]

    def deployments(self) -> dict[str, Handle]:
        """Deployment name -> handle, for every engine deployment (what health asks)."""
        return {handle.deployment_name: handle for handle in self._handles.values()}

    def handle(self, backbone: str) -> Handle:
        return self._handles[backbone]

    async def static(self, backbone: str) -> dict[str, Any]:
        """The backbone's fixed facts (from one replica's describe(), asked once: the calls that
        arrive while it is asked wait for the same answer; after a failure the next call asks again)."""
        facts = self._static.get(backbone)
        if facts is not None:
            return facts
        asking = self._asking.get(backbone)
        if asking is None:
            asking = self._asking[backbone] = asyncio.ensure_future(self._describe(backbone))
            asking.add_done_callback(partial(self._asked, backbone))
        return await asyncio.shield(asking)  # a caller that goes away leaves the others' answer coming

    async def _describe(self, backbone: str) -> dict[str, Any]:
        facts = self._static[backbone] = (await self._handles[backbone].describe.remote())["static"]
        return facts

    def _asked(self, backbone: str, asking: asyncio.Future) -> None:
        self._asking.pop(backbone, None)
        if not asking.cancelled():
            asking.exception()  # retrieved: a failure every waiter left is not reported as unhandled

    async def statics(self) -> list[dict[str, Any]]:
        """Every backbone's facts, the generation backbone first (the upload validation order)."""
        return [await self.static(b) for b in self._handles]

    async def for_call(self, task: str, version: AdapterVersion | None) -> Handle:
        """The deployment for `task` with `version`; NotServed if none can serve it."""
        backbone = self._backbone_of(version) if version else self._default_for(task)
        static = await self.static(backbone)
        if task not in static["tasks"]:
            what = f"adapter {version.ref!r} is made for backbone" if version else "this server's backbone is"
            raise NotServed(f"{task}: {what} {backbone!r}, which serves {' and '.join(static['tasks'])} "
                            f"only; {_HINTS[task]}")
        return self._handles[backbone]

    def _default_for(self, task: str) -> str:
        return self.encoder_id if task != "generate" and self.encoder_id else self.model_id

    def _backbone_of(self, version: AdapterVersion) -> str:
        backbone = (version.info or {}).get("backbone") or self.model_id  # older records: the model
        if backbone not in self._handles:
            raise NotServed(f"adapter {version.ref!r} was validated for backbone {backbone!r}, which this server "
                            f"does not run (it runs {', '.join(self._handles)}); upload it again for one of those")
        return backbone
