"""The tensor-parallel overlay (one engine over the four GPUs of a worker pod): valid as
rendered, its Serve config carrying the TP size (from which the app places the replica's
group: server/engine_process/placement.py), its pods
/dev/shm in memory; and the checks that refuse a TP group that cannot run (GPUs that do not
split into groups, a missing or small /dev/shm)."""
from __future__ import annotations

import copy

import pytest
import yaml

from deploy import render_serve_config as rsc
from deploy import validate_manifests as vm
from deploy.kustomize import DeployValues, container, worker_group
from deploy.references import check_references
from adapterserve.server.engine_process.placement import replica_placement
from deploy.tensor_parallel_check import quantity_bytes

TP = "overlays/tensor-parallel-4"


def _volume(service: dict, name: str) -> dict:
    return next(v for v in worker_group(service)["template"]["spec"]["volumes"] if v["name"] == name)


def test_the_overlay_renders_valid(rendered, rayservices):
    assert {d["kind"] for d in rendered[TP]} == {"RayService", "ConfigMap", "PodDisruptionBudget", "PodMonitor"}
    assert vm.check_documents(rendered[TP]) == []
    assert vm.check_consistency(rayservices[TP]) == []
    assert check_references(rendered[TP]) == []


def test_one_engine_replica_spans_the_four_gpus_of_a_worker(rayservices):
    from ray.serve.schema import ServeDeploySchema

    service = rayservices[TP]
    values = DeployValues.of(service)
    assert (values.gpus_per_worker, values.tensor_parallel_size, values.replicas_per_worker) == (4, 4, 1)
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve == rsc.with_values(yaml.safe_load(rsc.SERVE_CONFIG.read_text()), values)
    ServeDeploySchema.model_validate(serve)
    app = rsc.application(serve)
    assert app["args"]["engine"]["tensor_parallel_size"] == 4
    engine = rsc.deployment(app, rsc.ENGINE)
    placed = replica_placement(app["args"]["engine"], engine["ray_actor_options"])  # what build_app gives it
    assert placed["placement_group_bundles"] == [{"CPU": 2, "GPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}]
    assert placed["placement_group_strategy"] == "STRICT_PACK"
    scaling = engine["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 2)  # = worker pods


def test_the_workers_have_shared_memory_for_nccl(rayservices):
    service = rayservices[TP]
    worker = container(worker_group(service)["template"], "ray-worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    assert _volume(service, "dshm")["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert quantity_bytes(worker["resources"]["limits"]["memory"]) > quantity_bytes("64Gi")


def test_the_base_stays_one_gpu_per_engine(rayservices):
    values = DeployValues.of(rayservices["base"])
    assert (values.tensor_parallel_size, values.replicas_per_worker) == (1, 1)
    assert "tensor_parallel_size" not in rsc.application(yaml.safe_load(rsc.SERVE_CONFIG.read_text()))["args"]["engine"]


def _problems(doc: dict) -> list[str]:
    return [p.split(": ", 1)[1] for p in vm.check_consistency(doc)]


def test_gpus_that_do_not_split_into_groups_are_refused(rayservices):
    doc = copy.deepcopy(rayservices[TP])
    limits = container(worker_group(doc)["template"], "ray-worker")["resources"]["limits"]
    limits["nvidia.com/gpu"] = 6
    assert _problems(doc) == ["engine tensor_parallel_size 4 does not divide the 6 GPUs of a worker pod: a "
                              "tensor-parallel group runs inside one pod (GPUS_PER_WORKER a multiple of "
                              "TENSOR_PARALLEL_SIZE)"]
    with pytest.raises(ValueError, match=r"GPUS_PER_WORKER \(6\) must be a multiple of TENSOR_PARALLEL_SIZE \(4\)"):
        DeployValues(**{**DeployValues.of(rayservices[TP]).__dict__, "gpus_per_worker": 6}).replicas_per_worker


def test_more_engines_than_the_workers_hold_are_refused(rayservices):
    doc = copy.deepcopy(rayservices[TP])
    doc["spec"]["serveConfigV2"] = doc["spec"]["serveConfigV2"].replace("max_replicas: 2", "max_replicas: 3")
    assert _problems(doc) == ["EngineReplica may want 12 GPUs, workers have at most 2 x 4"]


@pytest.mark.parametrize("shm, says", [
    ({"sizeLimit": "64Gi"}, "tensor-parallel worker pods need an emptyDir of medium Memory at /dev/shm for NCCL "
                            "(at least 16Gi for 4 GPUs)"),
    ({"medium": "Memory", "sizeLimit": "8Gi"}, "/dev/shm of the tensor-parallel worker pods is 8Gi; NCCL and "
                                               "Ray's object store want at least 16Gi for 4 GPUs (4Gi per GPU)"),
])
def test_a_missing_or_small_shared_memory_is_refused(rayservices, shm, says):
    doc = copy.deepcopy(rayservices[TP])
    _volume(doc, "dshm")["emptyDir"] = shm
    assert _problems(doc) == [says]


def test_quantities():
    assert [quantity_bytes(q) for q in ("64Gi", "8G", 1024, "512Mi")] == [64 << 30, 8 * 10**9, 1024, 512 << 20]
    with pytest.raises(ValueError, match="not a Kubernetes quantity: '2 GB'"):
        quantity_bytes("2 GB")
