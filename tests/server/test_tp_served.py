"""A tensor-parallel engine replica through the real server: an application on the session's
Serve whose one replica runs its engine at tensor_parallel_size 2 (in its child process, or in
the replica's own process with engine_process false), its worker a Ray actor in bundle 1 of the
replica's own placement group; or, in direct mode (server/direct.py), inside the ingress's
replica, which then holds the placement group. Its greedy text for a LoRA adapter and for the
base equals the session server's (size 1)."""
from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import requests

from tests.helpers.live_server import ALICE
from tests.helpers.serve_apps import delete_app

APP = "tp2"  # the applications: tp2-child, tp2-inproc, tp2-direct
PROMPT = "split me"


def _complete(base: str, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    deadline = time.monotonic() + 120
    while True:
        reply = requests.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {ALICE}"},
                              timeout=120)
        if reply.status_code != 503 or time.monotonic() > deadline:  # 503: the app is still starting
            break
        time.sleep(0.5)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.parametrize("engine_process, direct", [(True, False), (False, False), (True, True)],
                         ids=["child", "inproc", "direct"])
def test_a_tensor_parallel_replica_serves_what_one_gpu_serves(server, uploaded, engine_process, direct):
    from ray import serve
    from ray.util import placement_group_table

    from adapterserve.server.app import build_app

    config = copy.deepcopy(server.config)
    app = f"{APP}-{'direct' if direct else 'child' if engine_process else 'inproc'}"
    config.update(app_name=app, encoder=False, encoder_pinned_adapters=[], engine_process=engine_process,
                  direct=direct)
    config["engine"] = {**config["engine"], "tensor_parallel_size": 2}
    config["replica"] = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1}}
    config["metrics"] = {"http_route": "off", "push_interval_s": 0.25, "port": None}
    serve.run(build_app(config), name=app, route_prefix=f"/{app}", blocking=False)
    try:
        base = f"{server.http}/{app}"
        models = ("sql", Path(server.config["model"]).name)  # the base: its directory's name
        texts = {model: _complete(base, model) for model in models}
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert any(len(g["bundles"]) == 2 and g["strategy"] == "STRICT_PACK" for g in groups), groups
    finally:
        delete_app(app, server.grpc)
    assert texts == {model: _complete(server.http, model) for model in models}
    assert len(set(texts.values())) == 2, "the adapter changed nothing: a vacuous check"
