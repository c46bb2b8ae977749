"""CUDA graphs for decode steps, one per batch-size bucket and adapter-family mix.

Decode steps replay a captured graph over fixed input buffers; a batch of B
requests runs in the smallest bucket >= B, its padding rows marked by sentinels
the ops honour (adapter slot -1, context length 0, KV writes to a trash slot).
Adapter pools, KV caches and workspaces never move, so graphs stay valid as
adapters come and go. A family absent from the batch is absent from its graph:
base-only batches pay nothing for adapters. With the stacked LoRA layout a graph is
captured per expand a step can choose (kernels/stacked.py: tiled or grouped, from the
batch's distinct adapters, known on the host before the replay).
"""
from __future__ import annotations

import numpy as np
import torch

from adapterserve.engine.attention_meta import block_tables, longest_first
from adapterserve.engine.graph_capture import CapturedSteps, GraphPool, _key, _stacked  # noqa: F401 (_key: tests)
from adapterserve.engine.mixed_graphs import mixed_graph_limit
from adapterserve.engine.step_device import StepDevice
from adapterserve.layers.context import AttentionMeta

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def decode_graph_limits(config, max_model_len: int) -> tuple[int, int]:
    """(largest decode batch, widest block table) an engine's decode graphs cover: a
    decode step holds one token per running request within the step's token budget;
    a table holds the longest sequence's pages and a prefix adapter's."""
    page = config.block_size
    pages = -(-max_model_len // page) + -(-config.max_virtual_tokens // page)
    return min(config.max_num_seqs, config.max_num_batched_tokens), pages


def graph_limits(config, max_model_len: int) -> tuple[int, int, int, int]:
    """ModelRunner.enable_cuda_graphs' arguments for an engine: its decode graphs' limits,
    the largest mixed-step token bucket, and the requests a step holds."""
    return (*decode_graph_limits(config, max_model_len), mixed_graph_limit(config), config.max_num_seqs)


class DecodeGraphs(CapturedSteps):
    def __init__(self, runner: StepDevice, max_batch: int, max_pages: int, trash_slot: int,
                 pool: GraphPool | None = None) -> None:
        capacity = runner.sampled.shape[0]  # the tokens one step can hold (max_num_batched_tokens)
        if not 1 <= max_batch <= capacity:
            raise ValueError(f"decode graphs of up to {max_batch} rows need 1 <= max_batch <= the step's "
                             f"{capacity} tokens (max_num_batched_tokens)")
        super().__init__(runner, pool)
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]  # warm-up captures exactly these
        self.max_pages = max_pages
        self.trash_slot = trash_slot
        n, dev = max_batch, runner.device
        # the per-row inputs in two buffers, each filled by one copy a step (padding rows as the
        # ops expect them): ids, sources (row of runner.sampled, or -1), positions, cache slots to
        # write; context lengths, kv starts, decode order, each family's slots (3 rows)
        self._padding64 = np.array([[0] * n, [-1] * n, [0] * n, [trash_slot] * n], dtype=np.int64)
        self._padding32 = np.array([[0] * n, [0] * n, list(range(n)), *[[-1] * n] * 3], dtype=np.int32)
        self.rows64 = torch.tensor(self._padding64, device=dev)
        self.rows32 = torch.tensor(self._padding32, device=dev)
        self.ids, self.sources, self.positions, self.write_slots = (self.rows64[i] for i in range(4))
        self.lens, self.starts, self.order = (self.rows32[i] for i in range(3))
        self.family_slots = self.rows32[3:]
        self.tables = torch.zeros(n, max_pages, dtype=torch.int32, device=dev)
        # every graph writes its logits here: one buffer, not one per captured graph
        self.logits = torch.empty(n, runner.model.cfg.vocab_size, dtype=torch.float32, device=dev)

    def fits(self, batch_size: int, max_pages: int) -> bool:
        return batch_size <= self.buckets[-1] and max_pages <= self.max_pages

    def run(self, host, family_slots: np.ndarray, families: tuple[bool, bool, bool], signature: tuple = ()
            ) -> torch.Tensor:
        """Replay the decode step for this batch; float32 logits [B, V]. ``signature``:
        per family, host state the captured ops depend on (``_key``)."""
        size = len(host.layouts)
        bucket = self.bucket_of(size)
        self._fill(host, family_slots, size, bucket)
        return self.replay(bucket, family_slots, families, signature)[:size]

    def bucket_of(self, batch_size: int) -> int:
        """The bucket a decode step of batch_size rows replays."""
        return next(b for b in self.buckets if b >= batch_size)

    def _fill(self, host, family_slots: np.ndarray, size: int, bucket: int) -> None:
        page = self.runner.block_size
        rows64, rows32 = self._padding64.copy(), self._padding32.copy()
        ids, sources, positions, writes = rows64
        lens, starts, order, slots = rows32[0], rows32[1], rows32[2], rows32[3:]
        ids[:size], sources[:size], positions[:size] = host.ids, host.sources, host.positions
        layouts = host.layouts
        lens[:size] = [s.context_len for s in layouts]
        starts[:size] = [s.kv_start for s in layouts]
        tables = block_tables(layouts, bucket, self.max_pages)
        last = lens[:size].astype(np.int64) - 1  # each row's new token
        writes[:size] = tables[np.arange(size), last // page].astype(np.int64) * page + last % page
        order[:bucket] = longest_first(lens[:bucket])
        slots[:, : family_slots.shape[1]] = family_slots
        self.staging.copy_into(self.rows64, rows64)
        self.staging.copy_into(self.rows32, rows32)
        self.staging.copy_into(self.tables[:bucket], tables)

    def _forward(self, bucket: int, families: tuple[bool, bool, bool], expand: str = "tiled") -> torch.Tensor:
        runner = self.runner
        attention = AttentionMeta(
            write_slots=self.write_slots[:bucket], block_tables=self.tables[:bucket],
            context_lens=self.lens[:bucket], kv_start=self.starts[:bucket],
            page_size=runner.block_size, decode=True, decode_order=self.order[:bucket],
        )
        return self._logits(bucket, attention, families, expand, None, self.logits[:bucket])
