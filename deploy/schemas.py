"""Offline JSON schemas for Kubernetes manifests, strict like the API server's
`--validate=strict` (unknown fields are errors).

Built-in kinds: the Kubernetes OpenAPI schemas that the `kubernetes-validate`
package ships (its `-strict` variant). Custom kinds (KubeRay's, prometheus-operator's
PodMonitor, the Gateway API Inference Extension's): the CRDs copied into deploy/schemas
(each folder's SOURCE.md says from where), made strict here: every object schema that
lists its properties and does not say `x-kubernetes-preserve-unknown-fields` refuses others.
"""
from __future__ import annotations

import copy
import difflib
import json
from functools import lru_cache
from importlib import resources
from typing import Any, Iterable

import jsonschema
import yaml
from referencing import Registry, Resource

from deploy.kustomize import DEPLOY

K8S_VERSION = "1.37.0"  # newest schemas in kubernetes-validate 1.37
SCHEMA_DIR = DEPLOY / "schemas"
CRD_VERSION = "v1"  # KubeRay's
# kind -> (the apiVersion we write, its CRD under deploy/schemas)
CRDS = {
    "RayService": (f"ray.io/{CRD_VERSION}", "kuberay/ray.io_rayservices.yaml"),
    "RayCluster": (f"ray.io/{CRD_VERSION}", "kuberay/ray.io_rayclusters.yaml"),
    "PodMonitor": ("monitoring.coreos.com/v1", "prometheus-operator/monitoring.coreos.com_podmonitors.yaml"),
    "InferencePool": ("inference.networking.k8s.io/v1",
                      "inference-extension/inference.networking.k8s.io_inferencepools.yaml"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "gateway-api/gateway.networking.k8s.io_httproutes.yaml"),
    "InferenceModelRewrite": ("inference.networking.x-k8s.io/v1alpha2",
                              "inference-extension/inference.networking.x-k8s.io_inferencemodelrewrites.yaml"),
}
RAY_KINDS = ("RayService", "RayCluster")
_DEFS_ID = "https://kubernetes.io/api/_definitions.json"
_SUBSCHEMAS = ("items", "additionalProperties", "not")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf")


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of an OpenAPI v3 schema in which unknown properties are errors."""
    schema = copy.deepcopy(schema)
    _close(schema)
    return schema


def _close(node: dict[str, Any]) -> None:
    if "properties" in node and "additionalProperties" not in node:
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    for child in node.get("properties", {}).values():
        _close(child)
    for key in _SUBSCHEMAS:
        if isinstance(node.get(key), dict):
            _close(node[key])
    for key in _SCHEMA_LISTS:
        for child in node.get(key, []):
            _close(child)


@lru_cache(maxsize=None)
def crd_validator(kind: str) -> jsonschema.Draft202012Validator:
    """The strict validator of a custom kind of CRDS, at the apiVersion CRDS names."""
    api_version, path = CRDS[kind]
    crd = yaml.safe_load((SCHEMA_DIR / path).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == api_version.rpartition("/")[2])
    return jsonschema.Draft202012Validator(strict(version["schema"]["openAPIV3Schema"]))


@lru_cache(maxsize=1)
def _k8s_definitions() -> dict[str, Any]:
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_VERSION}-local-strict"
    return json.loads((folder / "_definitions.json").read_text())


@lru_cache(maxsize=None)
def k8s_validator(definition: str) -> jsonschema.Draft202012Validator:
    """Validator of a Kubernetes definition, e.g. 'io.k8s.api.core.v1.PodTemplateSpec'."""
    defs = _k8s_definitions()
    if definition not in defs["$defs"]:
        raise KeyError(f"no Kubernetes {K8S_VERSION} schema named {definition}")
    registry = Resource.from_contents(defs) @ Registry()
    return jsonschema.Draft202012Validator({"$ref": f"{_DEFS_ID}#/$defs/{definition}"}, registry=registry)


def k8s_definition(api_version: str, kind: str) -> str | None:
    """The definition name of a built-in kind, or None if Kubernetes has no such kind."""
    group, _, version = api_version.rpartition("/")
    for name, schema in _k8s_definitions()["$defs"].items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            if (gvk["group"], gvk["version"], gvk["kind"]) == (group, version, kind):
                return name
    return None


def errors(validator: jsonschema.Draft202012Validator, instance: Any, where: str, at: str = "") -> list[str]:
    """Readable errors: 'WHERE: field.path: problem', unknown fields named one by one."""
    found = sorted(validator.iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{where}: {line}" for e in found for line in _describe(e, at)]


def _describe(error: jsonschema.ValidationError, at: str) -> Iterable[str]:
    path = _path(error.absolute_path, at)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = list(error.schema.get("properties", {}))
        for field in sorted(set(error.instance) - set(known)):
            hint = difflib.get_close_matches(field, known, n=1)
            yield f"{_join(path, field)}: unknown field {field!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        return
    yield f"{path or '(top)'}: {error.message}"


def _path(parts: Iterable[Any], at: str = "") -> str:
    text = at
    for part in parts:
        text = f"{text}[{part}]" if isinstance(part, int) else _join(text, str(part))
    return text


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field
