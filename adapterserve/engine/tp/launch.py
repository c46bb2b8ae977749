"""Start a tensor-parallel group: rank 0 in this process, ranks 1..N-1 as workers.

With tensor_parallel_launch "ray" (or "auto" where Ray is initialized in this process)
the workers are Ray actors in a placement group (STRICT_PACK, one bundle per worker:
{"GPU": 1} on GPUs, a fraction of a CPU on CPU; or bundles 1..N-1 of this process's own
group, a Serve replica's), so a KubeRay worker pod with N GPUs holds the whole group;
this process (rank 0) keeps the device it has. Otherwise they are local processes
(spawned), worker r on cuda:(r + rank 0's index). Each connects back twice (commands,
adapters), then all join torch.distributed at a free port of this host.
"""
from __future__ import annotations

import logging
import multiprocessing
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener

import torch

from adapterserve.config import EngineConfig
from adapterserve.engine.tp import RAY_CPU_PER_WORKER
from adapterserve.engine.tp.group import (COLLECTIVE_TIMEOUT_S, check_devices, join_group, open_store,
                                          step_all_reduce_bytes)
from adapterserve.engine.tp.lockstep import Lockstep, WorkerLink
from adapterserve.engine.tp.stack_dump import dump_stacks_on_signal
from adapterserve.engine.tp.worker import ModelBuilder, WorkerSpec, run_worker
from adapterserve.errors import EngineBroken

log = logging.getLogger("adapterserve.engine")

_KILLED_WAIT_S = 10.0  # for a worker process to end after SIGKILL


def start_group(build_model: ModelBuilder, config: EngineConfig, placement: RayPlacement | None = None,
                hidden_size: int | None = None) -> Lockstep:
    """Workers started and connected, this process joined as rank 0 (its shard not yet
    loaded: load it with lockstep.tp, then lockstep.wait_ready()). ``placement``: the
    placement group to use, from another process (the workers are then Ray actors).
    ``hidden_size``: the backbone's, which sizes the symmetric all-reduce buffer (None: the
    largest message a symmetric path takes). This process, like each worker, then prints its
    threads' stacks on SIGUSR1 (stack_dump.py)."""
    dump_stacks_on_signal()
    size = config.tensor_parallel_size
    given = placement.group() if placement is not None else None
    ray = _ray_for("ray" if given is not None else config.tensor_parallel_launch)
    host = ray.util.get_node_ip_address() if ray is not None else "127.0.0.1"
    check_devices(size, config.device, _ray_gpus(ray) if ray is not None else None)
    authkey = secrets.token_bytes(32)
    listener = Listener((host, 0), authkey=authkey)
    try:
        store = open_store(host, size)
        group_address = f"tcp://{host}:{store.port}"
        all_reduce_bytes = step_all_reduce_bytes(config, hidden_size) if hidden_size else None
        specs = [WorkerSpec(build_model, config, rank, size, group_address, listener.address, authkey,
                            all_reduce_bytes) for rank in range(1, size)]
        if ray is not None:
            links = _connect(listener, _start_ray_workers(specs, config, given))
        else:
            links = _connect(listener, _start_local_workers(specs, config))
    finally:
        listener.close()
    try:
        tp = join_group(group_address, 0, size, config.device, config.tensor_parallel_all_reduce, all_reduce_bytes,
                        store)
    except BaseException:
        for link in links:
            link.stop(0.0)
        raise
    return Lockstep(tp, links)


# local processes


def _start_local_workers(specs: list[WorkerSpec], config: EngineConfig) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    starts = []
    for spec in specs:
        device = _local_device(config.device, spec.rank)
        process = context.Process(target=run_worker, args=(spec, device), name=f"adapterserve-tp{spec.rank}",
                                  daemon=True)
        process.start()
        starts.append({"rank": spec.rank, "describe": f"local process {process.pid}",
                       "exit_code": lambda p=process: p.exitcode, "stop": lambda wait, p=process: _stop(p, wait),
                       "pid": process.pid})
    return starts


def _local_device(device: str, rank: int) -> str:
    base = torch.device(device)
    if base.type != "cuda":
        return str(base)
    return f"cuda:{(base.index or 0) + rank}"


def _stop(process: multiprocessing.Process, wait_s: float) -> None:
    process.join(wait_s)
    if process.is_alive():
        process.kill()
        process.join(_KILLED_WAIT_S)  # a process inside a driver call ends only when the call returns
        if process.is_alive():
            log.warning("tensor-parallel worker process %s had not ended %.0f s after SIGKILL; going on without it",
                        process.pid, _KILLED_WAIT_S)


# Ray actors


def _ray_for(launch: str):
    """The ray module when the workers are Ray actors, else None."""
    if launch == "local":
        return None
    try:
        import ray
    except ImportError:
        ray = None
    if ray is not None and ray.is_initialized():
        return ray
    if launch == "ray":
        raise ValueError('tensor_parallel_launch="ray" needs Ray initialized in this process (ray.init() or a '
                         'Ray worker); use "local" for local processes')
    return None


def _ray_gpus(ray) -> float:
    return ray.cluster_resources().get("GPU", 0.0)


class _RayWorker:
    """The actor: runs a worker until it ends (its method call returns then)."""

    def run(self, spec: WorkerSpec, device: str) -> None:
        run_worker(spec, device)


