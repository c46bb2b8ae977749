"""OpenAI bodies of a generation of n choices, from the replica's chunks (each with its
choice's index; the first carries the prompt's counts): one choice per index, in index
order, each with its own text and finish_reason; usage counts the prompt once and every
choice's tokens; a stream's first delta of each choice carries the role."""
import asyncio
import json

from adapterserve.server.openai_chat import chat_body, parse_chat
from adapterserve.server.openai_chat import sse_events as chat_events
from adapterserve.server.openai_http import completion_body, parse_completion, sse_events

CHUNKS = [  # as a replica relays them: interleaved, choice 1 ending first
    {"request_id": "r", "token_ids": [5], "text": "a", "finish_reason": None, "index": 0, "prompt_tokens": 7,
     "cached_tokens": 4},
    {"request_id": "r", "token_ids": [6, 7], "text": "bc", "finish_reason": "stop", "index": 1},
    {"request_id": "r", "token_ids": [8], "text": "d", "finish_reason": None, "index": 2},
    {"request_id": "r", "token_ids": [9], "text": "e", "finish_reason": "length", "index": 0},
    {"request_id": "r", "token_ids": [3], "text": "f", "finish_reason": "length", "index": 2},
]


async def _chunks():
    for chunk in CHUNKS:
        yield chunk


def _events(events) -> list[dict]:
    async def collect():
        return [e async for e in events]

    lines = asyncio.run(collect())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_a_completion_of_n_choices():
    call = parse_completion({"model": "tiny", "prompt": "hi", "n": 3, "return_token_ids": True}, "tiny")
    body = completion_body(call, CHUNKS)
    assert [(c["index"], c["text"], c["token_ids"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ae", [5, 9], "length"), (1, "bc", [6, 7], "stop"), (2, "df", [8, 3], "length")]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 4}}


def test_a_chat_completion_of_n_choices():
    call = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 3}, "tiny")
    body = chat_body(call, CHUNKS, [1, 2, 3])
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ae", "length"), (1, "bc", "stop"), (2, "df", "length")]
    assert body["usage"]["completion_tokens"] == 6


def test_streamed_choices_keep_their_index_and_the_usage_counts_them_all():
    call = parse_completion({"model": "tiny", "prompt": "hi", "n": 3, "stream": True,
                             "stream_options": {"include_usage": True}}, "tiny")
    events = _events(sse_events(call, _chunks()))
    assert [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:-1]] == [
        (0, "a"), (1, "bc"), (2, "d"), (0, "e"), (2, "f")]
    assert events[-1]["usage"]["completion_tokens"] == 6 and events[-1]["usage"]["prompt_tokens"] == 7


def test_each_streamed_chat_choice_starts_with_the_role():
    call = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 3, "stream": True},
                      "tiny")
    deltas = [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in _events(chat_events(call, _chunks()))]
    assert deltas == [(0, {"role": "assistant", "content": "a"}), (1, {"role": "assistant", "content": "bc"}),
                      (2, {"role": "assistant", "content": "d"}), (0, {"content": "e"}), (2, {"content": "f"})]
