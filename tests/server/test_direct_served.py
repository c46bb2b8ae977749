"""Direct mode served (server/direct.py): an application on the session's Serve with the live
server's settings but `direct: auto` and one generation replica, so the Ingress's replica runs
the generation engine itself (no EngineReplica deployment). It answers gRPC on its replica's own
port (where HAProxy forwards) and HTTP under its own route prefix: Generate streams the tokens
of PEFT + transformers and of the two-tier session server, Classify goes to the encoder's own
deployment, an upload is validated and served at once, health covers both engines, a
stream the caller leaves is aborted in the engine, a trace has every hop, and the engine
reports to the application's metrics hub. The replica also has its own gRPC listener
(setting `replica_grpc`): every gRPC test runs through Serve's replica port and through it,
with the same results. The application is deleted at the end (gRPC clients of the session's
server need Serve to hold one application).
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapterserve.server import serve_env
from adapterserve.server.ports import free_port
from tests.helpers.direct_app import DirectApp, direct_app
from tests.helpers.live_server import ALICE, NUM_KV_BLOCKS

pytestmark = pytest.mark.skipif(not serve_env.haproxy_ingress(),
                                reason="no HAProxy here: the replica's own gRPC port is HAProxy's target")
APP = "direct"
PROMPT = "To make bread you need"


@pytest.fixture(scope="module")
def direct(server, uploaded) -> Iterator[DirectApp]:
    with direct_app(server, APP, replica_grpc={"port": free_port()}) as app:
        yield app


@pytest.fixture(params=["replica port", "own listener"])
def door(request, direct) -> str:
    """host:port of a gRPC door of the app's replica: Serve's port, or the replica's own listener."""
    return direct.replica_port if request.param == "replica port" else direct.own


@pytest.fixture
def client(door):
    from adapterserve.clients.client import Client

    with Client(door, api_key=ALICE, timeout=120) as client:
        yield client


def test_the_app_has_no_engine_deployment(direct):
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    assert sorted(deployments) == ["EncoderReplica", "Ingress", "MetricsHub"]


def test_generate_streams_the_tokens_of_peft_and_of_the_two_tier_server(client, server, direct, reference):
    chunks = list(client.stream(PROMPT, adapter="chat", max_tokens=12, temperature=0.0))
    assert len(chunks) > 1 and chunks[0].adapter.startswith("chat@")
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference("chat", PROMPT, 12)[0]
    base = client.generate(PROMPT, max_tokens=8, temperature=0.0)
    assert base.token_ids == reference(None, PROMPT, 8)[0]
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    texts = [requests.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {ALICE}"},
                           timeout=120).json()["choices"][0]["text"] for url in (direct.http, server.http)]
    assert texts[0] == texts[1] == client.generate(PROMPT, adapter="sql", max_tokens=10, temperature=0.0,
                                                   ignore_eos=True).text  # direct HTTP = two tiers = gRPC


def test_classify_goes_to_the_encoder_deployment(client):
    texts = ["what a wonderful, moving film", "a dull and boring mess", "I loved every minute"]
    assert [r.label for r in client.classify(texts, adapter="sentiment")] == ["positive", "negative", "positive"]


def test_an_uploaded_adapter_is_served_at_once(client, lora_dirs, reference):
    info = client.upload(lora_dirs["poem"], "direct-poem")
    out = client.generate(PROMPT, adapter=info.ref, max_tokens=8, temperature=0.0)
    assert out.adapter == info.ref and out.token_ids == reference("poem", PROMPT, 8)[0]


def test_health_reports_both_engines(direct, door):
    reply = requests.get(f"{direct.http}/health", timeout=60)
    assert reply.status_code == 200
    assert reply.json()["deployments"] == {"EngineReplica": "ok", "EncoderReplica": "ok"}
    with grpc.insecure_channel(door) as channel:
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


def test_a_generate_trace_has_every_hop_with_its_parent(door, uploaded, otlp_collector):
    from types import SimpleNamespace

    from tests.server.test_traces import GENERATE, GENERATE_HOPS, PARENTS, _assert_parents, _grpc_generate, _trace

    sent = _grpc_generate(SimpleNamespace(grpc=door), uploaded["sql"], [])
    spans = _trace(otlp_collector, sent, GENERATE_HOPS, GENERATE)
    _assert_parents(spans, PARENTS)  # the local call is the `replica` span, the replica's side its child
    assert spans["replica.generate"].resource["adapterserve.component"] == "model"
    assert spans["root"].attributes["gen_ai.usage.output_tokens"] == len(sent.tokens) == 6


def test_the_engine_reports_to_the_apps_metrics_hub(client):
    from ray import serve

    client.generate(PROMPT, max_tokens=2, temperature=0.0)
    hub = serve.get_deployment_handle("MetricsHub", APP)
    deadline = time.monotonic() + 60
    while not (found := hub.by_replica.remote("model").result(timeout_s=60)) or \
            not all(v.get("adapterserve_request_queue_seconds_count", 0) > 0 for v in found.values()):
        assert time.monotonic() < deadline, f"no engine requests reported: {found}"
        time.sleep(0.25)
    assert len(found) == 1  # the one engine, in the Ingress replica


def test_both_doors_answer_alike(direct):
    """Generate, Classify, Embed, ListAdapters, GetAdapter and ServerInfo: through the replica's own
    listener as through Serve's replica port."""
    from adapterserve.clients.client import Client

    def answers(door: str) -> tuple:
        with Client(door, api_key=ALICE, timeout=120) as client:
            completion = client.generate(PROMPT, adapter="sql", max_tokens=8, temperature=0.0, ignore_eos=True)
            labels = [(r.label, r.probabilities) for r in client.classify(["a wonderful film"], adapter="sentiment")]
            listed = sorted(a.ref for a in client.list_adapters())
            info = client.server_info()
            return (completion.token_ids, completion.text, completion.finish_reason, labels,
                    client.embed(["bread and butter"]), listed, client.get_adapter("sql").ref,
                    (info.backbone_id, info.max_model_len, info.vocab_size))

    assert answers(direct.own) == answers(direct.replica_port)
