"""Hostile server settings: every count, byte budget, timeout and TTL, and the engine's all-reduce
choice, refuses a value of the wrong type or range before anything starts, naming the setting;
edge values that make sense (0 turns a cache or wait off) are taken."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from adapterserve.config import EngineConfig
from adapterserve.engine.mixed_graphs import mixed_graph_limit
from adapterserve.server.app import build_app
from adapterserve.server.limits import COUNTS, NON_NEGATIVE, POSITIVE_SECONDS, check_server_limits
from adapterserve.server.settings import merge_config

MODEL = Path(__file__).parents[1] / "fixtures" / "adapterhub" / "tiny-llama"
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


MODEL = Path(__file__).parents[1] / "fixtures" / "adapterhub" / "tiny-llama"


@pytest.mark.parametrize("value", [-1, 2.5, "1024", None, True, [], math.nan, math.inf])
def test_mixed_graph_tokens_takes_a_non_negative_integer_only(value):
    with pytest.raises(ValueError, match="mixed_graph_tokens must be an integer of at least 0"):
        build_app({"model": str(MODEL), "encoder": False, "engine": {"mixed_graph_tokens": value}})


@pytest.mark.parametrize("value", [0, 1, 100000])
def test_mixed_graph_tokens_zero_turns_them_off_and_large_values_are_capped(value):
    config = EngineConfig(mixed_graph_tokens=value, max_num_batched_tokens=512)
    assert mixed_graph_limit(config) == min(value, 512)


@pytest.mark.parametrize("value", ["mpi", "NCCL", "", None, 1, True, ["auto"]])
def test_a_bad_tensor_parallel_all_reduce_is_refused_before_anything_starts(value):
    with pytest.raises(ValueError, match=r"tensor_parallel_all_reduce must be one of \['auto', 'nccl'\]"):
        build_app({"model": str(MODEL), "encoder": False,
                   "engine": {"tensor_parallel_size": 2, "tensor_parallel_all_reduce": value}})


@pytest.mark.parametrize("value", [0, -1, 2.5, "8", True, [], {"n": 1}, math.nan, math.inf])
def test_host_threads_takes_a_positive_integer_or_null_only(value):
    with pytest.raises(ValueError, match="host_threads must be an integer of at least 1, or null"):
        build_app({"model": str(MODEL), "encoder": False, "engine": {"host_threads": value}})
