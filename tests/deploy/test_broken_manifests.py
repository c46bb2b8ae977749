"""The checks must fail, and name the field, on manifests that the API server or Ray would refuse."""
from __future__ import annotations

import copy
import os
import textwrap

import pytest

from deploy import validate_manifests as vm
from deploy.kustomize import K8S
from deploy.references import check_references
from deploy.schemas import strict
from deploy.serve_config_check import check_serve_config


def broken(rayservice, edit):
    doc = copy.deepcopy(rayservice)
    edit(doc)
    return vm.check_documents([doc])


def worker(doc):
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def test_typo_in_a_pod_template_field(rayservices):
    def edit(doc):
        spec = worker(doc)["template"]["spec"]
        spec["contaners"] = spec.pop("containers")

    problems = broken(rayservices["base"], edit)
    field = "spec.rayClusterConfig.workerGroupSpecs[0].template.spec.contaners"
    assert f"RayService/adapterserve: {field}: unknown field 'contaners' (did you mean 'containers'?)" in problems


def test_wrong_type(rayservices):
    problems = broken(rayservices["base"], lambda doc: worker(doc).update(maxReplicas="four"))
    field = "spec.rayClusterConfig.workerGroupSpecs[0].maxReplicas"
    assert problems == [f"RayService/adapterserve: {field}: 'four' is not of type 'integer'"]


def test_typo_at_the_top_of_the_spec_and_in_metadata(rayservices):
    def edit(doc):
        doc["spec"]["serveConfigV3"] = doc["spec"].pop("serveConfigV2")
        doc["metadata"]["anotations"] = {}

    problems = broken(rayservices["base"], edit)
    typo = "spec.serveConfigV3: unknown field 'serveConfigV3' (did you mean 'serveConfigV2'?)"
    assert any(typo in p for p in problems)
    assert any("metadata.anotations: unknown field" in p for p in problems)


def test_wrong_api_version(rayservices):
    problems = broken(rayservices["base"], lambda doc: doc.update(apiVersion="ray.io/v2"))
    assert problems == ["RayService/adapterserve: apiVersion must be ray.io/v1, got 'ray.io/v2'"]


def test_builtin_kind_typo(rendered):
    config_map = copy.deepcopy(next(d for d in rendered["base"] if d["kind"] == "ConfigMap"))
    config_map["datta"] = config_map.pop("data")
    assert vm.check_documents([config_map]) == [f"ConfigMap/{config_map['metadata']['name']}: datta: unknown field "
                                                "'datta' (did you mean 'data'?)"]
    assert vm.check_documents([{"apiVersion": "v1", "kind": "ConfigMapp", "metadata": {"name": "x"}}]) == [
        "ConfigMapp/x: Kubernetes 1.37.0 has no kind 'ConfigMapp' in 'v1'"
    ]


SERVE = textwrap.dedent("""\
    applications:
      - name: adapterserve
        import_path: adapterserve.server.app:app_builder
        args: {model: /models/m, engine: {device: cuda}}
        deployments:
          - name: EngineReplica
            max_ongoing_requests: 8
            autoscaling_config: {min_replicas: 1, max_replicas: 2}
""")


@pytest.mark.parametrize("old, new, expected", [
    ("max_ongoing_requests: 8", "max_ongoing_request: 8",
     "applications[0].deployments[0].max_ongoing_request: unknown field (Ray ignores it)"),
    ("max_replicas: 2", "max_replicas: two", "applications[0].deployments[0].autoscaling_config.max_replicas"),
    ("{device: cuda}", "{device: cuda, max_lora_rnk: 8}", "unexpected keyword argument 'max_lora_rnk'"),
    ("args: {model", "args: {modle: x, model", "applications[0].args: unknown config key 'modle'"),
])
def test_broken_serve_config(old, new, expected):
    assert check_serve_config(SERVE, "serve") == []
    problems = check_serve_config(SERVE.replace(old, new), "serve")
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_broken_overlay_fails_the_command_line_check(kubectl_path, tmp_path, capsys):
    base = os.path.relpath(K8S / "base", tmp_path)  # kustomize refuses absolute paths
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{base}]\npatches: [{{path: patch.yaml}}]\n")
    (tmp_path / "patch.yaml").write_text(textwrap.dedent("""\
        apiVersion: ray.io/v1
        kind: RayService
        metadata: {name: adapterserve}
        spec:
          rayClusterConfig:
            enableInTreeAutoscalng: true
            headGroupSpec: {enableIngress: "yes"}
    """))
    assert vm.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "spec.rayClusterConfig.enableInTreeAutoscalng: unknown field" in err
    assert "spec.rayClusterConfig.headGroupSpec.enableIngress: 'yes' is not of type 'boolean'" in err


def test_strict_keeps_open_what_the_crd_leaves_open():
    import jsonschema

    schema = strict({"type": "object", "properties": {
        "closed": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "open": {"type": "object", "properties": {"a": {}}, "x-kubernetes-preserve-unknown-fields": True},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "list": {"type": "array", "items": {"type": "object", "properties": {"a": {}}}},
    }})
    valid = jsonschema.Draft202012Validator(schema).is_valid
    assert valid({"closed": {"a": 1}, "open": {"b": 1}, "labels": {"any": "x"}, "list": [{"a": 1}]})
    assert not valid({"closed": {"b": 1}})
    assert not valid({"list": [{"b": 1}]})
    assert not valid({"other": 1})


