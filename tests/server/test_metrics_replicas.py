"""Totals across replicas: a second, small application on the session's Serve (route prefix
/metrics2, the live server's store and keys) with two engine replicas, each with its engine
process, scraped through its own GET /metrics (http_route "full").

Its adapter table starts empty, so the names are known: with N = 2, the first two adapters
used (sql, chat) keep their names and poem counts as `_other`. The application is deleted
at the end (gRPC clients of the session's server need Serve to hold one application).
"""
from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.helpers.live_server import ALICE, MAX_WAITING, NUM_KV_BLOCKS
from tests.helpers.scrape import Scrape, parse
from tests.helpers.serve_apps import delete_app

APP, PREFIX = "metrics2", "/metrics2"
PLAN = [("sql", 3), ("chat", 2), ("poem", 2)]  # in this order: the first two get names
BASE_CALLS = 10  # MAX_WAITING at a time: more arriving between two steps of one engine would be shed (429)
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def two_replicas(server, uploaded):
    from ray import serve

    from adapterserve.server.app import build_app

    config = copy.deepcopy(server.config)
    config.update(app_name=APP, encoder=False, encoder_pinned_adapters=[])
    config["replica"] = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1}}
    config["metrics"] = {"http_route": "full", "adapter_labels": 2, "push_interval_s": 0.25, "port": None}
    serve.run(build_app(config), name=APP, route_prefix=PREFIX, blocking=False)
    try:
        yield f"{server.http}{PREFIX}"
    finally:
        delete_app(APP, server.grpc)


def _complete(base: str, model: str, max_tokens: int = 3) -> dict:
    body = {"model": model, "prompt": "two replicas", "max_tokens": max_tokens, "temperature": 0}
    reply = requests.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {ALICE}"},
                          timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _scrape_when(base: str, done) -> Scrape:
    deadline = time.monotonic() + 90
    while True:
        reply = requests.get(f"{base}/metrics", timeout=30)
        assert reply.status_code == 200, reply.text
        found = parse(reply.text)
        if done(found):
            return found
        assert time.monotonic() < deadline, "the replicas' reports never added up"
        time.sleep(0.25)


def test_two_engine_replicas_add_up(two_replicas):
    for adapter, calls in PLAN:
        for _ in range(calls):
            _complete(two_replicas, adapter)
    with ThreadPoolExecutor(MAX_WAITING) as pool:
        list(pool.map(lambda _: _complete(two_replicas, MODEL, 8), range(BASE_CALLS)))
    calls = sum(n for _, n in PLAN) + BASE_CALLS
    found = _scrape_when(two_replicas, lambda s: s.total("adapterserve_request_queue_seconds_count") >= calls
                         and s.total("adapterserve_metrics_reporters", role="model") == 2)
    counted = {a: found.total("adapterserve_requests_total", method="completions", code="OK", adapter=a)
               for a in ("sql", "chat", "_other", "_base")}
    assert counted == {"sql": 3, "chat": 2, "_other": 2, "_base": BASE_CALLS}
    assert found.total("adapterserve_request_queue_seconds_count", backbone=MODEL) == calls
    assert found.total("adapterserve_kv_cache_blocks", backbone=MODEL) == 2 * NUM_KV_BLOCKS
    assert found.total("adapterserve_adapter_slots", backbone=MODEL) == 2 * 4
    assert found.total("adapterserve_tenant_requests_total", tenant="alice") == calls
    (lora,) = [dict(ls) for (n, ls), _ in found.samples.items() if n == "vllm:lora_requests_info"]
    assert lora["max_lora"] == "8"