def _start_ray_workers(specs: list[WorkerSpec], config: EngineConfig, given=None) -> list[dict]:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    on_gpu = torch.device(config.device).type == "cuda"
    group, first, owned = (given, 1, False) if given is not None else _worker_bundles(ray, len(specs) + 1, on_gpu)
    actor_class = ray.remote(_RayWorker)
    group_name = secrets.token_hex(4)
    starts = []
    for index, spec in enumerate(specs):
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=first + index)
        name = f"adapterserve-tp-{group_name}-rank{spec.rank}"
        actor = actor_class.options(name=name, num_gpus=1 if on_gpu else 0,
                                    num_cpus=0 if on_gpu else RAY_CPU_PER_WORKER, scheduling_strategy=strategy,
                                    max_restarts=0).remote()
        done = actor.run.remote(spec, "cuda:0" if on_gpu else "cpu")  # its bundle's one visible GPU
        starts.append({"rank": spec.rank, "describe": f"Ray actor {name}",
                       "exit_code": lambda d=done: _ray_exit_code(ray, d), "running_code": _unknown,
                       "stop": lambda wait, a=actor, d=done, last=index == len(specs) - 1: _stop_actor(
                           ray, a, d, wait, group if last and owned else None)})
    return starts


def _worker_bundles(ray, size: int, on_gpu: bool):
    """(placement group, first worker bundle, whether it is ours to remove): bundles 1..N-1
    of this process's own placement group when it has N (a Serve replica given
    placement_group_bundles), else a new group of N-1 bundles."""
    from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group

    current = get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= size:
        return current, 1, False
    bundle = {"GPU": 1} if on_gpu else {"CPU": RAY_CPU_PER_WORKER}
    group = placement_group([dict(bundle) for _ in range(size - 1)], strategy="STRICT_PACK")
    ready, _ = ray.wait([group.ready()], timeout=COLLECTIVE_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise ValueError(f"Ray could not place {size - 1} tensor-parallel workers of {bundle} on one node within "
                         f"{COLLECTIVE_TIMEOUT_S:.0f} s; the cluster has {ray.available_resources()} free")
    return group, 0, True


def _ray_exit_code(ray, done) -> int | None:
    finished, _ = ray.wait([done], timeout=0)
    if not finished:
        return None
    try:
        ray.get(finished[0])
        return 0
    except Exception:
        return 1


def _stop_actor(ray, actor, done, wait_s: float, group) -> None:
    ray.wait([done], timeout=wait_s)
    ray.kill(actor)
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)


# the command connections


def _connect(listener: Listener, starts: list[dict]) -> list[WorkerLink]:
    """Accept every worker's connection; EngineBroken (and the workers stopped) if one exits first or is late."""
    accepted: queue.Queue[Connection | BaseException] = queue.Queue()

    def accept() -> None:
        for _ in range(2 * len(starts)):
            try:
                accepted.put(listener.accept())
            except BaseException as exc:  # the listener closed: given up
                accepted.put(exc)
                return

    threading.Thread(target=accept, name="tp-accept", daemon=True).start()
    conns: list[Connection] = []
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
    try:
        while len(conns) < 2 * len(starts):
            _check_started(starts, deadline)
            try:
                got = accepted.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(got, BaseException):
                raise EngineBroken(f"tensor-parallel workers could not connect: {got}")
            conns.append(got)
    except BaseException:
        for start in starts:
            start["stop"](0.0)
        raise
    return _links(conns, starts)


def _check_started(starts: list[dict], deadline: float) -> None:
    for start in starts:
        code = start["exit_code"]()
        if code is not None:
            raise EngineBroken(f"tensor-parallel worker {start['rank']} ({start['describe']}) exited with code "
                               f"{code} before it connected")
    if time.monotonic() > deadline:
        raise EngineBroken(f"tensor-parallel workers did not connect within {COLLECTIVE_TIMEOUT_S:.0f} s")


def _links(conns: list[Connection], starts: list[dict]) -> list[WorkerLink]:
    """Connections come in any order: each worker names its rank and the channel (commands,
    adapters) first; the adapters channel's hello also names the worker's host."""
    by_key, hosts = {}, {}
    for conn in conns:
        rank, channel, *host = conn.recv()
        by_key[rank, channel] = conn
        if host:
            hosts[rank] = host[0]
    return [WorkerLink(s["rank"], by_key[(s["rank"], "commands")], by_key[(s["rank"], "adapters")], s["describe"],
                       s.get("running_code", s["exit_code"]), s["stop"], s.get("pid"), hosts.get(s["rank"]))
            for s in starts]


def _unknown() -> None:
    """A Ray worker's exit code while it serves: not asked each step (a Ray call); its death
    shows as its closed connection."""
    return None



@dataclass(frozen=True)
class RayPlacement:
    """Where a process that is no Ray actor (a replica's engine child) places its workers:
    the cluster's address and the placement group whose bundles 1..N-1 hold them (the
    replica's own group; bundle 0 is the replica's)."""

    address: str
    placement_group_id: str  # hex

    @classmethod
    def of_this_actor(cls) -> RayPlacement | None:
        """This Ray actor's cluster and placement group (None outside an actor in a group)."""
        ray = _ray_for("auto")
        if ray is None:
            return None
        from ray.util.placement_group import get_current_placement_group

        group = get_current_placement_group()
        if group is None:
            return None
        return cls(ray.get_runtime_context().gcs_address, group.id.hex())

    def group(self):
        """Join the cluster (if this process has not) and return the placement group."""
        import ray
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup

        if not ray.is_initialized():
            ray.init(address=self.address, configure_logging=False, log_to_driver=False)
        return PlacementGroup(PlacementGroupID(bytes.fromhex(self.placement_group_id)))