def test_serve_config_that_does_not_fit_the_pods(rayservices):
    doc = copy.deepcopy(rayservices["base"])
    doc["spec"]["serveConfigV2"] = (doc["spec"]["serveConfigV2"]
                                    .replace("port: 50051", "port: 9000")
                                    .replace("max_replicas: 4", "max_replicas: 5")
                                    .replace("model: /models/", "model: /data/"))
    assert [p.split(": ", 1)[1] for p in vm.check_consistency(doc)] == [
        "head container port 'serve-grpc' is 50051, serveConfigV2 says 9000",
        "EngineReplica may want 5 GPUs, workers have at most 4 x 1",
        "args.model /data/Llama-3.2-1B-Instruct is on no volume of the worker pods "
        "(/models, /etc/adapterserve/keys, /var/cache/adapterserve, /tmp/ray, /dev/shm)",
    ]


def test_pods_that_would_be_killed_mid_drain(rayservices):
    doc = copy.deepcopy(rayservices["base"])
    doc["spec"]["serveConfigV2"] = doc["spec"]["serveConfigV2"].replace("drain_grace_s: 120", "drain_grace_s: 200")
    del doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert [p.split(": ", 1)[1] for p in vm.check_consistency(doc)] == [
        "head pods get terminationGracePeriodSeconds 30, not more than the 200 s their replicas may take to drain "
        "(drain_grace_s, graceful_shutdown_timeout_s)",
        "gpu pods get terminationGracePeriodSeconds 150, not more than the 200 s their replicas may take to drain "
        "(drain_grace_s, graceful_shutdown_timeout_s)",
    ]


def test_metrics_port_not_declared_or_not_reachable(rayservices):
    doc = copy.deepcopy(rayservices["base"])
    doc["spec"]["serveConfigV2"] = (doc["spec"]["serveConfigV2"].replace("port: 8090", "port: 9100")
                                    .replace("host: 0.0.0.0", "host: 127.0.0.1"))
    assert [p.split(": ", 1)[1] for p in vm.check_consistency(doc)] == [
        "args.metrics.port is 9100, but the head container's port 'as-metrics' is 8090: declare it there "
        "(the hub runs on the head)",
        "args.metrics.host is '127.0.0.1': set 0.0.0.0, or nothing outside the head pod can scrape the metrics port",
    ]


def _production(rendered, kind, name=None):
    docs = copy.deepcopy(rendered["overlays/production"])
    return docs, next(d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"]))


def test_pod_monitor_with_a_port_the_head_lacks_or_a_typo(rendered):
    docs, monitor = _production(rendered, "PodMonitor", "adapterserve")
    monitor["spec"]["podMetricsEndpoints"][0]["port"] = "as-metric"
    problems = check_references(docs)
    assert len(problems) == 1
    assert problems[0].startswith("PodMonitor/adapterserve: spec.podMetricsEndpoints[0].port 'as-metric' is no "
                                  "container port of RayService/adapterserve head (it has as-metrics, ")
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")
    assert vm.check_documents([monitor]) == [
        "PodMonitor/adapterserve: spec.podMetricEndpoints: unknown field 'podMetricEndpoints' "
        "(did you mean 'podMetricsEndpoints'?)"]
    monitor["apiVersion"] = "monitoring.coreos.com/v1beta1"
    assert vm.check_documents([monitor]) == [
        "PodMonitor/adapterserve: apiVersion must be monitoring.coreos.com/v1, got 'monitoring.coreos.com/v1beta1'"]


def test_pod_monitor_that_selects_nothing(rendered):
    docs, monitor = _production(rendered, "PodMonitor", "adapterserve")
    monitor["spec"]["selector"]["matchLabels"]["ray.io/node-type"] = "Head"
    [problem] = check_references(docs)
    assert problem.startswith("PodMonitor/adapterserve: spec.selector {app.kubernetes.io/name=adapterserve, "
                              "ray.io/node-type=Head} selects no pod (RayService/adapterserve head: {")


@pytest.mark.parametrize("edit, expected", [
    (lambda spec: spec.update(maxUnavailable=1) or spec.pop("minAvailable"),
     "KubeRay's RayCluster has no scale subresource: a budget of its pods needs an integer spec.minAvailable"),
    (lambda spec: spec.update(minAvailable="50%"), "needs an integer spec.minAvailable"),
    (lambda spec: spec.update(minAvailable=2),
     "spec.minAvailable 2 is not below the 2 pod(s) it selects at the least (RayService/adapterserve gpu): "
     "a node drain would wait for ever"),
    (lambda spec: spec["selector"]["matchLabels"].update({"ray.io/node-type": "head"}), "selects no pod"),
])
def test_budgets_that_would_block_drains_for_ever(rendered, edit, expected):
    docs, budget = _production(rendered, "PodDisruptionBudget")
    edit(budget["spec"])
    problems = check_references(docs)
    assert len(problems) == 1 and problems[0].startswith("PodDisruptionBudget/adapterserve-gpu-workers: ")
    assert expected in problems[0], problems
