"""Limits that must agree with each other: Serve's per-replica limits and our own.

Our limits shed with a message that says what is full and when to retry; Serve's, if
reached first, queue requests where nobody reports on them. So Serve's limits sit
above ours: an engine replica takes every request its engine runs or queues (the engine
sheds the rest: Overloaded), and an ingress replica takes every call admission admits.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapterserve.config import EngineConfig

RESERVED_CALLS = 16  # replica calls besides requests: health, describe, adapter loads
COUNTS = ("max_in_flight", "max_health_watches", "max_request_bytes", "max_upload_bytes", "max_upload_files",
          "host_cache_bytes", "registered_adapter_bytes", "max_adapters_per_replica", "max_texts_per_request")
POSITIVE_SECONDS = ("stall_timeout_s", "engine_start_timeout_s", "gc_interval_s", "stale_upload_s")
NON_NEGATIVE = ("resolve_ttl_s", "gc_grace_s", "drain_grace_s", "relay_chunk_ms")  # 0 turns the wait or cache off


def engine_max_ongoing(cfg: Mapping[str, Any], engine: EngineConfig) -> int:
    """The engine deployment's max_ongoing_requests: given (checked) or derived from the engine's queues."""
    needed = engine.max_num_seqs + engine.max_queued_requests
    given = cfg["replica"]["max_ongoing_requests"]
    if given is None:
        return needed + RESERVED_CALLS
    if isinstance(given, bool) or not isinstance(given, int) or given < needed:
        raise ValueError(f"replica.max_ongoing_requests must be at least the engine's max_num_seqs "
                         f"({engine.max_num_seqs}) + max_queued_requests ({engine.max_queued_requests}) = {needed}, "
                         f"got {given!r}: else Serve queues requests the engine would take or shed; leave it "
                         "unset (null) to derive it")
    return given


def check_server_limits(cfg: Mapping[str, Any]) -> None:
    """ValueError naming the setting when admission, prompt or health settings are out of range."""
    for key in COUNTS:
        _positive_int(key, cfg[key])
    if cfg["max_prompt_chars"] is not None:
        _positive_int("max_prompt_chars", cfg["max_prompt_chars"])
    for key in POSITIVE_SECONDS:
        if not _finite(cfg[key]) or cfg[key] <= 0:
            raise ValueError(f"{key} must be a number of seconds > 0, got {cfg[key]!r}")
    for key in NON_NEGATIVE:
        if not _finite(cfg[key]) or cfg[key] < 0:
            raise ValueError(f"{key} must be a number >= 0 (0 turns it off), got {cfg[key]!r}")
    admitted = cfg["max_in_flight"] + cfg["max_health_watches"]
    ongoing = cfg["ingress"]["max_ongoing_requests"]
    if admitted >= ongoing:
        raise ValueError(f"max_in_flight ({cfg['max_in_flight']}) + max_health_watches ({cfg['max_health_watches']}) "
                         f"= {admitted} must stay below ingress.max_ongoing_requests ({ongoing}), which also "
                         "carries health checks: lower them or raise it")


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and abs(value) < float("inf")


def _positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
