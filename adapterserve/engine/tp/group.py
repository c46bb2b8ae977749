"""The torch.distributed group of a tensor-parallel engine, and the checks of its size."""
from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from adapterserve.config import EngineConfig
from adapterserve.layers.parallel import TensorParallel
from adapterserve.layers.symm_allreduce import symmetric_all_reduce

# How long a rank waits in a collective (or for a step's results) before its group counts
# as broken: longer than any one kernel compile or graph capture at warm-up.
COLLECTIVE_TIMEOUT_S = 300.0
LEAVE_WAIT_S = 30.0  # rank 0's leaving of the group at close; past it, the close goes on without waiting more


def open_store(host: str, world_size: int) -> dist.TCPStore:
    """Rank 0's store for a new group, listening now on a port the OS picks (``.port``): bound
    before the workers start, so that no process started meanwhile can take the port."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                         wait_for_workers=False)


def _store_at(address: str, world_size: int) -> dist.TCPStore:
    """A worker's connection to rank 0's store at ``address`` (tcp://host:port)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return dist.TCPStore(host.strip("[]"), int(port), world_size, is_master=False,
                         timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def join_group(address: str, rank: int, world_size: int, device: str, all_reduce: str = "nccl",
               all_reduce_bytes: int | None = None, store: dist.TCPStore | None = None) -> TensorParallel:
    """Join the group at ``address`` (tcp://host:port, rank 0's store; ``store``: rank 0's own,
    from open_store; or any init_method torch takes, as tests' file://): NCCL on CUDA devices
    (this process's device set first), gloo on CPU. ``all_reduce``
    (EngineConfig.tensor_parallel_all_reduce): "nccl", the group's own; "auto",
    sums over symmetric memory where the GPUs allow it, with a buffer for messages of up to
    ``all_reduce_bytes`` (see step_all_reduce_bytes)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: a tensor-parallel engine "
                           "needs a process of its own (one engine of tensor_parallel_size > 1 per process)")
    place = torch.device(device)
    if place.type == "cuda" and place.index is not None:
        torch.cuda.set_device(place)
    if store is None and address.startswith("tcp://"):  # a worker: rank 0's store, joined as rank 0 joins it
        store = _store_at(address, world_size)
    rendezvous = {"store": store} if store is not None else {"init_method": address}  # file://: tests
    dist.init_process_group("nccl" if place.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), **rendezvous)
    if place.type == "cuda":  # NCCL makes its communicator at the first collective: now, not inside a graph capture
        dist.all_reduce(torch.zeros(1, device=place))
        torch.cuda.synchronize()
    symmetric = symmetric_all_reduce(dist.group.WORLD, place, all_reduce_bytes, all_reduce)
    return TensorParallel(rank, world_size, dist.group.WORLD, symmetric)


def step_all_reduce_bytes(config: EngineConfig, hidden_size: int) -> int:
    """The largest all-reduce of a step: a full batch of hidden states."""
    element = torch.empty(0, dtype=config.torch_dtype).element_size()
    return config.max_num_batched_tokens * hidden_size * element


def leave_group(abort: bool = False, tp: TensorParallel | None = None) -> None:
    """Destroy this process's group; ``abort``: its NCCL communicators aborted first (a peer
    died: collectives still queued would otherwise never return) and, beside that, ``tp``'s
    symmetric all-reduce kernels still queued released (SymmetricAllReduce.release_peers)."""
    if not dist.is_initialized():
        return
    if abort and dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        # beside the abort, which may itself wait on a stream held up by a symmetric kernel
        releasing = None
        if tp is not None and tp.symmetric is not None:
            releasing = threading.Thread(target=tp.symmetric.release_peers, name="tp-release", daemon=True)
            releasing.start()
        _abort_process_group()  # torch's abort of every communicator; destroys the group too
        if releasing is not None:
            releasing.join()
        return
    dist.destroy_process_group()


def leave_in_background(abort: bool, tp: TensorParallel | None) -> threading.Thread:
    """leave_group on a daemon thread, started now: at close every rank leaves at the same
    time (a group's teardown may wait for its peers'), and rank 0 can bound its wait (join)."""
    leaving = threading.Thread(target=leave_group, kwargs={"abort": abort, "tp": tp}, name="tp-leave", daemon=True)
    leaving.start()
    return leaving


def check_devices(size: int, device: str, ray_gpus: float | None = None) -> None:
    """ValueError when there are fewer GPUs (or CPU cores, on CPU) than ranks. ``ray_gpus``:
    the Ray cluster's GPUs when the workers are placed by Ray; else local workers take the
    GPUs after rank 0's (cuda:i+1, ...), which this host must have."""
    place = torch.device(device)
    if place.type == "cuda":
        if ray_gpus is not None:
            have, where = int(ray_gpus), "the Ray cluster has"
        else:
            have, where = torch.cuda.device_count() - (place.index or 0), f"this host has from {place} on"
        if have < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs, one per rank, but {where} {have}")
        return
    cores = os.cpu_count() or 1
    if size > cores:
        raise ValueError(f"tensor_parallel_size {size} on CPU needs a core per rank, but this host has {cores}")
