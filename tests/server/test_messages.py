"""gRPC messages -> the engine's types: every field checked, the message naming it."""
from __future__ import annotations

import math

import numpy
import pytest

from adapterserve.errors import RequestError, RequestTooLarge
from adapterserve.proto import adapterserve_pb2 as pb
from adapterserve.request_fields import (
    MAX_PROMPT_CHARS,
    MAX_PROMPT_IDS,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
    token_ids,
)
from adapterserve.server import messages
from adapterserve.server.messages import prompt_of, sampling_of, texts_of


def test_unset_fields_keep_the_defaults_and_set_ones_are_kept():
    assert sampling_of(pb.SamplingParams()) == sampling_of(pb.SamplingParams(top_k=0, ignore_eos=False))
    p = sampling_of(pb.SamplingParams(max_tokens=5, temperature=0.0, top_k=2**32 - 1, seed=-3, stop=["x"],
                                      stop_token_ids=[4]))
    assert (p.max_tokens, p.greedy, p.top_k, p.seed, p.stop, p.stop_token_ids) == (5, True, 2**32 - 1, -3, ("x",),
                                                                                   (4,))
    assert prompt_of(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 7]))) == [0, 7]
    assert prompt_of(pb.GenerateRequest(text="hi")) == "hi"


@pytest.mark.parametrize("sampling, message", [
    (pb.SamplingParams(temperature=math.nan), "'temperature' must be a finite number, got nan"),
    (pb.SamplingParams(top_p=math.inf), "'top_p' must be a finite number, got inf"),
    (pb.SamplingParams(max_tokens=2**32 - 1), "'max_tokens' must be between 1 and 2147483647, got 4294967295"),
    (pb.SamplingParams(stop=["a", ""]), "'stop[1]' is empty"),
    (pb.SamplingParams(stop_token_ids=[1, -2]), "'stop_token_ids[1]' must be a token id"),
])
def test_bad_sampling_fields_are_named(sampling, message):
    with pytest.raises(RequestError) as caught:
        sampling_of(sampling)
    assert str(caught.value).startswith(message)


def test_a_sampling_message_seen_before_gives_its_checked_params_back():
    message = pb.SamplingParams(max_tokens=7, temperature=0.5, seed=11, stop=["end"])
    first = sampling_of(message)
    assert sampling_of(pb.SamplingParams(max_tokens=7, temperature=0.5, seed=11, stop=["end"])) is first
    other = sampling_of(pb.SamplingParams(max_tokens=7, temperature=0.5, seed=12, stop=["end"]))
    assert other is not first and (other.seed, first.seed) == (12, 11)
    # set to its default value is not unset: a field given explicitly is another message, the same params
    assert sampling_of(pb.SamplingParams(temperature=1.0)) == sampling_of(pb.SamplingParams())


def test_a_bad_sampling_message_is_refused_every_time_and_never_remembered():
    bad = pb.SamplingParams(temperature=math.nan)
    for _ in range(3):
        with pytest.raises(RequestError, match="'temperature' must be a finite number, got nan"):
            sampling_of(bad)
    assert bad.SerializeToString(deterministic=True) not in messages._recent_sampling


def test_remembered_sampling_messages_are_bounded_and_large_ones_are_not_kept():
    for seed in range(messages.RECENT_SAMPLINGS + 50):
        assert sampling_of(pb.SamplingParams(seed=seed)).seed == seed
    assert len(messages._recent_sampling) == messages.RECENT_SAMPLINGS
    large = pb.SamplingParams(stop=["x" * 200] * 3)
    assert sampling_of(large).stop == ("x" * 200,) * 3
    assert large.SerializeToString(deterministic=True) not in messages._recent_sampling


@pytest.mark.parametrize("request_, error, message", [
    (pb.GenerateRequest(), RequestError, "set the prompt: either text or token_ids"),
    (pb.GenerateRequest(text=""), RequestError, "'text' is empty"),
    (pb.GenerateRequest(text="x" * (MAX_PROMPT_CHARS + 1)), RequestTooLarge,
     f"'text' has {MAX_PROMPT_CHARS + 1} characters; this server takes at most {MAX_PROMPT_CHARS}"),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), RequestError, "'token_ids' is empty"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, -1])), RequestError, "'token_ids[1]' must be a token id"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * (MAX_PROMPT_IDS + 1))), RequestTooLarge,
     f"'token_ids' has {MAX_PROMPT_IDS + 1} items"),
])
def test_bad_prompts_are_named(request_, error, message):
    with pytest.raises(RequestError) as caught:
        prompt_of(request_)
    assert type(caught.value) is error and str(caught.value).startswith(message)


def test_token_ids_are_checked_whatever_their_integer_type_and_the_first_bad_one_is_named():
    long = list(range(1000))
    assert token_ids("ids", long, MAX_PROMPT_IDS) == tuple(long)
    as_numpy = token_ids("ids", [numpy.int64(3), numpy.int32(4)], MAX_PROMPT_IDS)
    assert as_numpy == (3, 4) and all(type(t) is int for t in as_numpy)
    for bad, position in (([*long, MAX_TOKEN_ID + 1], 1000), ([*long[:500], -1, *long], 500),
                          ([1, True, 2], 1), ([1, 2.0], 1)):
        with pytest.raises(RequestError, match=rf"'ids\[{position}\]' must be a token id"):
            token_ids("ids", bad, MAX_PROMPT_IDS)


@pytest.mark.parametrize("texts, error, message", [
    ([], RequestError, "texts is empty"),
    (["a"] * 5, RequestError, "5 texts in one call; this server takes at most 4"),
    (["a", ""], RequestError, "'texts[1]' is empty"),
    (["a", "b" * (MAX_TEXT_CHARS + 1)], RequestTooLarge, f"'texts[1]' has {MAX_TEXT_CHARS + 1} characters"),
])
def test_bad_texts_are_named(texts, error, message):
    with pytest.raises(RequestError) as caught:
        texts_of(pb.ClassifyRequest(texts=texts).texts, limit=4)
    assert type(caught.value) is error and str(caught.value).startswith(message)
    assert texts_of(pb.ClassifyRequest(texts=["a", "b"]).texts, limit=4) == ["a", "b"]
