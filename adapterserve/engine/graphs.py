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

from adapterserve.engine.attention_meta import longest_first
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
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.sources = torch.full((n,), -1, dtype=torch.long, device=dev)  # row of runner.sampled, or -1
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.write_slots = torch.full((n,), trash_slot, dtype=torch.long, device=dev)
        self.tables = torch.zeros(n, max_pages, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.starts = torch.zeros(n, dtype=torch.int32, device=dev)
        self.order = torch.arange(n, dtype=torch.int32, device=dev)
        self.family_slots = torch.full((3, n), -1, dtype=torch.int32, device=dev)
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
        ids = np.zeros(bucket, dtype=np.int64)
        ids[:size] = host.ids
        sources = np.full(bucket, -1, dtype=np.int64)
        sources[:size] = host.sources
        positions = np.zeros(bucket, dtype=np.int64)
        positions[:size] = host.positions
        lens = np.zeros(bucket, dtype=np.int32)
        starts = np.zeros(bucket, dtype=np.int32)
        writes = np.full(bucket, self.trash_slot, dtype=np.int64)
        tables = np.zeros((bucket, self.max_pages), dtype=np.int32)
        for b, s in enumerate(host.layouts):
            lens[b], starts[b] = s.context_len, s.kv_start
            tables[b, : len(s.pages)] = s.pages
            last = s.context_len - 1
            writes[b] = s.pages[last // page] * page + last % page
        for buffer, values in ((self.ids, ids), (self.sources, sources), (self.positions, positions),
                               (self.lens, lens), (self.starts, starts), (self.write_slots, writes),
                               (self.order, longest_first(lens))):
            self.staging.copy_into(buffer[:bucket], values)
        self.staging.copy_into(self.tables[:bucket], tables)
        self._copy_family_slots(family_slots)

    def _forward(self, bucket: int, families: tuple[bool, bool, bool], expand: str = "tiled") -> torch.Tensor:
        runner = self.runner
        attention = AttentionMeta(
            write_slots=self.write_slots[:bucket], block_tables=self.tables[:bucket],
            context_lens=self.lens[:bucket], kv_start=self.starts[:bucket],
            page_size=runner.block_size, decode=True, decode_order=self.order[:bucket],
        )
        return self._logits(bucket, attention, families, expand, None, self.logits[:bucket])
