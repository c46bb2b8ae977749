"""Tensor parallelism: this rank's place in a torch.distributed group and the
collectives the sharded layers use (Megatron-style column/row parallelism).

Collectives are the plain torch.distributed ones, synchronous (async_op=False), on
the caller's tensors: with NCCL they are enqueued behind the current stream's work
and the current stream waits for them, so a CUDA graph captures them and the host
never waits; with gloo (CPU) they run at once. A group with a symmetric all-reduce
(layers/symm_allreduce.py) sums the messages it takes over peer memory instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from adapterserve.layers.symm_allreduce import SymmetricAllReduce

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass(frozen=True)
class TensorParallel:
    """rank of world_size ranks in ``group`` (None only at world_size 1); ``symmetric``: the
    group's all-reduce over peer memory, which sums what it takes (None: the group's own)."""

    rank: int
    world_size: int
    group: Any = None  # a torch.distributed ProcessGroup
    symmetric: SymmetricAllReduce | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor parallel rank {self.rank} is not in [0, world_size={self.world_size})")
        if self.world_size == 1:
            return
        if self.group is None:
            raise ValueError(f"tensor parallel world_size {self.world_size} needs a process group, got None")
        group_size, group_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if (group_size, group_rank) != (self.world_size, self.rank):
            raise ValueError(
                f"tensor parallel rank {self.rank} of world_size {self.world_size} does not match its process "
                f"group, which has {group_size} ranks and calls this one {group_rank}"
            )

    def all_reduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """x summed (op "max": its maximum) over the ranks, in place; returns x."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        if self.world_size == 1:
            return x
        if op == "sum" and self.symmetric is not None and self.symmetric.all_reduce_(x):
            return x
        dist.all_reduce(x, op=_REDUCE_OPS[op], group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order (x itself at world 1)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:  # one buffer [world, *x.shape]: one NCCL launch, capturable
            out = x.new_empty((self.world_size, *x.shape))
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of t along dim (a view; t itself at world 1)."""
        start, length = self.span(t.shape[dim], f"a tensor of shape {tuple(t.shape)} along dim {dim}")
        return t if self.world_size == 1 else t.narrow(dim, start, length)

    def span(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's part of ``size`` items (see split_span)."""
        return split_span(size, self.rank, self.world_size, what)

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of this rank's KV heads (see kv_head_span)."""
        return kv_head_span(num_kv_heads, self.rank, self.world_size)


def split_span(size: int, rank: int, world_size: int, what: str) -> tuple[int, int]:
    """(start, length) of rank's contiguous part of ``size`` items split over world_size
    ranks; ValueError naming ``what`` when size does not divide by world_size."""
    if size % world_size:
        raise ValueError(f"{what} has size {size}, which does not divide by the tensor parallel "
                         f"world size {world_size}")
    length = size // world_size
    return rank * length, length



def kv_head_span(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first, count) of rank's KV heads: its contiguous share when world_size divides them;
    else, when they divide world_size, the one head its contiguous query heads read (each
    head then held by world_size / num_kv_heads ranks). ValueError otherwise."""
    if num_kv_heads % world_size == 0:
        return split_span(num_kv_heads, rank, world_size, "num_key_value_heads")
    if world_size % num_kv_heads == 0:
        return rank // (world_size // num_kv_heads), 1
    raise ValueError(f"num_key_value_heads={num_kv_heads} must divide by the tensor parallel world size "
                     f"{world_size} or divide it (then each KV head is replicated)")


SINGLE = TensorParallel(0, 1, None)
