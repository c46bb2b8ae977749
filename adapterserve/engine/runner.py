"""Runs one step on the device: builds the BatchContext, runs the backbone, samples.

``run`` launches the step and returns at once: the sampled ids stay on the device
(where the next step reads them as its input) and reach the host through a pinned
copy the caller waits for later, so the host can prepare step n+1 while the GPU
runs step n.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from adapterserve.engine.adapter_host import TOKEN_FAMILIES, family_slots
from adapterserve.engine.attention_meta import SequenceLayout, build_attention_meta
from adapterserve.engine.host_copy import to_device
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.penalties import PenaltyState
from adapterserve.engine.request import Request
from adapterserve.engine.sampler import sample
from adapterserve.engine.scheduler import ScheduledBatch
from adapterserve.kernels import build_adapter_meta
from adapterserve.layers.context import BatchContext, VirtualTokens, set_context
from adapterserve.models.decoder import DecoderModel


def with_sampled_ids(ids: torch.Tensor, sources: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Input ids from the host, each row whose source is >= 0 taking the id the step
    before sampled into that row of ``sampled`` (a token not yet on the host)."""
    return torch.where(sources >= 0, sampled[sources.clamp(min=0)], ids)


def _completes(request: Request, num_new_tokens: int) -> bool:
    """Whether computing num_new_tokens more brings the request to its last known token."""
    return request.num_computed + num_new_tokens == request.num_tokens


@dataclass
class StepResult:
    """A launched step's results: the generating rows' token ids (host tensor,
    valid once ``ready`` has fired) and each pooling request's hidden state."""

    requests: list[Request]
    tokens: torch.Tensor | None  # [G] long, generating requests in batch order
    ready: torch.cuda.Event | None
    pooled: list[torch.Tensor | None]  # per request: float32 hidden state of a pooling request

    def token_ids(self) -> list[int]:
        """Waits for the GPU to finish the step."""
        if self.ready is not None:
            self.ready.synchronize()
        return [] if self.tokens is None else self.tokens.tolist()


