"""A tensor-parallel engine replica through the real server: an application on the session's
Serve whose one replica runs its engine (in its child process) at tensor_parallel_size 2,
its worker a Ray actor in bundle 1 of the replica's own placement group. Its greedy text
for a LoRA adapter and for the base equals the session server's (size 1)."""
from __future__ import annotations

import copy
import time
from pathlib import Path

import requests

from tests.helpers.live_server import ALICE

APP = "tp2"
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


def test_a_tensor_parallel_replica_serves_what_one_gpu_serves(server, uploaded):
    from ray import serve
    from ray.util import placement_group_table

    from adapterserve.server.app import build_app

    config = copy.deepcopy(server.config)
    config.update(app_name=APP, encoder=False, encoder_pinned_adapters=[])
    config["engine"] = {**config["engine"], "tensor_parallel_size": 2}
    config["replica"] = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1}}
    config["metrics"] = {"http_route": "off", "push_interval_s": 0.25, "port": None}
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}", blocking=False)
    try:
        base = f"{server.http}/{APP}"
        models = ("sql", Path(server.config["model"]).name)  # the base: its directory's name
        texts = {model: _complete(base, model) for model in models}
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert any(len(g["bundles"]) == 2 and g["strategy"] == "STRICT_PACK" for g in groups), groups
    finally:
        serve.delete(APP)
    assert texts == {model: _complete(server.http, model) for model in models}
    assert len(set(texts.values())) == 2, "the adapter changed nothing: a vacuous check"
