"""Serve's limits sit above ours, so that a burst is shed with our message: the engine
deployment's max_ongoing_requests is derived from the engine's queues (or refused when
below them), admission stays below the ingress's, and every limit is range-checked."""
from __future__ import annotations

import pytest

from adapterserve.config import EngineConfig
from adapterserve.server.limits import RESERVED_CALLS, check_server_limits, engine_max_ongoing
from adapterserve.server.settings import merge_config


def test_the_engine_deployment_takes_what_its_engine_runs_and_queues():
    engine = EngineConfig(max_num_seqs=8, max_queued_requests=4)
    assert engine_max_ongoing(merge_config(), engine) == 8 + 4 + RESERVED_CALLS
    assert engine_max_ongoing(merge_config({"replica": {"max_ongoing_requests": 12}}), engine) == 12
    with pytest.raises(ValueError) as refused:
        engine_max_ongoing(merge_config({"replica": {"max_ongoing_requests": 11}}), engine)
    assert str(refused.value).startswith("replica.max_ongoing_requests must be at least the engine's max_num_seqs "
                                         "(8) + max_queued_requests (4) = 12, got 11")


def test_the_defaults_agree():
    check_server_limits(merge_config())


@pytest.mark.parametrize("overrides, says", [
    ({"max_in_flight": 1000, "max_health_watches": 24}, "= 1024 must stay below ingress.max_ongoing_requests (1024)"),
    ({"ingress": {"max_ongoing_requests": 100}}, "must stay below ingress.max_ongoing_requests (100)"),
    ({"max_in_flight": 0}, "max_in_flight must be an integer >= 1, got 0"),
    ({"max_health_watches": 2.5}, "max_health_watches must be an integer >= 1, got 2.5"),
    ({"max_prompt_chars": "big"}, "max_prompt_chars must be an integer >= 1, got 'big'"),
    ({"stall_timeout_s": 0}, "stall_timeout_s must be a number of seconds > 0, got 0"),
    ({"engine_start_timeout_s": True}, "engine_start_timeout_s must be a number of seconds > 0, got True"),
])
def test_out_of_range_limits_are_refused_naming_the_setting(overrides, says):
    with pytest.raises(ValueError) as refused:
        check_server_limits(merge_config(overrides))
    assert says in str(refused.value)
