"""LoRA pools: every adapter-aware linear's LoraSlices, and the row allocators.

An adapter takes one row range per projection kind (shared by all layers), as
long as its largest rank for that kind; kinds it does not target take nothing.
Linears of the same shape in every layer share stacked tensors ([layers, ...]),
each layer's LoraSlices a view of its row: placing an adapter is then a few large
copies per projection, not one per layer. In the stacked layout (kernels/stacked.py)
each linear's A rows live under its own base weight instead (beside it, in a buffer of
their own, with the fused linear), copied layer by layer, and the pool keeps the row bucket
its stacked GEMMs cover.

On tensor-parallel linears each rank keeps its part (A's columns on row-parallel layers,
B's rows on column-parallel ones) in the host copy it stages: through its layers' spans
from a whole adapter (rank 0), or all of an AdapterShard cut for it (engine/adapter_shard.py).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.engine.adapter_shard import linear_part
from adapterserve.engine.host_copy import pinned_copy
from adapterserve.engine.row_allocator import RowAllocator
from adapterserve.kernels import LoraSlices
from adapterserve.kernels.stacked import RowsInUse, fused_max_rows, row_bucket, stack_apart, stack_weight
from adapterserve.layers.linear import AdapterLinear


class _Stack:
    """The pooled tensors of one linear role (e.g. every layer's qkv_proj)."""

    def __init__(self, linears: list[tuple[int, AdapterLinear]], num_slots: int, pool_rows: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str, stacked: RowsInUse | None = None) -> None:
        self.layers = [layer for layer, _ in linears]
        first = linears[0][1]
        self.linear = first  # how the role is split over tensor-parallel ranks (all alike)
        self.kinds, n = first.slice_kinds, len(first.slice_kinds)
        self.in_features = first.in_features
        self.offsets = [0]
        for width in first.slice_widths:
            self.offsets.append(self.offsets[-1] + width)
        count = len(linears)
        self.b = torch.zeros(count, pool_rows, self.offsets[-1], dtype=dtype, device=device)
        self.row_start = torch.zeros(count, n, num_slots, dtype=torch.int32, device=device)
        self.rank = torch.zeros(count, n, num_slots, dtype=torch.int32, device=device)
        if stacked is None:
            self.a: torch.Tensor | None = torch.zeros(count, n, pool_rows, first.in_features, dtype=dtype,
                                                      device=device)
            a_layers = list(self.a)
        else:
            self.a = None
            a_layers = [_stack_under_weight(linear, pool_rows, dtype, stacked) for _, linear in linears]
        for i, (_, linear) in enumerate(linears):
            linear.lora = LoraSlices(a_layers[i], self.b[i], self.row_start[i], self.rank[i], tuple(self.offsets),
                                     max_rank)
        self.a_layers = a_layers  # [n, pool_rows, K] per layer

    @torch.no_grad()
    def write(self, slot: int, adapter: Adapter, rows: dict[str, tuple[int, int]], staged: dict) -> None:
        """Copy an adapter in; the copies are asynchronous from pinned memory on a GPU, so the
        host goes on scheduling and the next step's kernels queue behind them."""
        for s, kind in enumerate(self.kinds):
            start, width = rows[kind]
            self.row_start[:, s, slot] = start
            if kind not in staged:
                staged.update(self.stage(adapter))
            ranks, a, b = staged[kind]
            self.rank[:, s, slot].copy_(ranks, non_blocking=True)
            if not width:
                continue
            if self.a is not None:
                self.a[:, s, start : start + width].copy_(a, non_blocking=True)
            else:  # stacked: each layer's A rows sit under its own weight
                for a_layer, a_rows in zip(self.a_layers, a):
                    a_layer[s, start : start + width].copy_(a_rows, non_blocking=True)
            self.b[:, start : start + width, self.offsets[s] : self.offsets[s + 1]].copy_(b, non_blocking=True)

    def stage(self, adapter: Adapter) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per kind: ranks [layers], A [layers, r, in], scaled B^T [layers, r, out] in the pool's
        dtype, in pinned host memory on a GPU: the host copy that loads fast."""
        staged = {}
        for s, kind in enumerate(self.kinds):
            width = adapter.lora.kind_rank(kind)
            modules = adapter.lora.modules
            ranks = torch.tensor([modules[(l, kind)].rank if (l, kind) in modules else 0 for l in self.layers],
                                 dtype=torch.int32)
            a, b = self._packed(adapter, s, width)
            staged[kind] = (pinned_copy(ranks), a, b) if self.b.is_cuda else (ranks, a, b)
        return staged

    def _packed(self, adapter: Adapter, s: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tensors [layers, width, in] of A and [layers, width, out] of scaled B^T for slice s,
        zero-padded (this rank's part under tensor parallelism), in pinned memory on a GPU (the
        copies to it are then asynchronous). One stacked copy per tensor when every layer has the
        full width: a copy per layer is a parallel CPU region each, and on busy many-core hosts each
        region costs milliseconds (BENCHMARKS.md, "The host's CPU threads")."""
        kind, out = self.kinds[s], self.offsets[s + 1] - self.offsets[s]
        spans = linear_part(self.linear, adapter)
        modules = [adapter.lora.modules.get((layer, kind)) for layer in self.layers]
        pin, dtype, layers = self.b.is_cuda, self.b.dtype, len(self.layers)
        if width and all(module is not None and module.rank == width for module in modules):
            a = torch.empty(layers, width, self.in_features, dtype=dtype, pin_memory=pin)
            b = torch.empty(layers, width, out, dtype=dtype, pin_memory=pin)
            a.copy_(torch.stack([spans.input_part(module.a, 1) for module in modules]))
            b_parts = torch.stack([spans.output_part(module.b, 0, s) for module in modules])  # [layers, out, width]
            scalings = torch.tensor([module.scaling for module in modules], dtype=torch.float32).view(-1, 1, 1)
            b.copy_((b_parts.float() * scalings).transpose(1, 2))
            return a, b
        a = torch.zeros(layers, width, self.in_features, dtype=dtype, pin_memory=pin)
        b = torch.zeros(layers, width, out, dtype=dtype, pin_memory=pin)
        for i, module in enumerate(modules):
            if module is not None:
                a[i, : module.rank] = spans.input_part(module.a, 1)
                b[i, : module.rank] = spans.output_part((module.b * module.scaling).T, 1, s)
        return a, b

    def clear(self, slot: int) -> None:
        self.rank[:, :, slot] = 0


def _stack_under_weight(linear: AdapterLinear, pool_rows: int, dtype: torch.dtype, rows_in_use: RowsInUse
                        ) -> torch.Tensor:
    """Move the linear's weight into a [W; A] buffer (its weight a view of it; the old tensor
    is freed, so at most one layer's weight exists twice); returns the A pool view. With the
    fused linear (rows_in_use.fused) the weight stays where it is, its A rows in a buffer of
    their own (stack_apart)."""
    n_slices = len(linear.slice_kinds)
    if rows_in_use.fused:
        linear.stacked = stack_apart(linear.weight.data, n_slices, pool_rows, rows_in_use, dtype)
        return linear.stacked.lora_a()
    if linear.weight.dtype != dtype:
        raise ValueError(
            f"the stacked LoRA layout needs the base weight in the adapters' dtype {dtype}, got "
            f"{linear.weight.dtype}; use lora_decode='kernels'"
        )
    stacked = stack_weight(linear.weight.data, n_slices, pool_rows, rows_in_use)
    linear.weight = torch.nn.Parameter(stacked.weight(), requires_grad=False)
    linear.stacked = stacked
    return stacked.lora_a()


class LoraPool:
    """``stacked``: keep each linear's A rows under its base weight; ``fused``: and let steps with
    few adapters run each linear in one launch (EngineConfig.lora_decode)."""

    family = "lora"

    def __init__(self, linears: list[tuple[int, AdapterLinear]], num_slots: int, pool_rows: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str, stacked: bool = False, fused: bool = False) -> None:
        roles: dict[tuple, list[tuple[int, AdapterLinear]]] = defaultdict(list)
        for layer, linear in linears:
            roles[(linear.slice_kinds, linear.slice_widths, linear.in_features)].append((layer, linear))
        self.pool_rows = pool_rows
        weights = linears[0][1].weight.dtype if linears else dtype
        self.rows_in_use = RowsInUse(fused_rows=fused_max_rows(weights) if fused else 0) if stacked else None
        self.stacks = [_Stack(group, num_slots, pool_rows, max_rank, dtype, device, self.rows_in_use)
                       for group in roles.values()]
        kinds = sorted({kind for stack in self.stacks for kind in stack.kinds})
        self.allocators = {kind: RowAllocator(pool_rows) for kind in kinds}
        self._rows: dict[int, dict[str, tuple[int, int]]] = {}  # slot -> kind -> (start, rows)

    def place(self, slot: int, adapter: Adapter) -> bool:
        if adapter.lora is None:
            return True
        need = {kind: adapter.lora.kind_rank(kind) for kind in self.allocators}
        rows = self._alloc(need)
        if rows is None:
            return False
        self._rows[slot] = rows
        staged = adapter.staged.setdefault("lora", [{} for _ in self.stacks])
        for stack, stack_staged in zip(self.stacks, staged):
            stack.write(slot, adapter, rows, stack_staged)
        self._update_rows_in_use()
        return True

    def rules(self) -> dict[str, Any]:
        return {}

    def prepare(self, adapter: Adapter) -> None:
        """Stage the adapter's host copy now (on add), so placing it later only copies."""
        if adapter.lora is not None and "lora" not in adapter.staged:
            adapter.staged["lora"] = [stack.stage(adapter) for stack in self.stacks]

    def clear(self, slot: int) -> None:
        rows = self._rows.pop(slot, None)
        if rows is None:
            return
        self._free(rows)
        for stack in self.stacks:
            stack.clear(slot)
        self._update_rows_in_use()

    def stacked_rows(self) -> int:
        """Pool rows the stacked GEMMs cover now (0 without the stacked layout): a host
        value the captured decode graphs depend on."""
        return 0 if self.rows_in_use is None else self.rows_in_use.rows

    @property
    def fused_rows(self) -> int:
        """The largest row bucket a step of the fused linear covers (0: no fused linear)."""
        return 0 if self.rows_in_use is None else self.rows_in_use.fused_rows

    def graph_part(self) -> tuple:
        """The LoRA part of a decode graph's key: the stacked GEMMs' row bucket (their
        shape); nothing without the stacked layout."""
        return () if self.rows_in_use is None else ("stacked_rows", self.rows_in_use.rows)

    def row_buckets(self) -> list[int]:
        """Every row bucket the stacked GEMMs can cover (a decode graph each); [] without
        the stacked layout."""
        if self.rows_in_use is None:
            return []
        return sorted({row_bucket(high, self.pool_rows) for high in range(1, self.pool_rows + 1)})

    @contextmanager
    def covering(self, rows: int) -> Iterator[None]:
        """Run as if the stacked GEMMs covered ``rows`` pool rows (a bucket of row_buckets at
        least the rows in use; place nothing meanwhile): warm-up captures each bucket's
        decode graphs in it."""
        if self.rows_in_use is None or rows not in self.row_buckets() or rows < self.rows_in_use.rows:
            raise ValueError(f"rows must be one of the stacked row buckets >= the rows in use, got {rows}")
        self.rows_in_use.rows = rows
        try:
            yield
        finally:
            self._update_rows_in_use()

    @contextmanager
    def for_step(self, lora_slots: np.ndarray) -> Iterator[None]:
        """Run a step with the stacked GEMMs covering only the rows of its own adapters
        (``lora_slots``: each token's LoRA slot, -1 none), not every resident adapter's: the
        bucket of ``_step_rows``. With the fused linear, whose windows begin at the step's lowest
        rows (kernels/stacked_fused.py), idle adapters then cost its step nothing wherever they
        sit. The bucket is one of row_buckets, so its decode graphs exist; the graph key reads it."""
        if self.rows_in_use is None:
            yield
            return
        used = {slot for slot in lora_slots.tolist() if slot >= 0}
        pool_bucket = self.rows_in_use.rows  # nothing is placed during a step: put back as it was
        self.rows_in_use.rows = row_bucket(self._step_rows(used), self.pool_rows)
        try:
            yield
        finally:
            self.rows_in_use.rows = pool_bucket

    def _step_rows(self, used: set[int]) -> int:
        """The pool rows a step on the ``used`` slots covers: their highest row (a [W; A] GEMM reads
        from row 0), or with the fused linear their widest span on one kind (each slice's window
        begins at its own lowest row)."""
        spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for slot in used:
            for kind, (start, n) in self._rows.get(slot, {}).items():
                if n:
                    spans[kind].append((start, start + n))
        if not self.rows_in_use.fused:
            return max((end for kind in spans.values() for _, end in kind), default=0)
        return max((max(end for _, end in kind) - min(start for start, _ in kind) for kind in spans.values()),
                   default=0)

    def _update_rows_in_use(self) -> None:
        if self.rows_in_use is None:
            return
        high = max((start + n for rows in self._rows.values() for start, n in rows.values()), default=0)
        self.rows_in_use.rows = row_bucket(high, self.pool_rows)

    def _alloc(self, need: dict[str, int]) -> dict[str, tuple[int, int]] | None:
        got: dict[str, tuple[int, int]] = {}
        for kind, rows in need.items():
            start = self.allocators[kind].alloc(rows)
            if start is None:
                self._free(got)
                return None
            got[kind] = (start, rows)
        return got

    def _free(self, rows: dict[str, tuple[int, int]]) -> None:
        for kind, (start, n) in rows.items():
            self.allocators[kind].free(start, n)
