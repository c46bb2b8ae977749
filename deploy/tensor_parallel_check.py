"""What a tensor-parallel engine needs of the worker pods, checked offline (validate_manifests).

A TP group (engine `tensor_parallel_size` GPUs: the replica's own and its workers',
placed by a Ray placement group) lives inside one worker pod: the pod's GPUs split
into whole groups. NCCL's intra-node transport and Ray's object store use /dev/shm, whose
container default (64 MiB) makes NCCL fail or fall back slowly: the worker mounts an
emptyDir of medium Memory there, of at least SHM_PER_GPU per GPU of the pod (it counts
against the container's memory limit).
"""
from __future__ import annotations

import re
from typing import Any

SHM_PER_GPU = 4 << 30
ENGINE_DEPLOYMENT = "EngineReplica"
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def tensor_parallel_size(app: dict[str, Any]) -> int:
    return int(((app.get("args") or {}).get("engine") or {}).get("tensor_parallel_size", 1))


def replica_gpus(deployment: dict[str, Any], engine: dict[str, Any] | None) -> float:
    """GPUs one replica of a Serve deployment takes: its placement group's bundles, as given or
    as the application places a tensor-parallel engine (`engine`: its engine settings), else
    its actor's GPUs."""
    actor = deployment.get("ray_actor_options") or {}
    bundles = deployment.get("placement_group_bundles")
    if not bundles and engine is not None:
        from adapterserve.server.engine_process.placement import replica_placement  # imports torch

        bundles = replica_placement(engine, actor).get("placement_group_bundles")
    if bundles:
        return sum(b.get("GPU", 0) for b in bundles)
    return actor.get("num_gpus", 0)


def quantity_bytes(quantity: str | int) -> int:
    """A Kubernetes quantity ("64Gi", "8G", 1024) in bytes; ValueError when it is not one."""
    found = re.fullmatch(r"(\d+)(|k|M|G|T|Ki|Mi|Gi|Ti)", str(quantity))
    if found is None:
        raise ValueError(f"not a Kubernetes quantity: {quantity!r}")
    return int(found.group(1)) * _UNITS[found.group(2)]


def check_tensor_parallel(template: dict[str, Any], gpus: int, serve: dict[str, Any], where: str) -> list[str]:
    """Problems of the engine pods (`template`, `gpus` each) for the Serve config's TP size."""
    problems = []
    for app in serve["applications"]:
        tp = tensor_parallel_size(app)
        if tp == 1:
            continue
        if gpus % tp:
            problems.append(f"{where}: engine tensor_parallel_size {tp} does not divide the {gpus} GPUs of a worker "
                            "pod: a tensor-parallel group runs inside one pod (GPUS_PER_WORKER a multiple of "
                            "TENSOR_PARALLEL_SIZE)")
        problems += _check_shm(template, gpus, where)
    return list(dict.fromkeys(problems))


def _check_shm(template: dict[str, Any], gpus: int, where: str) -> list[str]:
    spec = template["spec"]
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0].get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    need = gpus * SHM_PER_GPU
    empty = (volumes.get(mounts.get("/dev/shm")) or {}).get("emptyDir")
    if empty is None or empty.get("medium") != "Memory":
        return [f"{where}: tensor-parallel worker pods need an emptyDir of medium Memory at /dev/shm for NCCL "
                f"(at least {need >> 30}Gi for {gpus} GPUs)"]
    limit = empty.get("sizeLimit")
    if limit is not None and quantity_bytes(limit) < need:
        return [f"{where}: /dev/shm of the tensor-parallel worker pods is {limit}; NCCL and Ray's object store "
                f"want at least {need >> 30}Gi for {gpus} GPUs ({SHM_PER_GPU >> 30}Gi per GPU)"]
    return []
