"""Hostile server settings: every count, byte budget, timeout and TTL refuses a value of the
wrong type or range before anything starts, naming the setting; edge values that make sense
(0 turns a cache or wait off) are taken."""
from __future__ import annotations

import math

import pytest

from adapterserve.server.limits import COUNTS, NON_NEGATIVE, POSITIVE_SECONDS, check_server_limits
from adapterserve.server.settings import merge_config

NOT_NUMBERS = ["5", None, True, [], {"n": 1}, math.nan, math.inf, -math.inf]


def _refused(key: str, value) -> str:
    with pytest.raises(ValueError) as refused:
        check_server_limits(merge_config({key: value}))
    assert key in str(refused.value)
    return str(refused.value)


@pytest.mark.parametrize("key", COUNTS)
@pytest.mark.parametrize("value", [0, -1, 2.5, *NOT_NUMBERS])
def test_counts_and_byte_budgets_take_positive_integers_only(key, value):
    assert "must be an integer >= 1" in _refused(key, value)


@pytest.mark.parametrize("key", POSITIVE_SECONDS)
@pytest.mark.parametrize("value", [0, -0.5, *NOT_NUMBERS])
def test_timeouts_take_positive_seconds_only(key, value):
    assert "must be a number of seconds > 0" in _refused(key, value)


@pytest.mark.parametrize("key", NON_NEGATIVE)
@pytest.mark.parametrize("value", [-1, -1e-9, *NOT_NUMBERS])
def test_ttls_and_graces_take_non_negative_numbers_only(key, value):
    assert "must be a number >= 0" in _refused(key, value)


@pytest.mark.parametrize("key", NON_NEGATIVE)
def test_zero_turns_a_cache_or_wait_off(key):
    check_server_limits(merge_config({key: 0}))
