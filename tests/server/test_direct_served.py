"""Direct mode served (server/direct.py): an application on the session's Serve with the live
server's settings but `direct: auto` and one generation replica, so the Ingress's replica runs
the generation engine itself (no EngineReplica deployment). It answers gRPC on its replica's own
port (where HAProxy forwards) and HTTP under its own route prefix: Generate streams the tokens
of PEFT + transformers and of the two-tier session server, Classify goes to the encoder's own
deployment, an upload is validated and served at once, health covers both engines, a
stream the caller leaves is aborted in the engine, a trace has every hop, and the engine
reports to the application's metrics hub. The application is deleted at the end
(gRPC clients of the session's server need Serve to hold one application).
"""
from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapterserve.server import serve_env
from tests.helpers.live_server import ALICE, NUM_KV_BLOCKS

pytestmark = pytest.mark.skipif(not serve_env.haproxy_ingress(),
                                reason="no HAProxy here: the replica's own gRPC port is HAProxy's target")
APP = "direct"
PROMPT = "To make bread you need"


@pytest.fixture(scope="module")
def direct(server, uploaded) -> Iterator[tuple[str, str]]:
    """(gRPC address of the app's Ingress replica, its HTTP base URL)."""
    from ray import serve

    from adapterserve.server.app import build_app

    config = copy.deepcopy(server.config)
    config.update(app_name=APP, direct="auto")  # one generation replica: direct
    config["replica"] = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1}}
    config["encoder_replica"] = {"ray_actor_options": {"num_cpus": 0.1}}
    config["metrics"] = {"http_route": "off", "push_interval_s": 0.25, "port": None}
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}", blocking=False)
    try:
        yield _grpc_target(), f"{server.http}/{APP}"
    finally:
        serve.delete(APP)


def _grpc_target() -> str:
    """host:port of the app's Ingress replica, once HAProxy is told of it (within 300 s)."""
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    deadline = time.monotonic() + 300
    while True:
        groups = ray.get(controller.get_target_groups.remote(from_proxy_manager=True))
        found = [g for g in groups if g.app_name == APP and g.protocol == RequestProtocol.GRPC and g.targets]
        if found:
            return f"127.0.0.1:{found[0].targets[0].port}"
        assert time.monotonic() < deadline, "the direct application's Ingress never became a target"
        time.sleep(0.5)


@pytest.fixture
def client(direct):
    from adapterserve.clients.client import Client

    with Client(direct[0], api_key=ALICE, timeout=120) as client:
        yield client


def test_the_app_has_no_engine_deployment(direct):
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    assert sorted(deployments) == ["EncoderReplica", "Ingress", "MetricsHub"]


def test_generate_streams_the_tokens_of_peft_and_of_the_two_tier_server(client, server, reference):
    chunks = list(client.stream(PROMPT, adapter="chat", max_tokens=12, temperature=0.0))
    assert len(chunks) > 1 and chunks[0].adapter.startswith("chat@")
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference("chat", PROMPT, 12)[0]
    base = client.generate(PROMPT, max_tokens=8, temperature=0.0)
    assert base.token_ids == reference(None, PROMPT, 8)[0]
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    texts = [requests.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {ALICE}"},
                           timeout=120).json()["choices"][0]["text"] for url in (f"{server.http}/{APP}", server.http)]
    assert texts[0] == texts[1] == client.generate(PROMPT, adapter="sql", max_tokens=10, temperature=0.0,
                                                   ignore_eos=True).text  # direct HTTP = two tiers = gRPC


def test_classify_goes_to_the_encoder_deployment(client):
    texts = ["what a wonderful, moving film", "a dull and boring mess", "I loved every minute"]
    assert [r.label for r in client.classify(texts, adapter="sentiment")] == ["positive", "negative", "positive"]


def test_an_uploaded_adapter_is_served_at_once(client, lora_dirs, reference):
    info = client.upload(lora_dirs["poem"], "direct-poem")
    out = client.generate(PROMPT, adapter=info.ref, max_tokens=8, temperature=0.0)
    assert out.adapter == info.ref and out.token_ids == reference("poem", PROMPT, 8)[0]


def test_health_reports_both_engines(direct, client):
    reply = requests.get(f"{direct[1]}/health", timeout=60)
    assert reply.status_code == 200
    assert reply.json()["deployments"] == {"EngineReplica": "ok", "EncoderReplica": "ok"}
    with grpc.insecure_channel(direct[0]) as channel:
        checked = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
    assert checked.status == health_pb2.HealthCheckResponse.SERVING


def test_a_stream_the_caller_leaves_is_aborted_in_the_engine(client):
    idle = _idle(client)
    stream = client.stream(PROMPT, adapter="sql", max_tokens=400, temperature=0.0, ignore_eos=True)
    for _, _chunk in zip(range(3), stream):
        pass
    assert client.server_info().running_requests == 1
    stream.close()  # cancels the gRPC call
    after = _idle(client)
    assert after.cancelled_requests == idle.cancelled_requests + 1  # stopped, not run to its end


def _idle(client):
    deadline = time.monotonic() + 120
    while (info := client.server_info()).free_kv_blocks != NUM_KV_BLOCKS or info.running_requests:
        assert time.monotonic() < deadline, f"the engine never went idle: {info}"
        time.sleep(0.2)
    return info


def test_a_generate_trace_has_every_hop_with_its_parent(direct, uploaded, otlp_collector):
    from types import SimpleNamespace

    from tests.server.test_traces import GENERATE, GENERATE_HOPS, PARENTS, _assert_parents, _grpc_generate, _trace

    sent = _grpc_generate(SimpleNamespace(grpc=direct[0]), uploaded["sql"], [])
    spans = _trace(otlp_collector, sent, GENERATE_HOPS, GENERATE)
    _assert_parents(spans, PARENTS)  # the local call is the `replica` span, the replica's side its child
    assert spans["replica.generate"].resource["adapterserve.component"] == "model"
    assert spans["root"].attributes["gen_ai.usage.output_tokens"] == len(sent.tokens) == 6


def test_the_engine_reports_to_the_apps_metrics_hub(direct, client):
    from ray import serve

    client.generate(PROMPT, max_tokens=2, temperature=0.0)
    hub = serve.get_deployment_handle("MetricsHub", APP)
    deadline = time.monotonic() + 60
    while not (found := hub.by_replica.remote("model").result(timeout_s=60)) or \
            not all(v.get("adapterserve_request_queue_seconds_count", 0) > 0 for v in found.values()):
        assert time.monotonic() < deadline, f"no engine requests reported: {found}"
        time.sleep(0.25)
    assert len(found) == 1  # the one engine, in the Ingress replica
