"""Rendering a Kustomize directory with `kubectl kustomize`, and reading what it says."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent
K8S = DEPLOY / "k8s"
RAYSERVICE = "adapterserve"  # metadata.name of the RayService in every kustomization
WORKER_GROUP = "gpu"


class KubectlMissing(RuntimeError):
    """No usable kubectl on PATH."""


def kustomization_dirs() -> list[Path]:
    """The base and every overlay."""
    return [K8S / "base", *sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))]


def example_dirs() -> list[Path]:
    """The examples (k8s/examples/*): validated like the overlays, their serveConfigV2 written by hand."""
    return sorted(p.parent for p in (K8S / "examples").glob("*/kustomization.yaml"))


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        raise KubectlMissing("kubectl not found on PATH: install it with `bash scripts/install_kubectl.sh`")
    return found


def render(directory: str | Path) -> list[dict[str, Any]]:
    """The manifests `kubectl kustomize DIRECTORY` prints; RuntimeError with kubectl's message."""
    run = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed:\n{run.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [d for d in docs if d.get("kind") == kind and name in (None, d["metadata"].get("name"))]
    if len(matches) != 1:
        raise ValueError(f"expected one {kind} {name or ''} in the rendered manifests, found {len(matches)}")
    return matches[0]


def worker_group(rayservice: dict[str, Any]) -> dict[str, Any]:
    groups = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return next(g for g in groups if g["groupName"] == WORKER_GROUP)


def container(template: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in template["spec"]["containers"] if c["name"] == name)


@dataclass(frozen=True)
class DeployValues:
    """What a kustomization chose (its adapterserve-values, as copied into the RayService)."""

    model_path: str
    store_url: str
    gpus_per_worker: int
    min_workers: int
    max_workers: int
    tensor_parallel_size: int = 1  # GPUs per engine replica (one TP group, inside one worker pod)

    @property
    def replicas_per_worker(self) -> int:
        """Engine replicas one worker pod holds; ValueError when its GPUs do not split into TP groups."""
        if self.tensor_parallel_size < 1 or self.gpus_per_worker % self.tensor_parallel_size:
            raise ValueError(f"GPUS_PER_WORKER ({self.gpus_per_worker}) must be a multiple of TENSOR_PARALLEL_SIZE "
                             f"({self.tensor_parallel_size}): a tensor-parallel group runs inside one worker pod")
        return self.gpus_per_worker // self.tensor_parallel_size

    @classmethod
    def of(cls, rayservice: dict[str, Any]) -> DeployValues:
        notes = rayservice["metadata"].get("annotations", {})
        group = worker_group(rayservice)
        limits = container(group["template"], "ray-worker")["resources"]["limits"]
        return cls(
            model_path=notes["adapterserve/model-path"],
            store_url=notes["adapterserve/store-url"],
            gpus_per_worker=int(limits["nvidia.com/gpu"]),
            min_workers=int(group["minReplicas"]),
            max_workers=int(group["maxReplicas"]),
            tensor_parallel_size=int(notes.get("adapterserve/tensor-parallel-size", 1)),
        )
