"""What the schemas cannot see across documents: the pods that PodMonitors,
PodDisruptionBudgets and InferencePools select (selection.py) exist and have the ports
they name, and budgets that can never block a drain for ever."""
from __future__ import annotations

from typing import Any, Sequence

from deploy.selection import PodGroup, pod_groups, selected


def check_references(docs: Sequence[dict[str, Any]]) -> list[str]:
    groups = pod_groups(docs)
    checks = {"PodMonitor": check_pod_monitor, "PodDisruptionBudget": check_budget, "InferencePool": check_pool}
    problems = []
    for doc in docs:
        check = checks.get(doc.get("kind"))
        if check is not None:
            where = f"{doc['kind']}/{doc['metadata']['name']}"
            problems += [f"{where}: {p}" for p in check(doc["spec"], groups)]
    return problems


def _none_selected(selector: dict[str, Any], groups: list[PodGroup]) -> str:
    labels = "; ".join(f"{g.where}: {_labels(g.labels)}" for g in groups) or "no RayService here"
    return f"spec.selector {_labels(selector.get('matchLabels') or {})} selects no pod ({labels})"


def _labels(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def check_pod_monitor(spec: dict[str, Any], groups: list[PodGroup]) -> list[str]:
    """Every endpoint's port name is a container port of every pod it selects."""
    chosen = selected(spec.get("selector"), groups)
    if not chosen:
        return [_none_selected(spec.get("selector") or {}, groups)]
    problems = []
    for i, endpoint in enumerate(spec.get("podMetricsEndpoints") or []):
        port = endpoint.get("port")
        for group in chosen:
            if port is not None and port not in group.port_names():
                problems.append(f"spec.podMetricsEndpoints[{i}].port {port!r} is no container port of {group.where} "
                                f"(it has {', '.join(sorted(group.port_names()))})")
    return problems


def check_budget(spec: dict[str, Any], groups: list[PodGroup]) -> list[str]:
    """KubeRay's pods: integer minAvailable only, below the fewest pods selected."""
    chosen = selected(spec.get("selector"), groups)
    if not chosen:
        return [_none_selected(spec.get("selector") or {}, groups)]
    least = spec.get("minAvailable")
    if "maxUnavailable" in spec or not isinstance(least, int):
        return ["KubeRay's RayCluster has no scale subresource: a budget of its pods needs an integer "
                f"spec.minAvailable (maxUnavailable or a percentage never allows an eviction), got {spec}"]
    fewest = sum(g.min_pods for g in chosen)
    if least and least >= fewest:
        names = ", ".join(g.where for g in chosen)
        return [f"spec.minAvailable {least} is not below the {fewest} pod(s) it selects at the least ({names}): "
                "a node drain would wait for ever"]
    return []


def check_pool(spec: dict[str, Any], groups: list[PodGroup]) -> list[str]:
    """The pool's endpoints exist and listen on its target ports."""
    selector = {"matchLabels": spec.get("selector", {}).get("matchLabels") or {}}
    chosen = selected(selector, groups)
    if not chosen:
        return [_none_selected(selector, groups)]
    problems = []
    for i, target in enumerate(spec.get("targetPorts") or []):
        for group in chosen:
            if target["number"] not in group.port_numbers():
                problems.append(f"spec.targetPorts[{i}].number {target['number']} is no container port of "
                                f"{group.where}")
    return problems
