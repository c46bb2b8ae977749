"""deploy/k8s/examples/gateway: valid as rendered, and the InferencePool that the
`inferencepool` chart makes from inferencepool-values.yaml selects the endpoint pods, each a
server of its own, on a port they listen on. (No cluster here: nothing is applied.)"""
from __future__ import annotations

import yaml

from deploy.kustomize import K8S, find, render
from deploy.references import check_references
from deploy.selection import pod_groups, selected
from deploy.validate_manifests import check_consistency, check_documents

EXAMPLE = K8S / "examples" / "gateway"
POOL = "adapterserve-pool"  # the Helm release name


def pool_from_values(values: dict) -> dict:
    """The InferencePool the chart (v1.5.0, templates/inferencepool.yaml) renders."""
    pool = values["inferencePool"]
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": "adapterserve-gateway"},
            "spec": {"targetPorts": [{"number": p["number"]} for p in pool["targetPorts"]],
                     "appProtocol": "http",
                     "selector": {"matchLabels": pool["modelServers"]["matchLabels"]},
                     "endpointPickerRef": {"name": f"{POOL}-epp", "port": {"number": 9002},
                                           "failureMode": values["inferenceExtension"]["failureMode"]}}}


def test_the_example_renders_valid(kubectl_path):
    docs = render(EXAMPLE)
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "HTTPRoute", "InferenceModelRewrite", "RayService",
                                               "RayService"]
    assert check_documents(docs) == []
    for doc in docs:
        if doc["kind"] == "RayService":
            assert check_consistency(doc) == []
    assert check_references(docs) == []


def test_each_endpoint_is_one_server_and_the_pool_selects_them(kubectl_path):
    docs = render(EXAMPLE)
    pool = pool_from_values(yaml.safe_load((EXAMPLE / "inferencepool-values.yaml").read_text()))
    assert check_documents([pool]) == []
    assert check_references([*docs, pool]) == []
    chosen = selected(pool["spec"]["selector"], pod_groups(docs))
    assert [g.where for g in chosen] == ["RayService/adapterserve-endpoint-a head",
                                         "RayService/adapterserve-endpoint-b head"]
    for doc in docs:
        if doc["kind"] == "RayService":
            assert "workerGroupSpecs" not in doc["spec"]["rayClusterConfig"]  # the head is the whole server
    route = find(docs, "HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == POOL
    assert find(docs, "InferenceModelRewrite")["spec"]["poolRef"]["name"] == POOL


def test_a_pool_that_selects_other_pods_fails(kubectl_path):
    docs = render(EXAMPLE)
    pool = pool_from_values(yaml.safe_load((EXAMPLE / "inferencepool-values.yaml").read_text()))
    pool["spec"]["targetPorts"][0]["number"] = 8080 + 1
    assert check_references([*docs, pool]) == [
        f"InferencePool/adapterserve-pool: spec.targetPorts[0].number 8081 is no container port of "
        f"RayService/adapterserve-endpoint-{x} head" for x in "ab"]
    pool["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "server"
    [problem] = check_references([*docs, pool])
    assert "spec.selector" in problem and "selects no pod" in problem
