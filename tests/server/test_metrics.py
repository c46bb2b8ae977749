"""Metrics of the live test server: scrapes of GET /metrics (the public view) and of the metrics
port (every series) after traffic on several adapters, over gRPC and HTTP.

Counts are compared as differences between a scrape before and one after the traffic (other
tests share the server). The Ingress sends its own counts to the hub before a scrape
answers, so its series are exact at once; the engine replica reports every 0.25 s here, so
engine series are awaited (there is no event to wait for).
"""
from __future__ import annotations

import time
from collections import Counter

import pytest
import requests

from adapterserve.server.metrics.series import BASE, OTHER, exported_names
from tests.helpers.live_server import ALICE, MAX_RUNNING, METRICS_ADAPTER_LABELS, NUM_KV_BLOCKS
from tests.helpers.scrape import Scrape, scrape

GRPC_PLAN = {"sql": 3, "chat": 2, "poem": 2, None: 2}  # adapter (None: the backbone) -> calls
SPECIAL = {BASE, OTHER, ""}
MODEL = "tiny-llama"  # the live server's backbone id (its directory's name)


def _public(server) -> Scrape:
    return scrape(f"{server.http}/metrics")


def _full(server) -> Scrape:
    return scrape(server.metrics)


def _scrapes(server) -> tuple[Scrape, Scrape]:
    """(full, public): the public one first, which sends the Ingress's counts to the hub at once."""
    public = _public(server)
    return _full(server), public


@pytest.fixture(scope="module")
def traffic(server, uploaded):
    """Scrapes before and after: gRPC generations per GRPC_PLAN, two HTTP completions (sql, the
    backbone) and one SSE chat stream (chat); what the clients received, per adapter."""
    from adapterserve.clients.client import Client

    with Client(server.grpc, api_key=ALICE, timeout=120) as alice:
        return _traffic(server, alice)


def _traffic(server, alice):
    before = _settled(server)
    sent: Counter = Counter()
    tokens: Counter = Counter()
    prompt: Counter = Counter()
    for adapter, calls in GRPC_PLAN.items():
        for i in range(calls):
            result = alice.generate(f"metrics {i}", adapter=adapter, max_tokens=3 + i, temperature=0.0)
            sent[adapter] += 1
            tokens[adapter] += len(result.token_ids)
            prompt[adapter] += result.prompt_tokens
    for adapter, model in (("sql", "sql"), (None, MODEL)):
        body = _post(server, "/v1/completions", {"model": model, "prompt": "metrics http", "max_tokens": 4})
        sent[adapter] += 1
        tokens[adapter] += body["usage"]["completion_tokens"]
        prompt[adapter] += body["usage"]["prompt_tokens"]
    events = _sse(server, {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                           "stream": True, "stream_options": {"include_usage": True}})
    usage = next(e["usage"] for e in events if e.get("usage"))
    sent["chat"] += 1
    tokens["chat"] += usage["completion_tokens"]
    prompt["chat"] += usage["prompt_tokens"]
    return before, _scrapes(server), sent, tokens, prompt


def _settled(server) -> tuple[Scrape, Scrape]:
    """Scrapes once the engine has reported all the work done so far (its count of requests
    scheduled stops moving over more than two of its reports)."""
    deadline, last = time.monotonic() + 60, None
    while True:
        full = _full(server)
        scheduled = full.total("adapterserve_request_queue_seconds_count")
        if scheduled == last:
            return _scrapes(server)
        assert time.monotonic() < deadline, "the engine's counts never settled"
        last = scheduled
        time.sleep(0.6)


