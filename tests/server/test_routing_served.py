"""Routing on two engine replicas: small applications on the session's Serve (the live server's
store and keys, HTTP under their own route prefix), each replica's own counts read from the
application's metrics hub (MetricsHub.by_replica): requests started and adapters loaded into
a slot.

Adapter affinity (spill_queue_depth 2): one adapter's requests, one at a time, all go to one
replica, which loads it once; a burst past the threshold spills to the other replica, which
loads it too; the tokens are the same wherever a request ran. pow2: the same requests one at
a time go to both replicas. The applications are deleted at the end (gRPC clients of the
session's server need Serve to hold one application).
"""
from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests

from tests.helpers.live_server import ALICE
from tests.helpers.serve_apps import delete_app

REQUESTS = "adapterserve_request_queue_seconds_count"  # one observation per request started
SLOT_LOADS = "adapterserve_adapter_slot_loads"
SPILL_DEPTH = 2
PROMPT = "route me"


@contextmanager
def _two_replicas(server, app: str, routing: dict) -> Iterator[str]:
    from ray import serve

    from adapterserve.server.app import build_app

    config = copy.deepcopy(server.config)
    config.update(app_name=app, encoder=False, encoder_pinned_adapters=[], routing=routing)
    config["replica"] = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1}}
    config["metrics"] = {"http_route": "off", "push_interval_s": 0.25, "port": None}
    serve.run(build_app(config), name=app, route_prefix=f"/{app}", blocking=False)
    try:
        _counts(app, lambda found: len(found) == 2)  # both replicas up and reporting
        yield f"{server.http}/{app}"
    finally:
        delete_app(app, server.grpc)


@pytest.fixture(scope="module")
def affinity(server, uploaded):
    with _two_replicas(server, "routing-adapter", {"mode": "adapter", "spill_queue_depth": SPILL_DEPTH}) as base:
        yield base


def _counts(app: str, done) -> dict[str, tuple[int, int]]:
    """Replica -> (requests started, slot loads), once `done(that)` holds (within 90 s)."""
    from ray import serve

    hub = serve.get_deployment_handle("MetricsHub", app)
    deadline = time.monotonic() + 90
    while True:
        found = {replica: (int(v.get(REQUESTS, 0)), int(v.get(SLOT_LOADS, 0)))
                 for replica, v in hub.by_replica.remote("model").result().items()}
        if done(found):
            return found
        assert time.monotonic() < deadline, f"the replicas' counts never reached what was sent: {found}"
        time.sleep(0.25)


def _total(counts: dict[str, tuple[int, int]]) -> int:
    return sum(requests for requests, _ in counts.values())


def _after(app: str, before: dict[str, tuple[int, int]], sent: int) -> dict[str, tuple[int, int]]:
    """Each replica's (requests, slot loads) since `before`, once `sent` more requests are counted."""
    now = _counts(app, lambda found: len(found) == 2 and _total(found) >= _total(before) + sent)
    return {replica: (r - before[replica][0], loads - before[replica][1]) for replica, (r, loads) in now.items()}


def _complete(base: str, adapter: str, max_tokens: int = 4) -> str:
    """The completion's text; a 429 (an engine's queue full while the router's view of the
    replicas' load lags) is retried as its message advises."""
    body = {"model": adapter, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    for _ in range(100):
        reply = requests.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {ALICE}"},
                              timeout=120)
        if reply.status_code != 429:
            break
        time.sleep(0.2)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_one_adapter_at_a_time_stays_on_the_replica_that_holds_it(affinity):
    before = _counts("routing-adapter", lambda found: len(found) == 2)
    texts = {_complete(affinity, "sql") for _ in range(6)}
    served = _after("routing-adapter", before, 6)
    assert sorted(served.values()) == [(0, 0), (6, 1)]
    assert len(texts) == 1


def test_a_burst_past_the_spill_depth_spreads_and_the_tokens_stay_the_same(affinity, server):
    start = _counts("routing-adapter", lambda found: len(found) == 2)
    _complete(affinity, "chat")  # one replica holds it
    before = _counts("routing-adapter", lambda found: _total(found) > _total(start))
    burst = 4 * SPILL_DEPTH
    with ThreadPoolExecutor(burst) as pool:
        texts = list(pool.map(lambda _: _complete(affinity, "chat", 96), range(burst)))
    served = _after("routing-adapter", before, burst)
    assert all(requests > 0 for requests, _ in served.values()), served
    assert sorted(loads for _, loads in served.values()) == [0, 1]  # the other replica loaded it once
    assert set(texts) == {_complete(server.http, "chat", 96)}  # the session server: one replica


def test_pow2_spreads_one_adapter_over_both_replicas(server, uploaded, affinity):
    sent = 16  # one at a time: all on one replica has odds 2**-15
    with _two_replicas(server, "routing-pow2", {"mode": "pow2", "spill_queue_depth": None}) as pow2:
        before = _counts("routing-pow2", lambda found: len(found) == 2)
        texts = {_complete(pow2, "poem") for _ in range(sent)}
        served = _after("routing-pow2", before, sent)
    assert all(requests > 0 and loads == 1 for requests, loads in served.values()), served
    assert texts == {_complete(affinity, "poem")}