@dataclass
class _HostBatch:
    """The step's token-level lists, built on the host before one copy each."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    layouts: list[SequenceLayout] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)  # per token: row of `sampled` holding its id, or -1
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
        self.lora_workspace = torch.empty(3, max_tokens, max(max_rank, 1), dtype=self.dtype, device=self.device)
        self.sampled = torch.zeros(max_tokens, dtype=torch.long, device=self.device)  # last step's token ids
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.penalties = PenaltyState(model.cfg.vocab_size, self.device)
        self.families_of = lambda slot: frozenset()  # slot -> families it holds; bound by the engine
        self.prefix_pages = lambda slot: []  # slot -> KV blocks of its prefix; bound by the engine
        self.graphs = None  # DecodeGraphs, set by enable_cuda_graphs
        self.graph_signature = lambda: ()  # host state a captured graph depends on; bound by the engine

    def enable_cuda_graphs(self, max_batch: int, max_pages: int) -> None:
        from adapterserve.engine.graphs import DecodeGraphs

        trash = self.blocks.num_blocks * self.blocks.block_size
        self.graphs = DecodeGraphs(self, max_batch, max_pages, trash)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, generators: list[torch.Generator | None]) -> StepResult:
        """Launch one forward pass over the batch. Each request whose tokens this step
        completes gets a result: a generating one samples its next token, a pooling one
        (classify, embed) gets its pooled hidden state; a prompt chunk short of the end
        of its request only fills the KV cache."""
        host = self._host_batch(batch)
        requests = batch.requests
        done = [i for i, (r, n) in enumerate(zip(requests, batch.num_new_tokens)) if _completes(r, n)]
        generating = [i for i in done if not requests[i].pooling]
        pooled: list[torch.Tensor | None] = [None] * len(done)
        if self._graph_ready(host, batch, len(done)):
            slots = self._family_slots(host.slots)
            families = tuple(bool((row >= 0).any()) for row in slots)
            logits = self.graphs.run(host, slots, families, self.graph_signature())
        else:
            last = self._forward_eager(host)
            for k, i in enumerate(done):
                if requests[i].pooling:
                    pooled[k] = last[i].float()
            logits = self.model.compute_logits(last[generating]) if generating else None
        self.last_logits = logits
        finished = [requests[i] for i in done]
        if not generating:
            return StepResult(finished, None, None, pooled)
        rows = [requests[i] for i in generating]  # in the order of the logits' rows
        penalties = self.penalties.prepare(rows)
        tokens = sample(logits, [r.sampling for r in rows], [generators[i] for i in generating],
                        self.generator, penalties)
        self.penalties.record(penalties, tokens)
        for row, i in enumerate(generating):
            requests[i].pending_row = row
        return self._publish(finished, tokens, pooled)

    @staticmethod
    def completing(batch: ScheduledBatch) -> list[Request]:
        """The batch's requests whose tokens this step completes (they get a result)."""
        return [r for r, n in zip(batch.requests, batch.num_new_tokens) if _completes(r, n)]

    def _forward_eager(self, host: _HostBatch) -> torch.Tensor:
        """The backbone outside a CUDA graph; hidden states of each request's last row [B, D]."""
        input_ids, positions, ctx = self._device_batch(host)
        set_context(ctx)
        try:
            return self.model(input_ids, positions)[ctx.logits_rows]
        finally:
            set_context(None)

    def _publish(self, requests: list[Request], tokens: torch.Tensor, pooled: list) -> StepResult:
        """Keep the ids on the device for the next step's input; start their copy to the host."""
        self.sampled[: tokens.shape[0]].copy_(tokens)
        if not tokens.is_cuda:
            return StepResult(requests, tokens.clone(), None, pooled)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return StepResult(requests, host, ready, pooled)

    def _graph_ready(self, host: _HostBatch, batch: ScheduledBatch, num_done: int) -> bool:
        return (self.graphs is not None and num_done == len(batch.requests)
                and all(n == 1 for n in batch.num_new_tokens)
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
        ctx = BatchContext(
            attention=build_attention_meta(host.layouts, self.blocks.block_size, torch.device(dev)),
            lora=None,
            lora_workspace=self.lora_workspace,
            logits_rows=to_device(host.last_rows, dev, torch.long),
            virtual=self._virtual(host),
        )
        for family, slots in zip(TOKEN_FAMILIES, self._family_slots(host.slots)):
            if (slots >= 0).any():
                setattr(ctx, family, build_adapter_meta(to_device(slots, dev), self.num_slots))
        return self._input_ids(host), to_device(host.positions, dev, torch.long), ctx

    def _input_ids(self, host: _HostBatch) -> torch.Tensor:
        ids, sources = (to_device(v, self.device, torch.long) for v in (host.ids, host.sources))
        return with_sampled_ids(ids, sources, self.sampled)

    def _add_request(self, host: _HostBatch, request: Request, n: int) -> None:
        """The request's next n tokens (from its first not yet computed): a whole prompt,
        a chunk of one, or a decode's one token."""
        start, end = request.num_computed, request.num_computed + n
        first_row = len(host.ids)
        ids = request.token_ids(start, end)
        host.sources.extend([-1] * len(ids))
        if len(ids) < n:  # the last input: sampled by the step before, not yet on the host
            ids.append(0)
            host.sources.append(request.pending_row)
        host.ids.extend(ids)
        host.positions.extend(range(request.prefix_len + start, request.prefix_len + end))
        prefix = self.prefix_pages(request.slot) if request.prefix_len else []
        aligned = len(prefix) * self.blocks.block_size
        host.layouts.append(SequenceLayout(prefix + request.blocks, aligned - request.prefix_len, aligned + end, n))
        host.slots.extend([request.slot] * n)
        host.last_rows.append(len(host.ids) - 1)
        for i in range(start, min(request.num_virtual, end)):
            host.virtual[0].append(first_row + i - start)
            host.virtual[1].append(request.slot)
            host.virtual[2].append(i)

    def _virtual(self, host: _HostBatch) -> VirtualTokens | None:
        if not host.virtual[0]:
            return None
        rows, slots, index = (to_device(v, self.device, torch.long) for v in host.virtual)
        return VirtualTokens(rows, slots, index)

