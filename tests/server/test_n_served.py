"""`n` > 1 through the live server: OpenAI /v1/completions and /v1/chat/completions (plain and
streamed) and gRPC Generate (the client's `n`). Each choice equals a request of its own with
the choice's seed (seed + index); the usage counts the prompt once and every choice's tokens;
every choice (and the admission and tenant quota) counts as a sequence; a chat that resends
the conversation finds the previous turn in the prefix cache."""
from __future__ import annotations

import json

import grpc
import pytest
import requests

from adapterserve.clients.client import Client, ClientError
from tests.helpers.live_server import ALICE, BUSY, BUSY_CONCURRENCY, CAROL_USE, MAX_RUNNING, run_cli

BASE = "tiny-llama"
PROMPT = "The lighthouse keeper counted the ships"
SAMPLED = {"max_tokens": 6, "temperature": 1.0, "seed": 41, "ignore_eos": True}
BLOCK = 16  # the live server's KV block


def _post(server, path: str, body: dict, key: str = ALICE) -> requests.Response:
    return requests.post(f"{server.http}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _completion(server, **fields) -> dict:
    reply = _post(server, "/v1/completions", {"model": BASE, "prompt": PROMPT, "return_token_ids": True,
                                               **SAMPLED, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _events(reply: requests.Response) -> list[dict]:
    lines = [line for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.fixture(scope="module")
def alone(server) -> list[list[int]]:
    """The token ids of three requests of their own, with the seeds choices 0, 1, 2 take."""
    return [_completion(server, seed=SAMPLED["seed"] + i)["choices"][0]["token_ids"] for i in range(3)]


def test_completions_with_n_give_each_choice_its_own_seed(server, alone):
    body = _completion(server, n=3)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in body["choices"]] == alone
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    usage, prompt_tokens = body["usage"], _completion(server)["usage"]["prompt_tokens"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens, 3 * SAMPLED["max_tokens"])
    assert usage["total_tokens"] == prompt_tokens + 3 * SAMPLED["max_tokens"]


def test_streamed_completions_carry_each_choices_index(server, alone):
    reply = _post(server, "/v1/completions", {"model": BASE, "prompt": PROMPT, "return_token_ids": True, "n": 3,
                                              "stream": True, "stream_options": {"include_usage": True}, **SAMPLED})
    assert reply.status_code == 200, reply.text
    events = _events(reply)
    chunks = [c for e in events for c in e["choices"]]
    tokens = {i: [t for c in chunks if c["index"] == i for t in c["token_ids"]] for i in range(3)}
    assert [tokens[i] for i in range(3)] == alone and {c["index"] for c in chunks} == {0, 1, 2}
    ends = sorted(c["index"] for c in chunks if c["finish_reason"] is not None)
    assert ends == [0, 1, 2]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3 * SAMPLED["max_tokens"]


def test_chat_with_n_plain_and_streamed(server):
    body = {"model": BASE, "messages": [{"role": "user", "content": "Name a ship."}], "n": 2, **SAMPLED}
    plain = _post(server, "/v1/chat/completions", body)
    assert plain.status_code == 200, plain.text
    choices = plain.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and all(c["message"]["role"] == "assistant" for c in choices)
    streamed = _post(server, "/v1/chat/completions", {**body, "stream": True})
    deltas = [c for e in _events(streamed) for c in e["choices"]]
    for i in range(2):
        mine = [c["delta"] for c in deltas if c["index"] == i]
        assert mine[0]["role"] == "assistant" and all("role" not in d for d in mine[1:])
        assert "".join(d["content"] for d in mine) == choices[i]["message"]["content"]


def test_null_n_is_one_choice(server):
    assert len(_completion(server, n=None)["choices"]) == 1


def test_grpc_generate_with_n(server, alone):
    with Client(server.grpc, api_key=ALICE, timeout=120) as client:
        done = client.generate(PROMPT, n=3, **SAMPLED)
        assert [c.index for c in done.choices] == [0, 1, 2] and done.index == 0
        assert [c.token_ids for c in done.choices] == alone and done.token_ids == alone[0]
        assert {c.finish_reason for c in done.choices} == {"length"}
        chunks = list(client.stream(PROMPT, n=2, **SAMPLED))
        assert {c.index for c in chunks} == {0, 1} and chunks[0].prompt_tokens == done.prompt_tokens
        with pytest.raises(ClientError) as refused:
            client.generate(PROMPT, n=MAX_RUNNING + 1, **SAMPLED)
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert f"'n' is {MAX_RUNNING + 1}, but this engine runs at most {MAX_RUNNING} sequences" in str(refused.value)


def test_cli_generate_with_n(server, alone):
    common = ["generate", PROMPT, "--n", "2", "--seed", "41", "--temperature", "1", "--max-tokens", "6",
              "--ignore-eos", "--server", server.grpc, "--api-key", ALICE]
    status, out, err = run_cli(*common, "--json")
    assert status == 0, err
    choices = json.loads(out)["choices"]
    assert [c["token_ids"] for c in choices] == alone[:2] and [c["index"] for c in choices] == [0, 1]
    status, out, err = run_cli(*common)
    assert status == 0 and out.splitlines() == [c["text"] for c in choices]


def test_each_choice_counts_against_the_tenants_concurrent_requests(server):
    fits = _post(server, "/v1/completions", {"model": BASE, "prompt": PROMPT, "n": BUSY_CONCURRENCY, **SAMPLED},
                 key=BUSY)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == BUSY_CONCURRENCY
    over = _post(server, "/v1/completions", {"model": BASE, "prompt": PROMPT, "n": BUSY_CONCURRENCY + 1,
                                             **SAMPLED}, key=BUSY)
    says = f"'n' is {BUSY_CONCURRENCY + 1}, but tenant busy may run {BUSY_CONCURRENCY}"
    assert over.status_code == 400 and says in over.json()["error"]["message"]
    with Client(server.grpc, api_key=BUSY, timeout=120) as client, pytest.raises(ClientError) as refused:
        client.generate(PROMPT, n=BUSY_CONCURRENCY + 1, **SAMPLED)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT and "concurrent_requests" in refused.value.details


def test_the_tenants_tokens_count_the_prompt_once_and_every_choice(server):
    with Client(server.grpc, api_key=CAROL_USE, timeout=120) as client:
        before = client.listing().usage.tokens_last_minute
        done = client.generate(PROMPT, n=3, **SAMPLED)
        after = client.listing().usage.tokens_last_minute
    assert after - before == done.prompt_tokens + 3 * SAMPLED["max_tokens"]


def test_a_resent_conversation_finds_the_previous_turn_cached(server):
    """Turn 2 resends turn 1 and its answer: at least every full block of turn 1's prompt is cached."""
    messages = [{"role": "system", "content": "You keep a lighthouse on a rock far out at sea. " * 4},
                {"role": "user", "content": "How many ships passed tonight?"}]
    greedy = {"model": BASE, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    first = _post(server, "/v1/chat/completions", {**greedy, "messages": messages}).json()
    answer = first["choices"][0]["message"]["content"]
    resent = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And yesterday?"}]
    second = _post(server, "/v1/chat/completions", {**greedy, "messages": resent}).json()
    turn_one = len(first["prompt_token_ids"])
    assert second["prompt_token_ids"][:turn_one] == first["prompt_token_ids"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= turn_one // BLOCK * BLOCK > 0 and cached % BLOCK == 0
