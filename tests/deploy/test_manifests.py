"""The manifests users apply: valid as rendered, and carrying serve_config.yaml."""
from __future__ import annotations

import pytest
import yaml

from deploy import render_serve_config as rsc
from deploy.kustomize import DeployValues, container, find, worker_group
from deploy.references import check_references
from deploy.selection import pod_groups, selected
from deploy.validate_manifests import check_consistency, check_documents, check_examples

DIRS = ["base", "overlays/production"]
KINDS = {"base": {"RayService", "ConfigMap", "PodDisruptionBudget"},
         "overlays/production": {"RayService", "ConfigMap", "PodDisruptionBudget", "PodMonitor"}}


@pytest.mark.parametrize("name", DIRS)
def test_every_rendered_manifest_is_valid(rendered, rayservices, name):
    assert {d["kind"] for d in rendered[name]} == KINDS[name]
    assert check_documents(rendered[name]) == []
    assert check_consistency(rayservices[name]) == []
    assert check_references(rendered[name]) == []


def test_the_hub_is_scraped_once_on_the_head(rendered, rayservices):
    """The PodMonitor selects the head alone, on the port the Serve config's metrics hub listens on."""
    docs = rendered["overlays/production"]
    monitor = find(docs, "PodMonitor", "adapterserve")
    chosen = selected(monitor["spec"]["selector"], pod_groups(docs))
    assert [g.where for g in chosen] == ["RayService/adapterserve head"]
    head = container(rayservices["overlays/production"]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"],
                     "ray-head")
    port = next(p["containerPort"] for p in head["ports"] if p["name"] == monitor["spec"]["podMetricsEndpoints"][0]["port"])
    args = rsc.application(yaml.safe_load(rayservices["overlays/production"]["spec"]["serveConfigV2"]))["args"]
    assert args["metrics"] == {"port": port, "host": "0.0.0.0"}


def test_the_budget_keeps_workers_in_drains_but_never_blocks_them(rendered, rayservices):
    docs = rendered["overlays/production"]
    budget = find(docs, "PodDisruptionBudget")
    chosen = selected(budget["spec"]["selector"], pod_groups(docs))
    assert [g.where for g in chosen] == ["RayService/adapterserve gpu"]
    assert budget["spec"]["minAvailable"] == 1 < worker_group(rayservices["overlays/production"])["minReplicas"]
    assert find(rendered["base"], "PodDisruptionBudget")["spec"]["minAvailable"] == 0


def test_the_dashboard_configmap_is_the_json(rendered):
    from deploy.kustomize import DEPLOY

    dashboard = find(rendered["overlays/production"], "ConfigMap", "adapterserve-dashboard")
    assert dashboard["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert dashboard["data"] == {"adapterserve.json": (DEPLOY / "grafana" / "adapterserve.json").read_text()}


def test_base_embeds_serve_config_exactly(rayservices):
    from ray.serve.schema import ServeDeploySchema

    embedded = rayservices["base"]["spec"]["serveConfigV2"]
    assert embedded == rsc.SERVE_CONFIG.read_text()
    ServeDeploySchema.model_validate(yaml.safe_load(embedded))


def test_overlay_embeds_serve_config_with_its_values(rayservices):
    from ray.serve.schema import ServeDeploySchema

    service = rayservices["overlays/production"]
    values = DeployValues.of(service)
    assert values != DeployValues.of(rayservices["base"]), "the overlay should change something to test"
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert embedded == rsc.with_values(yaml.safe_load(rsc.SERVE_CONFIG.read_text()), values)
    ServeDeploySchema.model_validate(embedded)
    scaling = rsc.deployment(rsc.application(embedded), rsc.ENGINE)["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (2, 8)
    assert rsc.application(embedded)["args"]["model"] == "/models/Llama-3.1-8B-Instruct"


def test_overlay_sets_image_namespace_and_gpus(rayservices):
    service = rayservices["overlays/production"]
    cluster = service["spec"]["rayClusterConfig"]
    head = container(cluster["headGroupSpec"]["template"], "ray-head")
    worker = container(worker_group(service)["template"], "ray-worker")
    assert head["image"] == worker["image"] == "registry.example.com/ml/adapterserve:0.1.0"
    assert service["metadata"]["namespace"] == "adapterserve"
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"]


def test_generated_serve_config_patches_are_up_to_date(kubectl_path, capsys):
    assert rsc.main(["--check"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", DIRS)
def test_secrets_only_by_reference(rendered, rayservices, name):
    assert "Secret" not in {d["kind"] for d in rendered[name]}
    cluster = rayservices[name]["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        for c in group["template"]["spec"]["containers"]:
            for var in c.get("env", []):
                if var["name"].startswith("AWS_"):
                    assert "secretKeyRef" in var.get("valueFrom", {}), f"{var['name']} must come from a Secret"


def test_secret_example_is_valid():
    assert check_examples() == []


def test_serve_config_registers_the_servicers_adapterserve_serve_does():
    from adapterserve.server.launch import GRPC_SERVICER_FUNCTIONS

    config = yaml.safe_load(rsc.read_serve_config())
    assert config["grpc_options"]["grpc_servicer_functions"] == GRPC_SERVICER_FUNCTIONS
