"""Runs one step on the device: builds the BatchContext, runs the backbone, samples."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adapterserve.engine.attention_meta import SequenceLayout, build_attention_meta
from adapterserve.engine.context import BatchContext, VirtualTokens, set_context
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.request import Request
from adapterserve.engine.sampler import sample
from adapterserve.engine.scheduler import ScheduledBatch
from adapterserve.kernels import build_adapter_meta
from adapterserve.models.decoder import DecoderModel

FAMILIES = ("lora", "ia3", "bottleneck")


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
        num_cache_slots = blocks.num_blocks * blocks.block_size
        for attn in model.attention_layers():
            attn.k_cache = torch.zeros(num_cache_slots, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros_like(attn.k_cache)
        self.windows = sorted({w for w in cfg.sliding_windows if w is not None})
        self.lora_workspace = torch.empty(3, max_tokens, max(max_rank, 1), dtype=self.dtype, device=self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.families_of = lambda slot: frozenset()  # slot -> families it holds; bound by the engine
        self.prefix_pages = lambda slot: []  # slot -> KV blocks of its prefix; bound by the engine

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, generators: list[torch.Generator | None]) -> list:
        """One forward pass over the batch. Each generating request gets its next
        token id; each pooling request (classify, embed) its pooled hidden state."""
        input_ids, positions, ctx = self._prepare(batch)
        set_context(ctx)
        try:
            last = self.model(input_ids, positions)[ctx.logits_rows]  # [B, D]
        finally:
            set_context(None)
        requests = batch.requests
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

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, BatchContext]:
        host = _HostBatch()
        for request, n in zip(batch.requests, batch.num_new_tokens):
            self._add_request(host, request, n)
        dev = self.device
        windows = list(self.windows) + [None]
        ctx = BatchContext(
            attention=build_attention_meta(host.layouts, self.blocks.block_size, windows, torch.device(dev)),
            lora=None,
            lora_workspace=self.lora_workspace,
            logits_rows=torch.tensor(host.last_rows, device=dev),
            virtual=self._virtual(host),
        )
        for family in FAMILIES:
            setattr(ctx, family, self._family_meta(host.slots, family))
        return torch.tensor(host.ids, device=dev), torch.tensor(host.positions, device=dev), ctx

    def _add_request(self, host: _HostBatch, request: Request, n: int) -> None:
        start = request.num_tokens - n
        first_row = len(host.ids)
        host.ids.extend(request.all_ids[start:])
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

    def _family_meta(self, slots: list[int], family: str):
        token_slots = [s if s >= 0 and family in self.families_of(s) else -1 for s in slots]
        if all(s < 0 for s in token_slots):
            return None
        return build_adapter_meta(torch.tensor(token_slots, device=self.device), self.num_slots)
