"""Resources of a tensor-parallel engine replica: Serve reserves one bundle per rank on one
node (STRICT_PACK), the replica in bundle 0 and the workers in bundles 1..N-1, so the
whole group lands on one node (a KubeRay worker pod with N GPUs)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapterserve.engine.tp import RAY_CPU_PER_WORKER


def tensor_parallel_size(engine_kwargs: Mapping[str, Any]) -> int:
    return int(engine_kwargs.get("tensor_parallel_size", 1) or 1)


def replica_placement(engine_kwargs: Mapping[str, Any], actor_options: Mapping[str, Any]) -> dict[str, Any]:
    """Serve deployment options placing an engine replica of tensor_parallel_size N > 1 ({} for 1):
    bundle 0 holds the replica's own actor options, each other bundle a worker (1 GPU on
    cuda, nothing on CPU: the workers then take a sliver of a CPU)."""
    size = tensor_parallel_size(engine_kwargs)
    if size <= 1:
        return {}
    on_gpu = str(engine_kwargs.get("device", "cpu")).startswith("cuda")
    own = {"CPU": float(actor_options.get("num_cpus", 1) or 0), "GPU": float(actor_options.get("num_gpus", 0) or 0)}
    own.update(actor_options.get("resources") or {})
    own = {name: amount for name, amount in own.items() if amount} or {"CPU": RAY_CPU_PER_WORKER}  # Ray refuses empty bundles
    worker = {"GPU": 1.0} if on_gpu else {"CPU": RAY_CPU_PER_WORKER}
    return {"placement_group_bundles": [own] + [dict(worker) for _ in range(size - 1)],
            "placement_group_strategy": "STRICT_PACK"}


def child_placement(engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Engine keyword arguments for an engine child process of a tensor-parallel replica: the
    replica's cluster and placement group, where the child's workers go ({} otherwise)."""
    if tensor_parallel_size(engine_kwargs) <= 1:
        return {}
    from adapterserve.engine.tp.launch import RayPlacement  # torch: only a tensor-parallel replica needs it

    placement = RayPlacement.of_this_actor()
    return {"placement": placement} if placement is not None else {}
