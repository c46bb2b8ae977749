"""CUDA graphs for steps with prefill tokens (prompts or prompt chunks, decode rows beside them).

An eager step with prefills is bound by the host's kernel launches; a captured one is
a single replay. A step of T tokens over R requests replays the graph of the smallest
token bucket >= T (MIXED_BUCKETS, up to ``EngineConfig.mixed_graph_tokens``); a
bucket of b tokens holds up to min(max_num_seqs, b) requests, so every step of T
tokens fits its bucket (each request has at least one token). Padding tokens: adapter
slot -1 in every family, position 0, id 0, their KV written to the trash slot;
padding requests: no new tokens (cu_q flat), context 0, no tiles (the prefill kernel
skips the lists' padding entries). Logits are computed for every request row of the
bucket (padding rows read token row 0) into one buffer; the generating rows come
first. Graph keys, capture and the memory pool are shared with decode graphs
(engine/graph_capture.py); buckets above STACKED_MAX_TOKENS run the segmented LoRA
kernels, so their keys leave out the stacked layout's row bucket and expand. LoRA
shrinks run on the compute stream (the side stream is for decode steps).

Steps that stay eager: see ModelRunner._mixed_ready.
"""
from __future__ import annotations

import numpy as np
import torch

from adapterserve.engine.attention_meta import step_arrays
from adapterserve.engine.graph_capture import CapturedSteps, GraphPool
from adapterserve.engine.step_device import StepInputs
from adapterserve.kernels.prefill_tiles import (
    DEFAULT_TILE_TOKENS,
    NO_SEQUENCE,
    PrefillTiles,
    padded_lengths,
    padded_tile_lists,
)
from adapterserve.kernels.stacked import STACKED_MAX_TOKENS
from adapterserve.layers.context import AttentionMeta

MIXED_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def mixed_graph_limit(config) -> int:
    """The largest token bucket an engine's mixed graphs cover (0: none): the configured
    one, never above a step's token budget."""
    return min(config.mixed_graph_tokens, config.max_num_batched_tokens)


class MixedGraphs(CapturedSteps):
    def __init__(self, runner, max_tokens: int, max_requests: int, max_pages: int, trash_slot: int,
                 pool: GraphPool | None = None) -> None:
        """max_tokens: the largest bucket (<= the step's token capacity); max_requests:
        max_num_seqs; max_pages: block-table width (as decode graphs')."""
        capacity = runner.sampled.shape[0]
        if not 1 <= max_tokens <= capacity:
            raise ValueError(f"mixed graphs of up to {max_tokens} tokens need 1 <= mixed_graph_tokens <= the "
                             f"step's {capacity} tokens (max_num_batched_tokens)")
        super().__init__(runner, pool)
        self.buckets = [b for b in MIXED_BUCKETS if b < max_tokens] + [max_tokens]  # warm-up captures these
        self.request_limit = max_requests
        self.max_pages = max_pages
        self.trash_slot = trash_slot
        tokens, requests, dev = max_tokens, self.max_requests(max_tokens), runner.device
        single, multi = padded_lengths(tokens, requests)
        self.ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.sources = torch.full((tokens,), -1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.write_slots = torch.full((tokens,), trash_slot, dtype=torch.long, device=dev)
        self.family_slots = torch.full((3, tokens), -1, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(requests, max_pages, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(requests, dtype=torch.int32, device=dev)
        self.starts = torch.zeros(requests, dtype=torch.int32, device=dev)
        self.cu_q = torch.zeros(requests + 1, dtype=torch.int32, device=dev)
        self.single = torch.full((single, 2), NO_SEQUENCE, dtype=torch.int32, device=dev)
        self.multi = torch.full((multi, 2), NO_SEQUENCE, dtype=torch.int32, device=dev)
        self.logits_rows = torch.zeros(requests, dtype=torch.long, device=dev)  # token row of each logits row
        self.logits = torch.empty(requests, runner.model.cfg.vocab_size, dtype=torch.float32, device=dev)

    def max_requests(self, bucket: int) -> int:
        return min(self.request_limit, bucket)

    def runs_stacked(self, bucket: int) -> bool:
        return bucket <= STACKED_MAX_TOKENS  # larger steps keep the segmented LoRA kernels

    def bucket_of(self, num_tokens: int) -> int:
        """The bucket a step of num_tokens tokens replays."""
        return next(b for b in self.buckets if b >= num_tokens)

    def fits(self, num_tokens: int, num_requests: int, max_pages: int) -> bool:
        return (num_tokens <= self.buckets[-1] and max_pages <= self.max_pages
                and num_requests <= self.max_requests(self.bucket_of(num_tokens)))

    def run(self, host: StepInputs) -> torch.Tensor:
        """Replay the step; float32 logits of the generating requests [G, V], in host.generating's order."""
        bucket = self.bucket_of(len(host.ids))
        self._fill(host, bucket)
        logits = self.replay(bucket, host.family_slots, host.families, host.signature)
        return logits[: len(host.generating)]

    def _fill(self, host: StepInputs, bucket: int) -> None:
        size, requests = len(host.ids), self.max_requests(bucket)
        step = step_arrays(host.layouts, self.runner.block_size, self.max_pages)
        token_values = ((self.ids, host.ids, 0), (self.sources, host.sources, -1),
                        (self.positions, host.positions, 0), (self.write_slots, step.write, self.trash_slot))
        for buffer, values, pad in token_values:
            self.staging.copy_into(buffer[:bucket], _padded(values, bucket, pad, np.int64))
        self._copy_family_slots(host.family_slots)
        tables = np.zeros((requests, self.max_pages), dtype=np.int32)
        tables[: len(step.tables)] = step.tables
        self.staging.copy_into(self.tables[:requests], tables)
        for buffer, values in ((self.lens, step.lens), (self.starts, step.starts)):
            self.staging.copy_into(buffer[:requests], _padded(values, requests, 0, np.int32))
        cu = np.full(requests + 1, size, dtype=np.int32)
        cu[: len(step.counts) + 1] = np.concatenate([[0], np.cumsum(step.counts)])
        self.staging.copy_into(self.cu_q[: requests + 1], cu)
        single, multi = padded_tile_lists(step.counts, step.lens, bucket, requests, DEFAULT_TILE_TOKENS)
        self.staging.copy_into(self.single[: len(single)], single)
        self.staging.copy_into(self.multi[: len(multi)], multi)
        rows = np.asarray(host.last_rows, dtype=np.int64)[np.asarray(host.generating, dtype=np.int64)]
        self.staging.copy_into(self.logits_rows[:requests], _padded(rows, requests, 0, np.int64))

    def _forward(self, bucket: int, families: tuple[bool, bool, bool], expand: str = "tiled") -> torch.Tensor:
        runner, requests = self.runner, self.max_requests(bucket)
        single, multi = padded_lengths(bucket, requests)
        attention = AttentionMeta(
            write_slots=self.write_slots[:bucket], block_tables=self.tables[:requests],
            context_lens=self.lens[:requests], kv_start=self.starts[:requests], page_size=runner.block_size,
            decode=False, cu_q=self.cu_q[: requests + 1],
            tiles=PrefillTiles(self.single[:single], self.multi[:multi], DEFAULT_TILE_TOKENS),
        )
        return self._logits(bucket, attention, families, expand, self.logits_rows[:requests],
                            self.logits[:requests])


def _padded(values, length: int, pad: int, dtype) -> np.ndarray:
    out = np.full(length, pad, dtype=dtype)
    out[: len(values)] = values
    return out
