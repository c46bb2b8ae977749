"""Which pods a label selector picks among the pods the rendered RayServices will run.

A pod's labels are its template's plus those KubeRay adds (ray-operator's `labelPod`):
ray.io/node-type (head, worker), ray.io/group (headgroup, the worker group's name) and
ray.io/is-ray-node, which a template cannot change, and app.kubernetes.io/name (kuberay)
and app.kubernetes.io/created-by (kuberay-operator), which a template's labels replace.
ray.io/cluster is the RayCluster's generated name: no manifest can know it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

KUBERAY_FIXED = ("ray.io/node-type", "ray.io/group", "ray.io/is-ray-node")
KUBERAY_DEFAULTS = {"app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator"}
HEAD_GROUP = "headgroup"


@dataclass(frozen=True)
class PodGroup:
    """The pods of one group of one RayService: where it is, its labels, its containers."""

    where: str  # e.g. "RayService/adapterserve head" or "RayService/adapterserve gpu"
    labels: dict[str, str]
    containers: list[dict[str, Any]]
    min_pods: int  # the fewest pods it runs (the head: 1; workers: minReplicas)

    def port_names(self) -> set[str]:
        return {p["name"] for c in self.containers for p in c.get("ports", []) if "name" in p}

    def port_numbers(self) -> set[int]:
        return {p["containerPort"] for c in self.containers for p in c.get("ports", [])}


def pod_groups(docs: Iterable[dict[str, Any]]) -> list[PodGroup]:
    """Every pod group of every RayService in `docs`."""
    groups = []
    for doc in docs:
        if doc.get("kind") != "RayService":
            continue
        name = f"RayService/{doc['metadata']['name']}"
        cluster = doc["spec"]["rayClusterConfig"]
        head = cluster["headGroupSpec"]["template"]
        groups.append(_group(f"{name} head", head, "head", HEAD_GROUP, 1))
        for spec in cluster.get("workerGroupSpecs", []):
            least = spec.get("minReplicas", spec.get("replicas", 0))
            groups.append(_group(f"{name} {spec['groupName']}", spec["template"], "worker", spec["groupName"], least))
    return groups


def _group(where: str, template: dict[str, Any], node_type: str, group: str, least: int) -> PodGroup:
    labels = {**KUBERAY_DEFAULTS, **(template.get("metadata") or {}).get("labels", {})}
    labels.update({"ray.io/node-type": node_type, "ray.io/group": group, "ray.io/is-ray-node": "yes"})
    return PodGroup(where, labels, template["spec"]["containers"], least)


def matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions) selects a pod with `labels`."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return all(_expression(e, labels) for e in selector.get("matchExpressions") or [])


def _expression(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, op, values = expression["key"], expression["operator"], expression.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    return key not in labels  # DoesNotExist


def selected(selector: dict[str, Any] | None, groups: list[PodGroup]) -> list[PodGroup]:
    return [g for g in groups if matches(selector, g.labels)]
