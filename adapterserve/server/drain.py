"""Draining an application: every Ingress replica stops taking calls (new ones get
UNAVAILABLE, "the server is shutting down"; health says NOT_SERVING) while the calls it
holds finish.

Serve routes a handle call to one replica of its choice; draining must reach each replica,
so the calls go to each Ingress replica's actor (Serve's own request entry point, the one
its router uses), found in the controller's details of the application.
"""
from __future__ import annotations

import logging
import pickle
import time
import uuid
from typing import Any

import ray
from ray.serve._private.common import RequestMetadata
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve.context import _get_global_client

INGRESS = "Ingress"  # the entry deployment's name (app.py)
CALL_TIMEOUT_S = 10.0
POLL_S = 0.2
logger = logging.getLogger("adapterserve.server")


def drain(app_name: str, grace_s: float) -> int:
    """Drain every Ingress replica of `app_name` and wait until none holds a call, at most
    `grace_s`; returns the calls still in flight then."""
    deadline = time.monotonic() + grace_s
    while True:  # listed again each round: a replica Serve started meanwhile is drained too
        in_flight = sum(call_each(app_name, "drain"))
        if in_flight == 0 or time.monotonic() >= deadline:
            return in_flight
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def call_each(app_name: str, method: str) -> list[Any]:
    """`method` of every running Ingress replica of `app_name` (replicas that do not answer in
    time are left out)."""
    refs = [replica.handle_request.remote(pickle.dumps(_metadata(app_name, method)))
            for replica in _ingress_replicas(app_name)]
    results = []
    for ref in refs:
        try:
            results.append(ray.get(ref, timeout=CALL_TIMEOUT_S))
        except (ray.exceptions.RayError, TimeoutError) as exc:  # a replica dying or gone: nothing to wait for
            logger.warning("an Ingress replica did not answer %s: %s", method, exc)
    return results


def _ingress_replicas(app_name: str) -> list[ray.actor.ActorHandle]:
    details = _get_global_client().get_serve_details()
    app = details.get("applications", {}).get(app_name)
    if app is None:
        return []
    replicas = app["deployments"].get(INGRESS, {}).get("replicas", [])
    found = []
    for replica in replicas:
        try:
            if replica["state"] == "RUNNING":
                found.append(ray.get_actor(replica["actor_name"], namespace=SERVE_NAMESPACE))
        except ValueError:  # stopped since the controller listed it
            continue
    return found


def _metadata(app_name: str, method: str) -> RequestMetadata:
    request_id = uuid.uuid4().hex
    return RequestMetadata(request_id=request_id, internal_request_id=request_id, call_method=method,
                           app_name=app_name)
