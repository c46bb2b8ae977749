"""Runs one step on the device: builds the BatchContext, runs the backbone, samples."""
from __future__ import annotations

import torch

from adapterserve.engine.context import AttentionMeta, BatchContext, set_context
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.request import Request
from adapterserve.engine.sampler import sample
from adapterserve.engine.scheduler import ScheduledBatch
from adapterserve.kernels import build_adapter_meta
from adapterserve.models.decoder import DecoderModel


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

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, generators: list[torch.Generator | None]) -> list[int]:
        """One forward pass over the batch; returns each request's next token."""
        input_ids, positions, ctx = self._prepare(batch)
        set_context(ctx)
        try:
            hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden[ctx.logits_rows])
        finally:
            set_context(None)
        self.last_logits = logits
        return sample(logits, [r.sampling for r in batch.requests], generators, self.generator)

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, BatchContext]:
        ids, positions, write_slots, token_slots, last_rows = [], [], [], [], []
        for request, n in zip(batch.requests, batch.num_new_tokens):
            start = request.num_tokens - n
            all_ids = request.all_ids
            ids.extend(all_ids[start:])
            span = range(start, request.num_tokens)
            positions.extend(span)
            write_slots.extend(self.blocks.slot(request.blocks, p) for p in span)
            token_slots.extend([request.slot] * n)
            last_rows.append(len(ids) - 1)
        dev = self.device
        attention = self._attention_meta(batch, positions, write_slots)
        has_adapter = any(r.slot >= 0 for r in batch.requests)
        adapters = build_adapter_meta(torch.tensor(token_slots, device=dev), self.num_slots) if has_adapter else None
        ctx = BatchContext(
            attention=attention,
            adapters=adapters,
            lora_workspace=self.lora_workspace,
            logits_rows=torch.tensor(last_rows, device=dev),
        )
        return torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), ctx

    def _attention_meta(self, batch: ScheduledBatch, positions: list[int], write_slots: list[int]) -> AttentionMeta:
        requests, counts = batch.requests, batch.num_new_tokens
        qmax = max(counts)
        kmax = max(r.num_tokens for r in requests)
        kv_slots = torch.zeros(len(requests), kmax, dtype=torch.long)
        query_pad = torch.zeros(len(requests), qmax, dtype=torch.long)
        query_pos = torch.full((len(requests), qmax), -1, dtype=torch.long)
        token_pad, first = [], 0
        for b, (request, n) in enumerate(zip(requests, counts)):
            slots = [self.blocks.slot(request.blocks, p) for p in range(request.num_tokens)]
            kv_slots[b, : len(slots)] = torch.tensor(slots)
            query_pad[b, :n] = torch.arange(first, first + n)
            query_pad[b, n:] = first
            query_pos[b, :n] = torch.tensor(positions[first : first + n])
            token_pad.extend(b * qmax + j for j in range(n))
            first += n
        key_pos = torch.arange(kmax)
        qp = query_pos.unsqueeze(-1)
        causal = key_pos <= qp  # [B, Qmax, Kmax]
        padding_rows = (query_pos < 0).unsqueeze(-1) & (key_pos == 0)
        mask = causal | padding_rows
        sliding = {w: (causal & (key_pos > qp - w)) | padding_rows for w in self.windows}
        dev = self.device
        return AttentionMeta(
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=dev),
            kv_slots=kv_slots.to(dev),
            mask=mask.unsqueeze(1).to(dev),
            query_pad=query_pad.to(dev),
            token_pad=torch.tensor(token_pad, dtype=torch.long, device=dev),
            sliding_masks={w: m.unsqueeze(1).to(dev) for w, m in sliding.items()} or None,
        )
