"""Runs one step on the device: builds the BatchContext, runs the backbone, samples."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from adapterserve.engine.adapter_host import TOKEN_FAMILIES, family_slots
from adapterserve.engine.attention_meta import SequenceLayout, build_attention_meta
from adapterserve.engine.context import BatchContext, VirtualTokens, set_context
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.request import Request
from adapterserve.engine.sampler import sample
from adapterserve.engine.scheduler import ScheduledBatch
from adapterserve.kernels import build_adapter_meta
from adapterserve.models.decoder import DecoderModel




@dataclass
class _HostBatch:
    """The step's token-level lists, built on the host before one copy each."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    layouts: list[SequenceLayout] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)
    virtual: tuple[list[int], list[int], list[int]] = field(default_factory=lambda: ([], [], []))


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        blocks: BlockManager,
        num_slots: int,
        max_rank: int,
        max_tokens: int,
        seed: int,
    ) -> None:
        self.model = model
        self.blocks = blocks
        self.num_slots = num_slots
        param = model.embed_tokens.weight
        self.device, self.dtype = param.device, param.dtype
        cfg = model.cfg
        num_cache_slots = blocks.num_blocks * blocks.block_size + 1  # the last: trash for padding rows
        for attn in model.attention_layers():
            attn.k_cache = torch.zeros(num_cache_slots, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros_like(attn.k_cache)
        self.windows = sorted({w for w in cfg.sliding_windows if w is not None})
        self.lora_workspace = torch.empty(3, max_tokens, max(max_rank, 1), dtype=self.dtype, device=self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.families_of = lambda slot: frozenset()  # slot -> families it holds; bound by the engine
        self.prefix_pages = lambda slot: []  # slot -> KV blocks of its prefix; bound by the engine
        self.graphs = None  # DecodeGraphs, set by enable_cuda_graphs
        self.graph_signature = lambda: ()  # host state a captured graph depends on; bound by the engine

    def enable_cuda_graphs(self, max_batch: int, max_pages: int) -> None:
        from adapterserve.engine.graphs import DecodeGraphs

        trash = self.blocks.num_blocks * self.blocks.block_size
        self.graphs = DecodeGraphs(self, max_batch, max_pages, trash)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, generators: list[torch.Generator | None]) -> list:
        """One forward pass over the batch. Each generating request gets its next
        token id; each pooling request (classify, embed) its pooled hidden state."""
        host = self._host_batch(batch)
        requests = batch.requests
        if self._graph_ready(host, batch):
            slots = self._family_slots(host.slots)
            families = tuple(bool((row >= 0).any()) for row in slots)
            logits = self.graphs.run(host, slots, families, self.graph_signature())
            self.last_logits = logits
            return sample(logits, [r.sampling for r in requests], generators, self.generator)
        input_ids, positions, ctx = self._device_batch(host)
        set_context(ctx)
        try:
            last = self.model(input_ids, positions)[ctx.logits_rows]  # [B, D]
        finally:
            set_context(None)
        generating = [i for i, r in enumerate(requests) if not r.pooling]
        results: list = [last[i].float() for i in range(len(requests))]
        if generating:
            logits = self.model.compute_logits(last[generating])
            self.last_logits = logits
            tokens = sample(logits, [requests[i].sampling for i in generating],
                            [generators[i] for i in generating], self.generator)
            for i, token in zip(generating, tokens):
                results[i] = token
        return results

    def _graph_ready(self, host: _HostBatch, batch: ScheduledBatch) -> bool:
        return (self.graphs is not None and all(n == 1 for n in batch.num_new_tokens)
                and not host.virtual[0] and not any(r.pooling for r in batch.requests)
                and self.graphs.fits(len(batch.requests), max(len(s.pages) for s in host.layouts)))

    def _family_slots(self, slots: list[int]) -> np.ndarray:
        """[3, T] each token's slot per family (lora, ia3, bottleneck); -1 where unused."""
        return family_slots(slots, self.families_of)

    def _host_batch(self, batch: ScheduledBatch) -> _HostBatch:
        host = _HostBatch()
        for request, n in zip(batch.requests, batch.num_new_tokens):
            self._add_request(host, request, n)
        return host

    def _device_batch(self, host: _HostBatch) -> tuple[torch.Tensor, torch.Tensor, BatchContext]:
        dev = self.device
        windows = list(self.windows) + [None]
        ctx = BatchContext(
            attention=build_attention_meta(host.layouts, self.blocks.block_size, windows, torch.device(dev)),
            lora=None,
            lora_workspace=self.lora_workspace,
            logits_rows=torch.tensor(host.last_rows, device=dev),
            virtual=self._virtual(host),
        )
        for family, slots in zip(TOKEN_FAMILIES, self._family_slots(host.slots)):
            if (slots >= 0).any():
                setattr(ctx, family, build_adapter_meta(torch.from_numpy(slots).to(dev), self.num_slots))
        return torch.tensor(host.ids, device=dev), torch.tensor(host.positions, device=dev), ctx

    def _add_request(self, host: _HostBatch, request: Request, n: int) -> None:
        start = request.num_tokens - n
        first_row = len(host.ids)
        host.ids.extend(request.ids_from(start))
        host.positions.extend(range(request.prefix_len + start, request.prefix_len + request.num_tokens))
        prefix = self.prefix_pages(request.slot) if request.prefix_len else []
        aligned = len(prefix) * self.blocks.block_size
        host.layouts.append(SequenceLayout(prefix + request.blocks, aligned - request.prefix_len,
                                           aligned + request.num_tokens, n))
        host.slots.extend([request.slot] * n)
        host.last_rows.append(len(host.ids) - 1)
        for i in range(start, min(request.num_virtual, request.num_tokens)):
            host.virtual[0].append(first_row + i - start)
            host.virtual[1].append(request.slot)
            host.virtual[2].append(i)

    def _virtual(self, host: _HostBatch) -> VirtualTokens | None:
        if not host.virtual[0]:
            return None
        rows, slots, index = (torch.tensor(v, device=self.device) for v in host.virtual)
        return VirtualTokens(rows, slots, index)

