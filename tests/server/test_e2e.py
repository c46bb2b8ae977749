"""End to end on CPU: real Ray Serve, real gRPC on loopback. Three PEFT LoRA adapters
uploaded with the CLI; concurrent generation over all three plus the base model
returns exactly the greedy tokens of PEFT + transformers run one request at a time,
through the async client, the sync client, the CLI and the HTTP route."""
from __future__ import annotations

import asyncio
import json

import grpc
import requests

from adapterserve.clients.types import ClientError
from tests.helpers.live_server import ADAPTERS, ALICE, run_cli

PROMPTS = ["The lighthouse keeper", "To make bread you need", "A server that answers many questions"]
MAX_TOKENS = 12
TARGETS = [None, *ADAPTERS]  # None = base model


def test_cli_upload_prints_name_at_version(uploaded, alice):
    assert uploaded == {name: f"{name}@1" for name in ADAPTERS}
    listed = {a.ref: a for a in alice.list_adapters()}
    assert set(uploaded.values()) <= set(listed)
    chat = listed["chat@1"]
    assert (chat.kind, chat.rank, chat.tenant, chat.public) == ("lora", 8, "alice", False)
    assert set(chat.target_modules) == set(ADAPTERS["chat"]["target_modules"])


def test_concurrent_generate_matches_peft(server, uploaded, reference):
    from adapterserve.clients.client import AsyncClient

    jobs = [(adapter, prompt) for adapter in TARGETS for prompt in PROMPTS[:1]]

    async def generate(client, prompt, adapter):
        # the replica admits MAX_ONGOING + MAX_QUEUED at once; a request arriving while the
        # previous test's work drains is told to retry later, as any client would be
        for attempt in range(20):
            try:
                return await client.generate(prompt, adapter=adapter, max_tokens=MAX_TOKENS, temperature=0.0)
            except ClientError as error:
                if error.code is not grpc.StatusCode.RESOURCE_EXHAUSTED or attempt == 19:
                    raise
                await asyncio.sleep(0.5)

    async def run_all():
        async with AsyncClient(server.grpc, api_key=ALICE, timeout=120) as client:
            return await asyncio.gather(*[generate(client, prompt, adapter) for adapter, prompt in jobs])

    results = asyncio.run(run_all())
    outputs = set()
    for (adapter, prompt), got in zip(jobs, results):
        tokens, text = reference(adapter, prompt, MAX_TOKENS)
        assert got.token_ids == tokens, adapter
        assert got.text == text, adapter
        assert got.adapter == (uploaded[adapter] if adapter else "")
        assert got.finish_reason in ("stop", "length")
        outputs.add(tuple(got.token_ids))
    assert len(outputs) == len(jobs), "adapters must change the output, else this test proves nothing"


def test_sync_client_streams_the_same_tokens(alice, uploaded, reference):
    for adapter in TARGETS:
        prompt = PROMPTS[1]
        chunks = list(alice.stream(prompt, adapter=adapter, max_tokens=MAX_TOKENS, temperature=0.0))
        assert len(chunks) > 1, "tokens arrive as a stream"
        assert [t for c in chunks for t in c.token_ids] == reference(adapter, prompt, MAX_TOKENS)[0]
        assert chunks[-1].finish_reason and not any(c.finish_reason for c in chunks[:-1])
        assert chunks[0].prompt_tokens > 0


def test_token_id_prompts_match_text_prompts(alice, uploaded, tiny_model):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model)(PROMPTS[2]).input_ids
    by_text = alice.generate(PROMPTS[2], adapter="poem", max_tokens=8, temperature=0.0)
    by_ids = alice.generate(ids, adapter="poem@1", max_tokens=8, temperature=0.0)
    assert by_ids.token_ids == by_text.token_ids
    assert by_ids.prompt_tokens == len(ids)


def test_cli_generate_json_matches_peft(server, uploaded, reference):
    for adapter in TARGETS:
        argv = ["generate", "--server", server.grpc, "--api-key", ALICE, "--max-tokens", str(MAX_TOKENS),
                "--temperature", "0", "--json", PROMPTS[0]]
        if adapter:
            argv[1:1] = ["--adapter", adapter]
        status, out, err = run_cli(*argv)
        assert status == 0, err
        got = json.loads(out)
        tokens, text = reference(adapter, PROMPTS[0], MAX_TOKENS)
        assert (got["token_ids"], got["text"]) == (tokens, text)
        assert got["finish_reason"] in ("stop", "length")


def test_cli_generate_streams_text(server, uploaded, reference):
    status, out, err = run_cli("generate", "--server", server.grpc, "--api-key", ALICE, "--adapter", "sql",
                               "--max-tokens", str(MAX_TOKENS), "--temperature", "0", PROMPTS[1])
    assert status == 0, err
    assert out == reference("sql", PROMPTS[1], MAX_TOKENS)[1] + "\n"


def test_http_completions_match_peft(server, alice, uploaded, reference):
    headers = {"Authorization": f"Bearer {ALICE}"}
    base_id = alice.server_info().backbone_id
    for adapter in TARGETS:
        body = {"model": adapter or base_id, "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True}
        reply = requests.post(f"{server.http}/v1/completions", json=body, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        tokens, text = reference(adapter, PROMPTS[2], MAX_TOKENS)
        assert (choice["token_ids"], choice["text"]) == (tokens, text)
        assert reply.json()["usage"]["completion_tokens"] == len(tokens)


def test_http_completions_stream_sse(server, uploaded, reference):
    body = {"model": "chat@1", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    reply = requests.post(f"{server.http}/v1/completions", json=body, stream=True, timeout=120,
                          headers={"Authorization": f"Bearer {ALICE}"})
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in reply.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    pieces = [e["choices"][0] for e in events if e["choices"]]
    tokens, text = reference("chat", PROMPTS[0], MAX_TOKENS)
    assert [t for p in pieces for t in p["token_ids"]] == tokens
    assert "".join(p["text"] for p in pieces) == text
    assert pieces[-1]["finish_reason"] in ("stop", "length")
    assert events[-1]["usage"]["completion_tokens"] == len(tokens)


def test_http_models_lists_base_and_adapters(server, alice, uploaded):
    reply = requests.get(f"{server.http}/v1/models", headers={"Authorization": f"Bearer {ALICE}"}, timeout=60)
    assert reply.status_code == 200
    ids = [m["id"] for m in reply.json()["data"]]
    assert ids[0] == alice.server_info().backbone_id == "tiny-llama"
    assert set(uploaded.values()) <= set(ids)
