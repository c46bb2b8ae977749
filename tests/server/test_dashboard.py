"""deploy/grafana/adapterserve.json asks only for series the server exports, with their labels.

Every panel's every query is parsed enough to find its series (identifiers not followed by
`(`, other than PromQL's keywords) and its labels (in selectors and in by/without/on/
ignoring clauses); each series must be one of series.exported_names(), each label one it
carries. A copy with one name mistyped must fail.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from adapterserve.server.metrics import series as s

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "adapterserve.json"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
            "inf", "nan"}
GATEWAY_LABELS = {"vllm:lora_requests_info": {"model_name", "running_lora_adapters", "waiting_lora_adapters",
                                              "max_lora"},
                  "vllm:cache_config_info": {"model_name", "block_size", "num_gpu_blocks"}}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(by|without|on|ignoring)\s*\(([^)]*)\)")
_NAME = re.compile(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")


def parse(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """({series: labels its selectors match on}, labels of its grouping clauses)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range durations, $__rate_interval
    found: dict[str, set[str]] = {}
    grouping = {label.strip() for _, labels in _GROUPING.findall(text) for label in labels.split(",") if label.strip()}
    text = _GROUPING.sub(" ", text)
    for name, matchers in _SELECTOR.findall(text):
        found.setdefault(name, set()).update(_MATCHER.findall(matchers))
    text = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text)
    for name in _NAME.findall(text):
        if name.lower() not in KEYWORDS:
            found.setdefault(name, set())
    found.pop("", None)
    return found, grouping


def labels_of(name: str) -> set[str]:
    """The labels a sample name carries (None if we export no such name)."""
    if name in GATEWAY_LABELS:
        return GATEWAY_LABELS[name]
    if name.startswith("vllm:"):
        return {"model_name"}
    for suffix, extra in (("_total", set()), ("_bucket", {"le"}), ("_sum", set()), ("_count", set()), ("", set())):
        base = name[: -len(suffix)] if suffix and name.endswith(suffix) else (name if not suffix else None)
        if base in s.CATALOG:
            return set(s.CATALOG[base].labels) | extra
    raise KeyError(name)


def problems(dashboard: dict) -> list[str]:
    exported, found = s.exported_names(), []
    for panel, target in targets(dashboard):
        used, grouping = parse(target["expr"])
        where = f"panel {panel['title']!r} {target['refId']}"
        if not used:
            found.append(f"{where}: no series in {target['expr']!r}")
        for name, labels in used.items():
            if name not in exported:
                found.append(f"{where}: {name!r} is not a series the server exports")
                continue
            found += [f"{where}: {name} has no label {label!r}" for label in sorted(labels - labels_of(name))]
        if used and all(n in exported for n in used):  # else its unknown name says it all
            known = set().union(*(labels_of(n) for n in used))
            found += [f"{where}: no series of it has the label {label!r}" for label in sorted(grouping - known)]
    return found


def targets(dashboard: dict):
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                yield inner, target


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_query_names_exported_series_and_their_labels(dashboard):
    assert sum(1 for _ in targets(dashboard)) >= 30
    assert problems(dashboard) == []


def test_the_dashboard_answers_the_operators_questions(dashboard):
    """Per-adapter traffic, TTFT and tokens/s, KV and slots, loads, errors, tenants: each asked."""
    names = {n for _, t in targets(dashboard) for n in parse(t["expr"])[0]}
    for needed in ("adapterserve_requests_total", "adapterserve_time_to_first_token_seconds_bucket",
                   "adapterserve_time_per_output_token_seconds_bucket", "adapterserve_generated_tokens_total",
                   "adapterserve_kv_cache_used_blocks", "adapterserve_adapter_slots_used",
                   "adapterserve_adapter_slots_pinned", "adapterserve_adapter_loads_total",
                   "adapterserve_adapter_slot_evictions_total", "adapterserve_adapter_load_seconds_bucket",
                   "adapterserve_adapter_cache_lookups_total", "adapterserve_request_queue_seconds_bucket",
                   "adapterserve_engine_step_seconds_bucket", "adapterserve_engine_batch_requests_sum",
                   "adapterserve_waiting_requests", "adapterserve_running_requests",
                   "adapterserve_engine_restarts_total", "adapterserve_tenant_requests_total"):
        assert needed in names, needed
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert "label_values(adapterserve_requests_total, adapter)" in json.dumps(variables["adapter"]["query"])
    assert all(t["datasource"]["uid"] == "${datasource}" for _, t in targets(dashboard))


@pytest.mark.parametrize("old, new, expected", [
    ("adapterserve_generated_tokens_total", "adapterserve_generated_token_total",
     "'adapterserve_generated_token_total' is not a series the server exports"),
    ("adapterserve_time_to_first_token_seconds_bucket", "adapterserve_time_to_first_token_bucket",
     "'adapterserve_time_to_first_token_bucket' is not a series the server exports"),
    ("sum by (backbone) (adapterserve_kv_cache_used_blocks)", "sum by (model) (adapterserve_kv_cache_used_blocks)",
     "no series of it has the label 'model'"),
    ('adapterserve_adapter_cache_lookups_total{result="hit"}', 'adapterserve_adapter_cache_lookups_total{outcome="hit"}',
     "adapterserve_adapter_cache_lookups_total has no label 'outcome'"),
])
def test_a_mistyped_copy_fails(dashboard, old, new, expected):
    broken = json.loads(json.dumps(dashboard).replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1], 1))
    assert broken != dashboard, f"{old!r} is not in the dashboard"
    found = problems(broken)
    assert len(found) == 1 and expected in found[0], found


def test_the_parser_finds_names_and_labels():
    used, grouping = parse('histogram_quantile(0.99, sum by (adapter, le) (rate(a_bucket{adapter=~"$x", code!="OK"}'
                           '[$__rate_interval]))) / on (adapter) group_left b_total offset 5m and vllm:c')
    assert used == {"a_bucket": {"adapter", "code"}, "b_total": set(), "vllm:c": set()}
    assert grouping == {"adapter", "le"}
    assert copy.deepcopy(parse("sum(rate(x_total[1h]))")) == ({"x_total": set()}, set())
