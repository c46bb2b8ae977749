"""Validates rendered Kubernetes manifests offline, as strictly as the API server would.

    python -m deploy.validate_manifests                       # base and every overlay
    python -m deploy.validate_manifests deploy/k8s/overlays/mine

Every document: built-in kinds against the Kubernetes schemas, RayService and
RayCluster against the KubeRay CRDs (unknown fields are errors). Inside a
RayService: the RayCluster it creates, its pod templates and Service, and the
Serve config in serveConfigV2. Across them: ports, mounts and replica bounds
that must agree. Exit status 1 with one line per problem.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from deploy.kustomize import K8S, container, kustomization_dirs, render, worker_group
from deploy.schemas import CRD_FILES, CRD_VERSION, K8S_VERSION, crd_validator, errors, k8s_definition, k8s_validator
from deploy.serve_config_check import check_serve_config

EXAMPLES = [K8S / "secret.example.yaml"]
POD_TEMPLATE = "io.k8s.api.core.v1.PodTemplateSpec"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
SERVICE = "io.k8s.api.core.v1.Service"
K8S_TERMINATION_GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds
SERVE_GRACEFUL_SHUTDOWN_S = 20  # Serve's default graceful_shutdown_timeout_s


def check_documents(docs: Sequence[dict[str, Any]]) -> list[str]:
    """Problems of every document, each once (embedded checks may see the same one)."""
    return list(dict.fromkeys(problem for doc in docs for problem in check_document(doc)))


def check_document(doc: dict[str, Any]) -> list[str]:
    where = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    if doc.get("kind") in CRD_FILES:
        return check_custom(doc, where)
    definition = k8s_definition(str(doc.get("apiVersion")), str(doc.get("kind")))
    if definition is None:
        return [f"{where}: Kubernetes {K8S_VERSION} has no kind {doc.get('kind')!r} in {doc.get('apiVersion')!r}"]
    return errors(k8s_validator(definition), doc, where)


def check_custom(doc: dict[str, Any], where: str) -> list[str]:
    """A RayService or RayCluster, and what it embeds."""
    if doc.get("apiVersion") != f"ray.io/{CRD_VERSION}":
        return [f"{where}: apiVersion must be ray.io/{CRD_VERSION}, got {doc.get('apiVersion')!r}"]
    problems = errors(crd_validator(doc["kind"]), doc, where)
    problems += errors(k8s_validator(OBJECT_META), doc.get("metadata", {}), where, "metadata")
    spec = doc.get("spec") or {}
    if doc["kind"] == "RayService":
        problems += check_rayservice(spec, where)
    else:
        problems += check_pod_templates(spec, where, "spec")
    return problems


def check_rayservice(spec: dict[str, Any], where: str) -> list[str]:
    cluster = {"apiVersion": f"ray.io/{CRD_VERSION}", "kind": "RayCluster", "metadata": {"name": "x"},
               "spec": spec.get("rayClusterConfig")}
    problems = []
    if crd_validator("RayService").is_valid({"spec": spec}):  # else the same problems are reported
        problems += errors(crd_validator("RayCluster"), cluster, f"{where} (its RayCluster)")
    problems += check_pod_templates(spec.get("rayClusterConfig") or {}, where, "spec.rayClusterConfig")
    if "serveService" in spec:
        problems += errors(k8s_validator(SERVICE), spec["serveService"], where, "spec.serveService")
    if "serveConfigV2" in spec:
        problems += check_serve_config(str(spec["serveConfigV2"]), f"{where}: spec.serveConfigV2")
    return problems


def check_pod_templates(cluster: dict[str, Any], where: str, at: str) -> list[str]:
    templates = [(f"{at}.headGroupSpec.template", (cluster.get("headGroupSpec") or {}).get("template"))]
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        templates.append((f"{at}.workerGroupSpecs[{i}].template", group.get("template")))
    return [p for path, t in templates if t is not None for p in errors(k8s_validator(POD_TEMPLATE), t, where, path)]


def check_consistency(rayservice: dict[str, Any]) -> list[str]:
    """What the schemas cannot see: the Serve config against the pods that run it."""
    where = f"RayService/{rayservice['metadata']['name']}"
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    head = container(rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"], "ray-head")
    ports = {p.get("name"): p["containerPort"] for p in head.get("ports", [])}
    problems = []
    for name, port in (("serve", serve["http_options"]["port"]), ("serve-grpc", serve["grpc_options"]["port"])):
        if ports.get(name) != port:
            problems.append(f"{where}: head container port {name!r} is {ports.get(name)}, serveConfigV2 says {port}")
    return problems + check_capacity(rayservice, serve, where) + check_grace(rayservice, serve, where)


def check_capacity(rayservice: dict[str, Any], serve: dict[str, Any], where: str) -> list[str]:
    """Engine replicas must fit the GPU workers, and see the model and the key file."""
    group = worker_group(rayservice)
    worker = container(group["template"], "ray-worker")
    gpus = int(worker["resources"]["limits"].get("nvidia.com/gpu", 0))
    mounts = [m["mountPath"] for m in worker.get("volumeMounts", [])]
    problems = []
    for app in serve["applications"]:
        for dep in app.get("deployments", []):
            need = (dep.get("ray_actor_options") or {}).get("num_gpus", 0)
            most = (dep.get("autoscaling_config") or {}).get("max_replicas", dep.get("num_replicas"))
            if need and isinstance(most, int) and most * need > group["maxReplicas"] * gpus:
                problems.append(f"{where}: {dep['name']} may want {most * need} GPUs, workers have at most "
                                f"{group['maxReplicas']} x {gpus}")
        for key in ("model", "api_keys_file"):
            path = (app.get("args") or {}).get(key)
            if path and path.startswith("/") and not any(path.startswith(m.rstrip("/") + "/") for m in mounts):
                problems.append(f"{where}: args.{key} {path} is on no volume of the worker pods ({', '.join(mounts)})")
    return problems


def check_grace(rayservice: dict[str, Any], serve: dict[str, Any], where: str) -> list[str]:
    """Every pod must outlive the drain its replicas do when Kubernetes stops it: its
    terminationGracePeriodSeconds above the longest grace of the Serve config."""
    from adapterserve.server.settings import DEFAULTS

    graces = [SERVE_GRACEFUL_SHUTDOWN_S]
    for app in serve["applications"]:
        graces.append((app.get("args") or {}).get("drain_grace_s", DEFAULTS["drain_grace_s"]))
        graces += [d["graceful_shutdown_timeout_s"] for d in app.get("deployments", []) if "graceful_shutdown_timeout_s" in d]
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in cluster.get("workerGroupSpecs", [])})
    problems = []
    for name, template in templates.items():
        seconds = template.get("spec", {}).get("terminationGracePeriodSeconds", K8S_TERMINATION_GRACE_S)
        if seconds <= max(graces):
            problems.append(f"{where}: {name} pods get terminationGracePeriodSeconds {seconds}, not more than the "
                            f"{max(graces):g} s their replicas may take to drain (drain_grace_s, "
                            "graceful_shutdown_timeout_s)")
    return problems


def check_directory(directory: str | Path) -> list[str]:
    try:
        docs = render(directory)
    except RuntimeError as exc:  # kubectl missing, or Kustomize refused the directory
        return [str(exc)]
    problems = check_documents(docs)
    for doc in docs:
        if doc.get("kind") == "RayService" and not problems:
            problems += check_consistency(doc)
    return [f"{directory}: {p}" for p in problems]


def check_examples() -> list[str]:
    return [f"{path}: {p}" for path in EXAMPLES for p in check_documents(list(yaml.safe_load_all(path.read_text())))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="*", type=Path, help="kustomization directories (default: base and overlays)")
    args = parser.parse_args(argv)
    problems = check_examples() if not args.dirs else []
    for directory in args.dirs or kustomization_dirs():
        problems += check_directory(directory)
    print("\n".join(problems) or "all manifests are valid", file=sys.stderr if problems else sys.stdout)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
