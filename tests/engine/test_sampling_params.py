"""SamplingParams: every field type- and range-checked; what passes, the sampler can run."""
from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from adapterserve.engine.sampler import sample
from adapterserve.engine.sampling_params import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SEED_RANGE,
    SamplingParams,
)
from adapterserve.errors import RequestError

VOCAB = 50


def test_valid_values_keep_their_meaning():
    p = SamplingParams(max_tokens=7, temperature=0, top_k=5, top_p=0.5, seed=3, stop="x",
                       stop_token_ids=[2, 3], ignore_eos=True)
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (7, 0.0, 5, 0.5, 3)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.greedy) == (("x",), (2, 3), True, True)
    assert type(p.temperature) is float and type(p.top_p) is float
    assert SamplingParams(stop=["a", "b"], stop_token_ids=None, seed=None).stop == ("a", "b")
    assert SamplingParams() == SamplingParams(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0)


def test_numpy_numbers_count_as_numbers():
    p = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5), stop_token_ids=np.array([1, 2]).tolist())
    assert (p.max_tokens, type(p.max_tokens), p.temperature) == (4, int, 0.5)


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


BAD = [
    ({"max_tokens": 0}, "'max_tokens' must be between 1 and 2147483647, got 0"),
    ({"max_tokens": MAX_TOKENS + 1}, "'max_tokens' must be between 1"),
    ({"max_tokens": True}, "'max_tokens' must be an integer, got True"),
    ({"max_tokens": 3.0}, "'max_tokens' must be an integer, got 3.0"),
    ({"max_tokens": "5"}, "'max_tokens' must be an integer, got '5'"),
    ({"max_tokens": 10**5000}, "'max_tokens' must be between 1 and 2147483647, got an integer of 16610 bits"),
    ({"temperature": -1}, "'temperature' must be at least 0, got -1"),
    ({"temperature": math.nan}, "'temperature' must be a finite number, got nan"),
    ({"temperature": math.inf}, "'temperature' must be a finite number, got inf"),
    ({"temperature": 10**400}, "'temperature' must be a finite number"),
    ({"temperature": 1e-9}, "'temperature' must be 0 (greedy) or at least 1e-06, got 1e-09"),
    ({"temperature": "hot"}, "'temperature' must be a number, got 'hot'"),
    ({"temperature": False}, "'temperature' must be a number, got False"),
    ({"top_k": -2}, "'top_k' must be between -1 and 9223372036854775807, got -2"),
    ({"top_k": 10**30}, "'top_k' must be between -1 and 9223372036854775807, got 1000000000000000000000000000000"),
    ({"top_k": 1.5}, "'top_k' must be an integer, got 1.5"),
    ({"top_p": 0}, "'top_p' must be between 1e-09 and 1, got 0"),
    ({"top_p": 1.01}, "'top_p' must be between 1e-09 and 1, got 1.01"),
    ({"top_p": 1e-50}, "'top_p' must be between 1e-09 and 1"),
    ({"top_p": [0.5]}, "'top_p' must be a number, got [0.5]"),
    ({"seed": "1"}, "'seed' must be an integer, got '1'"),
    ({"seed": 1.0}, "'seed' must be an integer, got 1.0"),
    ({"seed": SEED_RANGE[1] + 1}, "'seed' must be between -9223372036854775808 and 18446744073709551615"),
    ({"seed": SEED_RANGE[0] - 1}, "'seed' must be between"),
    ({"stop": 5}, "'stop' must be a string or a list of strings, got 5"),
    ({"stop": [1]}, "'stop[0]' must be a string, got 1"),
    ({"stop": [["x"]]}, "'stop[0]' must be a string, got ['x']"),
    ({"stop": {"a": 1}}, "'stop' must be a string or a list of strings, got {'a': 1}"),
    ({"stop": ""}, "'stop' is empty"),
    ({"stop": ["a", ""]}, "'stop[1]' is empty"),
    ({"stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "'stop' has 17 items; at most 16 are allowed"),
    ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "'stop' has 257 characters; this server takes at most 256"),
    ({"stop_token_ids": [-1]}, "'stop_token_ids[0]' must be a token id (an integer from 0 to 2147483647), got -1"),
    ({"stop_token_ids": [1, True]}, "'stop_token_ids[1]' must be a token id"),
    ({"stop_token_ids": [2**31]}, "'stop_token_ids[0]' must be a token id"),
    ({"stop_token_ids": ["1"]}, "'stop_token_ids[0]' must be a token id"),
    ({"stop_token_ids": 5}, "'stop_token_ids' must be a list of token ids, got 5"),
    ({"stop_token_ids": [0] * (MAX_STOP_TOKEN_IDS + 1)}, "'stop_token_ids' has 257 items; at most 256"),
    ({"ignore_eos": 1}, "'ignore_eos' must be true or false, got 1"),
    ({"ignore_eos": "false"}, "'ignore_eos' must be true or false, got 'false'"),
]


@pytest.mark.parametrize("fields, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_values_are_refused_naming_field_and_value(fields, message):
    with pytest.raises(RequestError) as caught:
        SamplingParams(**fields)
    assert str(caught.value).startswith(message)


def test_a_long_bad_value_is_shown_short():
    with pytest.raises(RequestError) as caught:
        SamplingParams(stop=[["x" * 10_000]])
    assert len(str(caught.value)) < 120 and str(caught.value).endswith("...")


def test_seed_range_is_what_torch_generators_take():
    low, high = SEED_RANGE
    for seed in (low, -1, 0, high):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)
    for seed in (low - 1, high + 1):
        with pytest.raises((ValueError, RuntimeError, OverflowError)):
            torch.Generator().manual_seed(seed)


def test_survives_pickling_unchanged():
    p = SamplingParams(max_tokens=3, stop=["a"], stop_token_ids=[1], seed=-4)
    assert pickle.loads(pickle.dumps(p)) == p


def _draw(params: SamplingParams, logits: torch.Tensor) -> list[int]:
    gen = torch.Generator().manual_seed(7)
    return sample(logits, [params], [gen], torch.Generator().manual_seed(0)).tolist()


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 10


def test_the_largest_top_k_keeps_every_token(logits):
    for seed in range(5):
        row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed))
        assert _draw(SamplingParams(top_k=MAX_TOP_K), row) == _draw(SamplingParams(top_k=0), row)
    assert _draw(SamplingParams(top_k=VOCAB * 10), logits) == _draw(SamplingParams(top_k=0), logits)


def test_the_smallest_temperature_and_top_p_still_pick_the_top_token(logits):
    top = logits.argmax(dim=-1).tolist()
    assert _draw(SamplingParams(temperature=MIN_TEMPERATURE), logits) == top
    assert _draw(SamplingParams(temperature=1.0, top_p=MIN_TOP_P), logits) == top