def _post(server, path: str, body: dict) -> dict:
    reply = requests.post(f"{server.http}{path}", json=body, headers={"Authorization": f"Bearer {ALICE}"}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _sse(server, body: dict) -> list[dict]:
    import json

    reply = requests.post(f"{server.http}/v1/chat/completions", json=body, stream=True, timeout=120,
                          headers={"Authorization": f"Bearer {ALICE}"})
    assert reply.status_code == 200, reply.text
    lines = [line[len(b"data: "):] for line in reply.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _named(full: Scrape) -> set[str]:
    return full.label_values("adapterserve_requests_total", "adapter") - SPECIAL


def _label(full: Scrape, adapter: str | None) -> str:
    if adapter is None:
        return BASE
    return adapter if adapter in _named(full) else OTHER


def _calls(after: Scrape, before: Scrape, label: str) -> float:
    """Successful generation calls (gRPC and HTTP) under adapter label `label`."""
    return sum(after.minus(before, "adapterserve_requests_total", method=m, code="OK", adapter=label)
               for m in ("Generate", "completions", "chat_completions"))


def test_requests_are_counted_per_adapter_name_exactly(traffic):
    (full0, _), (full1, _), sent, _, _ = traffic
    expected: Counter = Counter()
    for adapter, calls in sent.items():
        expected[_label(full1, adapter)] += calls
    for label, calls in expected.items():
        assert _calls(full1, full0, label) == calls, label
    assert _named(full1), "the first adapters used in the session keep their names"


def test_tokens_and_latency_histograms_count_every_generation(traffic):
    (full0, _), (full1, _), sent, tokens, prompt = traffic
    by_label: dict[str, Counter] = {}
    for adapter in sent:
        counts = by_label.setdefault(_label(full1, adapter), Counter())
        counts.update(calls=sent[adapter], tokens=tokens[adapter], prompt=prompt[adapter])
    for label, counts in by_label.items():
        assert full1.minus(full0, "adapterserve_generated_tokens_total", adapter=label) == counts["tokens"], label
        assert full1.minus(full0, "adapterserve_prompt_tokens_total", adapter=label) == counts["prompt"], label
        ttft = full1.minus(full0, "adapterserve_time_to_first_token_seconds_count", adapter=label)
        assert ttft == counts["calls"], label
        latency = full1.minus(full0, "adapterserve_request_seconds_count", adapter=label)
        assert latency == counts["calls"], label
    tpot = full1.minus(full0, "adapterserve_time_per_output_token_seconds_count")
    assert 0 < tpot <= sum(sent.values())  # calls with two tokens or more


def test_tenant_series_count_alices_calls(traffic):
    (full0, public0), (full1, public1), sent, tokens, _ = traffic
    assert full1.minus(full0, "adapterserve_tenant_requests_total", tenant="alice", code="OK") == sum(sent.values())
    assert full1.minus(full0, "adapterserve_tenant_generated_tokens_total", tenant="alice") == sum(tokens.values())
    assert not any(name.startswith("adapterserve_tenant_") for name in public1.names())


def test_the_public_view_names_no_private_adapter_and_has_the_same_totals(traffic):
    (full0, public0), (full1, public1), sent, _, _ = traffic
    shown = public1.label_values("adapterserve_requests_total", "adapter")
    assert not shown & {"sql", "chat", "poem"}, "alice's adapters are private"
    private = sum(calls for adapter, calls in sent.items() if adapter is not None)
    assert _calls(public1, public0, OTHER) == private
    assert _calls(public1, public0, BASE) == sent[None]
    for name in ("adapterserve_requests_total", "adapterserve_generated_tokens_total"):
        assert public1.minus(public0, name) == full1.minus(full0, name)


def test_the_adapter_label_names_at_most_n_adapters(traffic, server):
    (_, _), (full1, public1), _, _, _ = traffic
    assert len(_named(full1)) <= METRICS_ADAPTER_LABELS
    assert full1.total("adapterserve_requests_total", adapter=OTHER) > 0, "the session uses more adapters than N"
    for name in ("adapterserve_prompt_tokens_total", "adapterserve_time_to_first_token_seconds_count"):
        assert len(full1.label_values(name, "adapter") - SPECIAL) <= METRICS_ADAPTER_LABELS


def test_every_sample_is_a_documented_series(traffic):
    (_, _), (full1, public1), _, _, _ = traffic
    assert full1.names() <= exported_names()
    assert public1.names() <= exported_names()


def _engine_scrape(server, done) -> Scrape:
    deadline = time.monotonic() + 60
    while True:
        found = _full(server)
        if done(found):
            return found
        assert time.monotonic() < deadline, "the engine replica's report never arrived"
        time.sleep(0.25)


def test_engine_series_count_every_request_and_report_the_cache_and_slots(traffic, server):
    (full0, _), (_, _), sent, _, _ = traffic
    calls = sum(sent.values())
    queued = lambda s: s.minus(full0, "adapterserve_request_queue_seconds_count", backbone=MODEL)  # noqa: E731
    found = _engine_scrape(server, lambda s: queued(s) >= calls)
    assert queued(found) == calls, "each request leaves the engine's queue once"
    assert found.minus(full0, "adapterserve_engine_step_seconds_count", backbone=MODEL) > 0
    assert found.total("adapterserve_engine_batch_requests_bucket", backbone=MODEL, le="+Inf") > 0
    assert found.total("adapterserve_kv_cache_blocks", backbone=MODEL) == NUM_KV_BLOCKS
    assert 0 <= found.total("adapterserve_kv_cache_usage_ratio", backbone=MODEL) <= 1
    assert found.total("adapterserve_adapter_slots", backbone=MODEL) == 4
    assert 1 <= found.total("adapterserve_adapter_slots_used", backbone=MODEL) <= 4
    assert found.total("adapterserve_adapter_slot_loads_total", backbone=MODEL) >= 1
    assert found.total("adapterserve_adapter_loads_total", backbone=MODEL) >= 3
    assert found.total("adapterserve_adapter_load_seconds_count", backbone=MODEL) >= 3
    assert found.total("adapterserve_adapter_cache_lookups_total", backbone=MODEL, tier="engine", result="hit") > 0
    assert found.total("adapterserve_running_requests", backbone=MODEL) <= MAX_RUNNING
    assert found.total("adapterserve_metrics_reporters", role="model") == 1
    assert found.total("adapterserve_metrics_reporters", role="encoder") == 1
    assert found.total("adapterserve_adapter_slots_pinned", backbone="all-MiniLM-L6-v2") == 1  # sentiment


def test_the_gateway_gauges_use_vllms_names(traffic, server, uploaded):
    found = _engine_scrape(server, lambda s: s.total("vllm:lora_requests_info") > 0)
    (labels, when), = [(dict(ls), v) for (n, ls), v in found.samples.items() if n == "vllm:lora_requests_info"]
    assert labels["max_lora"] == "4"
    running = labels["running_lora_adapters"].split(",")
    assert {"chat", uploaded["chat"]} <= set(running), "the adapter used last, as name and as name@N"
    assert {a.partition("@")[0] for a in running} <= set(running)
    assert " " not in labels["running_lora_adapters"]
    assert abs(when - time.time()) < 60
    assert found.total("vllm:num_requests_waiting", model_name=MODEL) >= 0
    assert 0 <= found.total("vllm:kv_cache_usage_perc") == found.total("vllm:gpu_cache_usage_perc") <= 1
    assert found.total("vllm:cache_config_info", num_gpu_blocks=str(NUM_KV_BLOCKS), block_size="16") == 1
    public = _public(server)
    (shown,) = [dict(ls) for (n, ls), _ in public.samples.items() if n == "vllm:lora_requests_info"]
    assert not set(shown["running_lora_adapters"].split(",")) & {"sql", "chat", "poem"}



