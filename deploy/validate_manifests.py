"""Validates rendered Kubernetes manifests offline, as strictly as the API server would.

    python -m deploy.validate_manifests                       # base and every overlay
    python -m deploy.validate_manifests deploy/k8s/overlays/mine

Every document: built-in kinds against the Kubernetes schemas, custom kinds
(RayService, RayCluster, PodMonitor, InferencePool, InferenceModelRewrite, HTTPRoute) against
their CRDs in deploy/schemas (unknown fields are errors). Inside a RayService: the
RayCluster it creates, its pod templates and Service, and the Serve config in
serveConfigV2. Across them: ports, mounts and replica bounds that must agree, and
what PodMonitors, PodDisruptionBudgets and InferencePools select (references.py).
Exit status 1 with one line per problem.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from deploy.kustomize import K8S, WORKER_GROUP, container, example_dirs, kustomization_dirs, render
from deploy.references import check_references
from deploy.schemas import CRD_VERSION, CRDS, K8S_VERSION, RAY_KINDS, crd_validator, errors, k8s_definition, k8s_validator
from deploy.serve_config_check import check_serve_config
from deploy.tensor_parallel_check import ENGINE_DEPLOYMENT, check_tensor_parallel, replica_gpus, tensor_parallel_size

EXAMPLES = [K8S / "secret.example.yaml"]
POD_TEMPLATE = "io.k8s.api.core.v1.PodTemplateSpec"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
SERVICE = "io.k8s.api.core.v1.Service"
K8S_TERMINATION_GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds
SERVE_GRACEFUL_SHUTDOWN_S = 20  # Serve's default graceful_shutdown_timeout_s
METRICS_PORT_NAME = "as-metrics"  # the head container's port of the metrics hub


def check_documents(docs: Sequence[dict[str, Any]]) -> list[str]:
    """Problems of every document, each once (embedded checks may see the same one)."""
    return list(dict.fromkeys(problem for doc in docs for problem in check_document(doc)))


def check_document(doc: dict[str, Any]) -> list[str]:
    where = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    if doc.get("kind") in CRDS:
        return check_custom(doc, where)
    definition = k8s_definition(str(doc.get("apiVersion")), str(doc.get("kind")))
    if definition is None:
        return [f"{where}: Kubernetes {K8S_VERSION} has no kind {doc.get('kind')!r} in {doc.get('apiVersion')!r}"]
    return errors(k8s_validator(definition), doc, where)


def check_custom(doc: dict[str, Any], where: str) -> list[str]:
    """A custom kind, and what a RayService or RayCluster embeds."""
    api_version = CRDS[doc["kind"]][0]
    if doc.get("apiVersion") != api_version:
        return [f"{where}: apiVersion must be {api_version}, got {doc.get('apiVersion')!r}"]
    problems = errors(crd_validator(doc["kind"]), doc, where)
    problems += errors(k8s_validator(OBJECT_META), doc.get("metadata", {}), where, "metadata")
    spec = doc.get("spec") or {}
    if doc["kind"] == "RayService":
        problems += check_rayservice(spec, where)
    elif doc["kind"] in RAY_KINDS:
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
    problems += check_metrics_port(ports, serve, where)
    return problems + check_capacity(rayservice, serve, where) + check_grace(rayservice, serve, where)


def check_metrics_port(ports: dict[str, int], serve: dict[str, Any], where: str) -> list[str]:
    """The metrics hub listens on the head pod: its port declared there as METRICS_PORT_NAME,
    on all interfaces (a PodMonitor scrapes the pod's address)."""
    problems = []
    for app in serve["applications"]:
        metrics = (app.get("args") or {}).get("metrics") or {}
        port = metrics.get("port")
        if port is None:
            continue
        if ports.get(METRICS_PORT_NAME) != port:
            problems.append(f"{where}: args.metrics.port is {port}, but the head container's port "
                            f"{METRICS_PORT_NAME!r} is {ports.get(METRICS_PORT_NAME)}: declare it there (the hub runs "
                            "on the head)")
        if metrics.get("host") not in ("0.0.0.0", "::"):
            problems.append(f"{where}: args.metrics.host is {metrics.get('host')!r}: set 0.0.0.0, or nothing outside "
                            "the head pod can scrape the metrics port")
    return problems


def check_capacity(rayservice: dict[str, Any], serve: dict[str, Any], where: str) -> list[str]:
    """Engine replicas must fit the GPU workers (a cluster without a gpu group: its head),
    and see the model and the key file."""
    group = engine_group(rayservice)
    worker = group["template"]["spec"]["containers"][0]
    gpus = int(worker.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
    mounts = [m["mountPath"] for m in worker.get("volumeMounts", [])]
    problems = []
    for app in serve["applications"]:
        for dep in app.get("deployments", []):
            tp_engine = dep["name"] == ENGINE_DEPLOYMENT and tensor_parallel_size(app) > 1
            need = replica_gpus(dep, app["args"]["engine"] if tp_engine else None)
            most = (dep.get("autoscaling_config") or {}).get("max_replicas", dep.get("num_replicas"))
            if need and isinstance(most, int) and most * need > group["maxReplicas"] * gpus:
                problems.append(f"{where}: {dep['name']} may want {most * need:g} GPUs, {group['name']} have at most "
                                f"{group['maxReplicas']} x {gpus}")
        for key in ("model", "api_keys_file"):
            path = (app.get("args") or {}).get(key)
            if path and path.startswith("/") and not any(path.startswith(m.rstrip("/") + "/") for m in mounts):
                problems.append(f"{where}: args.{key} {path} is on no volume of the worker pods ({', '.join(mounts)})")
    return problems + check_tensor_parallel(group["template"], gpus, serve, where)


def engine_group(rayservice: dict[str, Any]) -> dict[str, Any]:
    """Where the engines run: the gpu worker group, or the head of a cluster without one."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in cluster.get("workerGroupSpecs") or []:
        if group["groupName"] == WORKER_GROUP:
            return {"name": "workers", "template": group["template"], "maxReplicas": group["maxReplicas"]}
    return {"name": "head pods", "template": cluster["headGroupSpec"]["template"], "maxReplicas": 1}


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
    if not problems:
        for doc in docs:
            if doc.get("kind") == "RayService":
                problems += check_consistency(doc)
        problems += check_references(docs)
    return [f"{directory}: {p}" for p in problems]


def check_examples() -> list[str]:
    return [f"{path}: {p}" for path in EXAMPLES for p in check_documents(list(yaml.safe_load_all(path.read_text())))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="*", type=Path, help="kustomization directories (default: base, overlays "
                        "and examples)")
    args = parser.parse_args(argv)
    problems = check_examples() if not args.dirs else []
    for directory in args.dirs or [*kustomization_dirs(), *example_dirs()]:
        problems += check_directory(directory)
    print("\n".join(problems) or "all manifests are valid", file=sys.stderr if problems else sys.stdout)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
