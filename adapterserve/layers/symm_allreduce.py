"""The tensor-parallel sum all-reduce over symmetric (peer-to-peer) memory.

Every rank owns one buffer, allocated once per group and mapped into every peer's
address space (torch.distributed._symmetric_memory, CUDA backend: cuMem handles shared
between the processes). A small message runs as one kernel, one-shot: each rank copies
its partial sums into its buffer, the ranks meet at a barrier of signal flags, and each
reads every peer's buffer over NVLink and sums. A middle-sized one runs two-shot (each
rank reduces a 1/N slice, then gathers the others' slices). Larger messages, other
dtypes, and groups where the buffer cannot be made go to the group's own all-reduce
(NCCL). No multicast (NVLS) object is made or used: only torch's peer-to-peer ops.

Every path is capturable in a CUDA graph: the buffer exists before any capture, the
kernels take their output as an argument and allocate nothing, and the barrier flags are
reset by the kernels that set them, so replays repeat the same protocol.
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("adapterserve.layers")

MiB = 1 << 20
ONE_SHOT = "one_shot"
TWO_SHOT = "two_shot"
NCCL = "nccl"  # the group's own all-reduce (gloo on CPU)
CHOICES = ("auto", NCCL)  # EngineConfig.tensor_parallel_all_reduce
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)  # what torch's one-/two-shot kernels reduce
ALIGNMENT = 16  # bytes: the kernels' vector width; messages must start on it

# Largest message (bytes) each path takes, by world size; above them NCCL runs. One-shot
# reads (N-1) copies of the message per rank, two-shot about 2 (N-1)/N, so one-shot wins
# for small messages and the crossover falls as N grows. 2 and 4: from benchmarks/allreduce_micro.py
# on H100s (BENCHMARKS.md); 8: extrapolated (halved again).
ONE_SHOT_MAX_BYTES = {2: 1 * MiB, 4: 512 * 1024, 8: 256 * 1024}
ONE_SHOT_MAX_BYTES_OTHER = 256 * 1024  # world sizes not in the table
TWO_SHOT_MAX_BYTES = 16 * MiB
TWO_SHOT_WORLD_SIZES = (2, 4, 8)  # torch's two-shot kernel is built for these only
RELEASE_TIMEOUT_S = 30.0  # release_peers: how long queued kernels (and an NCCL abort) may take to drain


def one_shot_max_bytes(world_size: int) -> int:
    return ONE_SHOT_MAX_BYTES.get(world_size, ONE_SHOT_MAX_BYTES_OTHER)


def largest_symmetric_message(world_size: int) -> int:
    """The most bytes a message may have to take a symmetric path at this world size."""
    two_shot = TWO_SHOT_MAX_BYTES if world_size in TWO_SHOT_WORLD_SIZES else 0
    return max(one_shot_max_bytes(world_size), two_shot)


def choose_path(nbytes: int, dtype: torch.dtype, aligned: bool, world_size: int, capacity: int) -> str:
    """ONE_SHOT, TWO_SHOT or NCCL for a sum all-reduce of ``nbytes`` of ``dtype`` (``aligned``:
    contiguous, starting on ALIGNMENT bytes) with a symmetric buffer of ``capacity`` bytes.
    Every rank must choose alike (they run the same step): it reads nothing rank-specific."""
    if dtype not in SYMMETRIC_DTYPES or not aligned or nbytes <= 0 or nbytes % 4 or nbytes > capacity:
        return NCCL
    if nbytes <= one_shot_max_bytes(world_size):
        return ONE_SHOT
    if world_size in TWO_SHOT_WORLD_SIZES and nbytes <= TWO_SHOT_MAX_BYTES:
        return TWO_SHOT
    return NCCL


class SymmetricAllReduce:
    """A group's symmetric buffer and the sum all-reduces that run over it.

    ``taken`` counts the sum all-reduces offered to it by path (NCCL for those it declined);
    a call made while a CUDA graph is captured counts once, not per replay."""

    def __init__(self, group: Any, buffer: torch.Tensor, pads: list[torch.Tensor] | None) -> None:
        self.group_name: str = group.group_name
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.buffer = buffer  # uint8 [capacity]; viewed as each message's dtype
        self.capacity = buffer.numel()
        self.pads = pads  # every rank's barrier flags (int32, [blocks, world] slots), mapped here
        if pads is not None:
            self._load_drain_kernel()
        self.taken: Counter[str] = Counter()
        ops = torch.ops.symm_mem
        self._one_shot_copy = getattr(ops, "one_shot_all_reduce_copy_out", None)  # copies x in: one launch
        self._one_shot = ops.one_shot_all_reduce_out
        self._two_shot = ops.two_shot_all_reduce_out

    @classmethod
    def create(cls, group: Any, device: torch.device, capacity: int) -> SymmetricAllReduce:
        """Allocate and rendezvous a buffer of ``capacity`` bytes on every rank of ``group``
        (collective: every rank calls it at the same point, outside any graph capture).
        Raises RuntimeError where peer memory cannot be mapped."""
        _torch_settings()
        from torch.distributed import _symmetric_memory as symm_mem

        capacity = -(-capacity // ALIGNMENT) * ALIGNMENT
        buffer = symm_mem.empty(capacity, dtype=torch.uint8, device=device)
        handle = _rendezvous(symm_mem, buffer, group)
        _check_peers_mapped(handle, buffer, group)
        return cls(group, buffer, _signal_pads(handle, dist.get_world_size(group)))

    def all_reduce_(self, x: torch.Tensor) -> bool:
        """Sum x over the ranks in place when a symmetric path takes it; False (x untouched)
        when the caller must run the group's all-reduce instead."""
        path = choose_path(x.numel() * x.element_size(), x.dtype, _aligned(x), self.world_size, self.capacity)
        self.taken[path] += 1
        if path == ONE_SHOT:
            self.one_shot(x, x)
        elif path == TWO_SHOT:
            self.two_shot(x, x)
        return path != NCCL

    def one_shot(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = the sum of every rank's x (one kernel: x copied into the buffer, a barrier,
        the peers' buffers read and summed). out may be x."""
        staged = self._staging(x)
        if self._one_shot_copy is not None:
            return self._one_shot_copy(staged, x, "sum", self.group_name, out)
        staged.copy_(x)
        return self._one_shot(staged, "sum", self.group_name, out)

    def two_shot(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = the sum of every rank's x, two-shot: each rank reduces its 1/N slice of the
        buffers, then every rank gathers the reduced slices. out may be x."""
        staged = self._staging(x)
        staged.copy_(x)
        return self._two_shot(staged, "sum", self.group_name, out)

    def release_peers(self, timeout_s: float = RELEASE_TIMEOUT_S) -> bool:
        """After the peers died (the group is being aborted): let this rank's queued kernels
        finish by completing the dead peers' side of every barrier, which would otherwise spin
        forever (torch's barriers have no timeout). True once this device's default stream is
        idle; False (and an error logged) if it is not within timeout_s."""
        stream_done = torch.cuda.default_stream(self.buffer.device).query
        if stream_done():
            return True
        if self.pads is None or not self._drain(stream_done, timeout_s):
            log.error("tensor-parallel all-reduce, rank %d: kernels waiting on dead peers did not drain in %.0f s; "
                      "this process's GPU stream stays blocked: restart the process", self.rank, timeout_s)
            return False
        return True

    def _load_drain_kernel(self) -> None:
        """Run _drain's flag write once now, on flags of our own. CUDA loads a kernel lazily,
        at its first launch, and loading may wait for every kernel running on the device: a
        first launch from _drain would wait for the barrier kernel it is meant to free."""
        self._side = torch.cuda.Stream(device=self.buffer.device)  # the default stream is stuck behind the barrier
        scratch = torch.zeros_like(self.pads[self.rank]).view(-1, self.world_size)
        with torch.cuda.device(self.buffer.device), torch.cuda.stream(self._side):
            for column in range(self.world_size):
                scratch[:, column].fill_(1)
        self._side.synchronize()

    def _drain(self, stream_done: Any, timeout_s: float) -> bool:
        side = self._side
        mine = self.pads[self.rank].view(-1, self.world_size)
        deadline = time.monotonic() + timeout_s
        with torch.cuda.device(self.buffer.device), torch.cuda.stream(side):
            while time.monotonic() < deadline:
                for peer in range(self.world_size):
                    if peer != self.rank:
                        mine[:, peer].fill_(1)  # the peer arrived at this rank's barriers
                        self.pads[peer].view(-1, self.world_size)[:, self.rank].fill_(0)  # and took our arrival
                side.synchronize()
                if stream_done():
                    return True
                time.sleep(1e-4)
        return False

    def _staging(self, x: torch.Tensor) -> torch.Tensor:
        """The buffer's first bytes viewed as x (same dtype and shape)."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.capacity:
            raise ValueError(f"an all-reduce of {nbytes} bytes does not fit the {self.capacity}-byte symmetric buffer")
        return self.buffer[:nbytes].view(x.dtype).view(x.shape)


def symmetric_all_reduce(group: Any, device: torch.device, max_message_bytes: int | None, choice: str = "auto"
                         ) -> SymmetricAllReduce | None:
    """The symmetric all-reduce of ``group`` (collective: every rank calls it at the same
    point), or None where the group's own all-reduce runs every sum: ``choice`` "nccl", a
    CPU group, one rank, torch without symmetric memory, ranks that cannot reach each
    other's GPU memory. ``max_message_bytes``: the largest all-reduce a step makes (the
    buffer is sized for it, up to the largest message a symmetric path takes; None: that
    limit). Logs which path runs."""
    if choice not in CHOICES:
        raise ValueError(f"tensor_parallel_all_reduce must be one of {list(CHOICES)}, got {choice!r}")
    world_size = dist.get_world_size(group)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    reason = _local_obstacle(group, device, world_size, choice)
    if reason is None:
        reason = _peer_obstacle(group, device, world_size)
    if reason is not None:
        log.info("tensor-parallel all-reduce, rank %d: %s", dist.get_rank(group), reason)
        return None
    limit = largest_symmetric_message(world_size)
    capacity = limit if max_message_bytes is None else max(min(max_message_bytes, limit), ALIGNMENT)
    symmetric, failure = None, None
    try:
        symmetric = SymmetricAllReduce.create(group, device, capacity)
    except RuntimeError as exc:
        failure = f"the group's all-reduce (symmetric memory could not be set up: {exc})"
    if not _all_ranks_agree(group, device, failure is None):
        log.warning("tensor-parallel all-reduce, rank %d: %s", dist.get_rank(group),
                    failure or "the group's all-reduce (symmetric memory failed on another rank)")
        return None
    log.info("tensor-parallel all-reduce, rank %d: symmetric memory, one-shot up to %s, %s, the group's "
             "all-reduce above; a %s buffer per GPU", dist.get_rank(group), _size(one_shot_max_bytes(world_size)),
             f"two-shot up to {_size(TWO_SHOT_MAX_BYTES)}" if world_size in TWO_SHOT_WORLD_SIZES else "no two-shot",
             _size(symmetric.capacity))
    return symmetric


def _local_obstacle(group: Any, device: torch.device, world_size: int, choice: str) -> str | None:
    """Why this rank's group cannot use symmetric memory, by what every rank sees alike."""
    if world_size == 1:
        return "none needed (one rank)"
    backend = dist.get_backend(group)
    if choice == NCCL:
        return f"the group's {backend} all-reduce (tensor_parallel_all_reduce='nccl')"
    if device.type != "cuda" or backend != "nccl":
        return f"the group's {backend} all-reduce (symmetric memory needs CUDA devices and NCCL)"
    if not _torch_has_symmetric_memory():
        return (f"NCCL (torch {torch.__version__} lacks symmetric memory's one-shot and two-shot all-reduce; "
                "torch >= 2.8 has them)")
    return None


def _peer_obstacle(group: Any, device: torch.device, world_size: int) -> str | None:
    """Why the ranks cannot map each other's memory (collective): two ranks on one device
    index (each sees one GPU, as Ray's actors do) or a pair of GPUs without peer access."""
    mine = torch.tensor([device.index], device=device)
    indices = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(indices, mine, group=group)
    peers = [int(t.item()) for t in indices]
    if len(set(peers)) < world_size:
        return (f"NCCL (the ranks' devices are cuda:{peers}: each rank sees only its own GPU, so peer memory "
                "is not mapped; local workers see every GPU)")
    me = peers[dist.get_rank(group)]
    reachable = all(torch.cuda.can_device_access_peer(me, peer) for peer in peers if peer != me)
    if not _all_ranks_agree(group, device, reachable):
        return "NCCL (some GPUs of the group have no peer-to-peer access to each other)"
    return None


def _all_ranks_agree(group: Any, device: torch.device, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (collective; returns once this device has run it)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _torch_settings() -> None:
    """Symmetric memory's settings for this process, unless the user chose otherwise; set
    before torch's symmetric memory module loads."""
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # no NVLS object: nothing here uses it
    # a block of its own, not a pool's: a pooled block keeps the peers it was mapped with under
    # the group's name, which the next group of a process reuses after destroy_process_group
    os.environ.setdefault("TORCH_SYMMMEM_IMPLICIT_POOL", "0")


def _torch_has_symmetric_memory() -> bool:
    _torch_settings()
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    ops = torch.ops.symm_mem
    return all(hasattr(ops, name) for name in ("one_shot_all_reduce_out", "two_shot_all_reduce_out"))


def _rendezvous(symm_mem: Any, buffer: torch.Tensor, group: Any) -> Any:
    """Map every rank's buffer into this one's address space; the handle. Older torch needs
    the group registered with symmetric memory first; newer resolves it itself (and
    registering it there makes every op check the group's store)."""
    try:
        return symm_mem.rendezvous(buffer, group.group_name)
    except RuntimeError as exc:
        if "group info" not in str(exc) or not hasattr(symm_mem, "enable_symm_mem_for_group"):
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
        return symm_mem.rendezvous(buffer, group.group_name)


def _check_peers_mapped(handle: Any, buffer: torch.Tensor, group: Any) -> None:
    """RuntimeError unless each peer's buffer, as mapped here, holds what that peer just
    wrote into it (a fresh random token each): plain loads, no barrier flags, so a wrong
    mapping (stale peers of an earlier group) fails here instead of hanging a kernel."""
    world_size, device = dist.get_world_size(group), buffer.device
    token = torch.tensor([int.from_bytes(os.urandom(7), "little") + 1], dtype=torch.int64, device=device)
    tokens = [torch.empty_like(token) for _ in range(world_size)]
    dist.all_gather(tokens, token, group=group)
    buffer[:8].view(torch.int64).copy_(token)
    _all_ranks_agree(group, device, True)  # a barrier: every token written (it waits for the device)
    seen = torch.cat([handle.get_buffer(peer, [1], torch.int64, 0) for peer in range(world_size)])
    # a barrier again: every rank has read its peers' tokens before any rank writes its buffer
    if not _all_ranks_agree(group, device, torch.equal(seen, torch.cat(tokens))):
        raise RuntimeError("the peers' buffers mapped here do not hold what the peers wrote (stale mappings of an "
                           "earlier group?)")


def _signal_pads(handle: Any, world_size: int) -> list[torch.Tensor] | None:
    """Every rank's signal pad as int32 flags, [blocks * world_size] each (slot b * world + r:
    rank r's arrival at block b's barrier); None where this torch does not expose them."""
    try:
        size = handle.signal_pad_size
        if not isinstance(size, int):  # a property where torch keeps it per class
            size = type(handle).signal_pad_size
        slots = size // 4 // world_size * world_size
        return [handle.get_signal_pad(rank, [slots], dtype=torch.int32) for rank in range(world_size)]
    except (AttributeError, RuntimeError, TypeError):
        return None


def _aligned(x: torch.Tensor) -> bool:
    """Contiguous and starting ALIGNMENT bytes into its storage (whose start the allocator
    aligns): by shapes and offsets alone, so every rank of a step decides alike."""
    return x.is_cuda and x.is_contiguous() and x.storage_offset() * x.element_size() % ALIGNMENT == 0


def _size(nbytes: int) -> str:
    return f"{nbytes / MiB:.1f} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"
